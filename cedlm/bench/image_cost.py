"""Measured cost of an image on a runnable vision model, beside the planner's numbers.

    python -m cedlm.bench.image_cost MODEL_DIR [--sizes 8x8 168x42 640x480] [--repeats 7] [--threads 1]

For each image size: the vision tower time (ViT + aligner + span rows; median of `repeats`, after
one warm-up), the prompt positions of the span, and the KV bytes the image adds to a sequence:
`SequenceState.nbytes()` (global rows: main KV + index keys) after prefilling a prompt with the
image, minus the same prompt without it, next to the planner's tokens x KV bytes per token
(`cedlm.plan.image_cost`). Window rings are per sequence and do not grow with the image.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def measure(model_dir: str, sizes: list[tuple[int, int]], repeats: int = 7) -> list[dict]:
    from PIL import Image

    from cedlm.checkpoint import load_model
    from cedlm.config.vision import vision_config_of
    from cedlm.engine.images import expand, span_embeds
    from cedlm.model.vision import encode_image
    from cedlm.plan.image_cost import image_cost
    from cedlm.text.images import preprocess
    model, tok = load_model(model_dir)
    if model.image_token_id is None:
        raise ValueError(f"model: {model_dir} has no vision tower")
    vc = vision_config_of(model.cfg)
    rows = []
    g = torch.Generator().manual_seed(0)
    for w, h in sizes:
        arr = (torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy()
        im = preprocess(Image.fromarray(arr), vc)
        times = []
        with torch.no_grad():
            encode_image(model, im.patches, im.vit_grid, im.llm_grid)
            for _ in range(repeats):
                t0 = time.perf_counter()
                encode_image(model, im.patches, im.vit_grid, im.llm_grid)
                times.append(time.perf_counter() - t0)
        prompt = [tok.bos_id if hasattr(tok, "bos_id") else 0, 5, model.image_token_id, 7, 8]
        ids, ims = expand(model, prompt, [im])
        with_img = model.new_state()
        with_img.images = span_embeds(model, ims)
        model.prefill(ids, with_img)
        without = model.new_state()
        model.prefill([t for t in prompt if t != model.image_token_id], without)
        a, b = with_img.nbytes(), without.nbytes()
        glob = lambda d: d["main_kv"] + d["index_keys"]             # noqa: E731
        plan = image_cost(model.cfg, w, h)
        rows.append({"size": f"{w}x{h}", "tokens": im.num_tokens, "vit_grid": list(im.vit_grid),
                     "tower_ms_median": round(statistics.median(times) * 1e3, 3),
                     "kv_bytes_measured": glob(a) - glob(b), "kv_bytes_planner": plan["kv_bytes"],
                     "kv_bytes_per_token": plan["kv_bytes_per_token"],
                     "tower_gflops": plan["tower_gflops"]})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cedlm.bench.image_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", metavar="MODEL_DIR")
    ap.add_argument("--sizes", nargs="+", default=["8x8", "168x42", "640x480"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    try:
        sizes = [tuple(int(v) for v in s.lower().split("x")) for s in a.sizes]
        rows = measure(a.model, sizes, a.repeats)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"threads": a.threads, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
