"""The cost of one image, from the config alone: prompt positions, KV bytes, vision-tower FLOPs.

    python -m cedlm.plan.image_cost [--model deepseek-v4.1-flash|DIR] [--size 640x480 ...]

An image of W x H pixels occupies `image_token_count` prompt positions (its span: start, rows of
n_llm_w image rows + a newline, end); each costs the model's global KV bytes per token (the
positions flow through the CED stack like text). The tower's FLOPs count the matrix products
(2 per multiply-add): patch embedding, per block the fused QKV, the N x N attention (scores and
values), the output projection and the SwiGLU MLP, then the aligner (3x3 unfold -> D -> D). A time
is FLOPs / the device's dense BF16 peak: a lower bound (the planner knows no utilisation).
"""
from __future__ import annotations

import argparse
import json
import sys

from cedlm.config import ModelConfig
from cedlm.config.vision import vision_config_of
from cedlm.plan.kvbytes import kv_bytes_per_token
from cedlm.plan.params import param_counts
from cedlm.text.images import image_grid, num_image_tokens

# Dense BF16 peak (no sparsity), vendor datasheets.
PEAK_BF16_TFLOPS = {"NVIDIA H100 SXM": 989.0, "NVIDIA H200": 989.0}


def tower_flops(cfg: ModelConfig, vit_grid: tuple[int, int], llm_grid: tuple[int, int]) -> int:
    vc = vision_config_of(cfg)
    N = vit_grid[0] * vit_grid[1]
    M = llm_grid[0] * llm_grid[1]
    Dv, I, D, r, p = vc.hidden_size, vc.intermediate_size, cfg.hidden_size, vc.downsample_ratio, vc.patch_size
    block = 2 * N * Dv * 3 * Dv + 2 * 2 * N * N * Dv + 2 * N * Dv * Dv + 2 * N * Dv * 2 * I + 2 * N * I * Dv
    return (2 * N * 3 * p * p * Dv + vc.num_hidden_layers * block
            + 2 * M * Dv * r * r * D + 2 * M * D * D)


def image_cost(cfg: ModelConfig, width: int, height: int) -> dict:
    vc = vision_config_of(cfg)
    if vc is None:
        raise ValueError("model: the config has no vision_config")
    vg, lg = image_grid(width, height, vc)
    tokens = num_image_tokens(*lg)
    kv = kv_bytes_per_token(cfg)["total"]
    fl = tower_flops(cfg, vg, lg)
    return {"size": f"{width}x{height}", "vit_grid": list(vg), "llm_grid": list(lg), "tokens": tokens,
            "kv_bytes_per_token": kv, "kv_bytes": tokens * kv, "tower_gflops": round(fl / 1e9, 3),
            "tower_ms_at_peak": {d: round(fl / (t * 1e12) * 1e3, 4) for d, t in PEAK_BF16_TFLOPS.items()},
            "vision_params": param_counts(cfg)["vision"]}


def _config(name: str) -> ModelConfig:
    from pathlib import Path
    p = Path(name)
    if (p / "config.json").exists():
        return ModelConfig.from_json(p / "config.json")
    return ModelConfig.preset(name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cedlm.plan.image_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deepseek-v4.1-flash", help="preset name or model dir")
    ap.add_argument("--size", nargs="+", default=["640x480", "1024x1024", "1920x1080"], help="WxH")
    a = ap.parse_args(argv)
    try:
        cfg = _config(a.model)
        rows = [image_cost(cfg, *map(int, s.lower().split("x"))) for s in a.size]
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
