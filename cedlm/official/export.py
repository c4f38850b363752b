"""Writing a cedlm model in the official DeepSeek-V4.1 checkpoint layout.

Names are the official ones (cedlm's own), dtypes and quantisation follow `layout.py` (FP8 32x32
block weights, packed-FP4 routed experts with 1x32 scales, FP8 Engram tables with per-row 1x32
scales, BF16 / F32 elsewhere), tensors go into `model-0000i-of-0000n.safetensors` shards of at
most `shard_bytes` (a single tensor larger than that gets its own shard; Engram tables come last,
as in the official checkpoint) with `model.safetensors.index.json`, and config.json is the
official nested schema with `quantization_config` (fp8, dynamic activations, [32, 32] blocks,
ue8m0 scales, fp4 experts). The directory is written beside DST and renamed into place.

The export rounds every weight (quantisation, or BF16); `ExportReport.errors` gives the relative
RMS and max-abs error per format. The DSpark drafter (`mtp.*`, stored like the main layers) and
the vision tower (`vision.*`, `aligner.*`, `image_*`, BF16) are written when the model has them,
and the loader reads them back (tests/test_official_round_trip.py).
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from cedlm.config import ModelConfig
from cedlm.model import CEDModel
from cedlm.official import layout as L
from cedlm.official.dequant import (BLOCK, block_scale_shape, dequant_fp4, dequant_fp8_block,
                                    fp4_packed_shape, fp4_scale_shape, quant_fp4, quant_fp8_block,
                                    quant_fp8_rows, rows_scale_shape)
from cedlm.official.headers import INDEX_NAME
from cedlm.util import atomic_directory

DEFAULT_SHARD_BYTES = 5 << 30
_ROW_CHUNK_ELEMS = 1 << 24


def official_config(cfg: ModelConfig, block: int = BLOCK, expert_dtype: str = "fp4") -> dict:
    """cfg in the official nested schema with its `quantization_config` (before text_config)."""
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [block, block],
          "scale_fmt": "ue8m0", "expert_dtype": expert_dtype}
    out: dict = {}
    for k, v in cfg.to_dict().items():
        if k == "quantization_config":
            continue
        if k == "text_config":
            out["quantization_config"] = qc
        out[k] = v
    out.setdefault("quantization_config", qc)
    return out


def stored_bytes(name: str, shape: tuple[int, ...], block: int = BLOCK) -> int:
    """Bytes a tensor takes in the official layout (weight + scale)."""
    fmt = L.storage_format(name)
    n = int(np.prod(shape)) if shape else 1
    if fmt in L.QUANTISED and len(shape) != 2:
        fmt = L.BF16
    if fmt == L.FP8_BLOCK:
        return n + int(np.prod(block_scale_shape(shape, (block, block))))
    if fmt == L.FP4_EXPERT:
        return int(np.prod(fp4_packed_shape(shape))) + int(np.prod(fp4_scale_shape(shape)))
    if fmt == L.FP8_ROWS:
        return n + int(np.prod(rows_scale_shape(shape)))
    return n * (4 if fmt == L.F32 else 2)


@dataclass
class ExportReport:
    path: str
    shards: int
    tensors: int                                          # written, scales included
    total_bytes: int
    formats: dict[str, int] = field(default_factory=dict)
    # format -> {"rel_rms": ||deq - w|| / ||w||, "max_abs": max |deq - w|}
    errors: dict[str, dict[str, float]] = field(default_factory=dict)

    def summary(self) -> str:
        fm = ", ".join(f"{k} {v:,}" for k, v in sorted(self.formats.items()))
        err = "; ".join(f"{k} rel RMS {v['rel_rms']:.2e}, max |err| {v['max_abs']:.2e}"
                        for k, v in sorted(self.errors.items()))
        return (f"wrote {self.path}: {self.shards} shard(s), {self.tensors:,} tensors, "
                f"{self.total_bytes / 2**20:,.2f} MiB ({fm}); weight rounding: {err}")


class _Errors:
    def __init__(self):
        self.sq: dict[str, list[float]] = {}

    def add(self, fmt: str, ref: torch.Tensor, deq: torch.Tensor) -> None:
        ref = ref.detach().float()
        d = deq.float() - ref
        acc = self.sq.setdefault(fmt, [0.0, 0.0, 0.0])
        acc[0] += float(d.square().sum(dtype=torch.float64))
        acc[1] += float(ref.square().sum(dtype=torch.float64))
        acc[2] = max(acc[2], float(d.abs().max()) if d.numel() else 0.0)

    def result(self) -> dict[str, dict[str, float]]:
        return {k: {"rel_rms": (v[0] / v[1]) ** 0.5 if v[1] else 0.0, "max_abs": v[2]}
                for k, v in self.sq.items()}


def _quantise(name: str, t: torch.Tensor, block: int, errors: _Errors) -> dict[str, torch.Tensor]:
    """One float tensor -> its official stored tensor(s)."""
    fmt = L.storage_format(name)
    t = t.detach().to(torch.float32)
    if fmt in L.QUANTISED and t.dim() != 2:
        fmt = L.BF16
    if fmt == L.FP8_BLOCK:
        q, s = quant_fp8_block(t, (block, block))
        errors.add(fmt, t, dequant_fp8_block(q, s, (block, block)))
        return {name: q, L.scale_name(name): s}
    if fmt == L.FP4_EXPERT:
        q, s = quant_fp4(t)
        errors.add(fmt, t, dequant_fp4(q, s, k=t.shape[1]))
        return {name: q, L.scale_name(name): s}
    if fmt == L.FP8_ROWS:                       # Engram tables: row chunks (they can be large)
        step = max(1, _ROW_CHUNK_ELEMS // max(t.shape[1], 1))
        qs, ss = [], []
        for r in range(0, t.shape[0], step):
            q, s = quant_fp8_rows(t[r:r + step])
            errors.add(fmt, t[r:r + step], dequant_fp8_block(q, s, (1, BLOCK)))
            qs.append(q)
            ss.append(s)
        return {name: torch.cat(qs), L.scale_name(name): torch.cat(ss)}
    out = t.contiguous() if fmt == L.F32 else t.to(torch.bfloat16)
    errors.add(fmt, t, out.float())
    return {name: out}


def _tensors(model: CEDModel) -> dict[str, torch.Tensor]:
    """Every persistent tensor by official name, Engram tables last (memory-mapped ones too)."""
    sd = dict(model.state_dict())
    tables = {}
    for layer in model.cfg.engram_layer_ids:
        eng = model.layers[layer].engram
        key = f"layers.{layer}.engram.embed.weight"
        if key in sd:
            tables[key] = sd.pop(key)
        elif getattr(eng, "host_table", None) is not None:
            with warnings.catch_warnings():         # read-only memmap: only read here
                warnings.simplefilter("ignore", UserWarning)
                tables[key] = torch.from_numpy(np.asarray(eng.host_table))
    return {**sd, **tables}


def _shards(sizes: dict[str, int], shard_bytes: int) -> list[list[str]]:
    """Greedy, in order: a shard closes when the next tensor would take it past shard_bytes."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, b in sizes.items():
        if shards[-1] and used + b > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += b
    return shards


class NotOfficialError(ValueError):
    """An engine following the official config would read the model differently (one line)."""


def export_official(model: CEDModel, dst: str | Path, tokenizer=None, *,
                    shard_bytes: int = DEFAULT_SHARD_BYTES, block: int = BLOCK,
                    extra_files: dict[str, str] | None = None,
                    allow_cedlm_fields: bool = False) -> ExportReport:
    """Write `model` (and `tokenizer`) to DST in the official layout; returns the report.
    `extra_files` ({name: text}, e.g. `cedlm.train.model_card.model_files`) are written with it.
    A model that an engine following the official config would read differently (its Engram
    map, RoPE precision or tokenizer: `cedlm.official.compat`) is refused with `NotOfficialError`
    naming each difference, unless `allow_cedlm_fields` (cedlm itself reads its own block of
    config.json back)."""
    from cedlm.official.compat import official_differences
    if not isinstance(model, CEDModel) or model.cfg.family != "ced":
        raise ValueError("export: the official layout holds the V4.1 CED model "
                         f"(got {type(model).__name__}, family {model.cfg.family!r})")
    diffs = official_differences(model.cfg, tokenizer)
    if diffs and not allow_cedlm_fields:
        raise NotOfficialError("export: an engine following the official config would read this model "
                               "differently: " + "; ".join(diffs)
                               + " (--allow-cedlm-fields / allow_cedlm_fields=True exports it anyway)")
    dst = Path(dst)
    tensors = _tensors(model)
    sizes = {n: stored_bytes(n, tuple(t.shape), block) for n, t in tensors.items()}
    shards = _shards(sizes, shard_bytes)
    n = len(shards)
    errors = _Errors()
    weight_map: dict[str, str] = {}
    formats: dict[str, int] = {}
    total = 0
    with atomic_directory(dst) as tmp:
        for i, names in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{n:05d}.safetensors"
            out: dict[str, torch.Tensor] = {}
            for name in names:
                stored = _quantise(name, tensors[name], block, errors)
                fmt = L.storage_format(name) if len(stored) == 2 else (
                    L.F32 if stored[name].dtype == torch.float32 else L.BF16)
                formats[fmt] = formats.get(fmt, 0) + 1
                out.update(stored)
            for k, v in out.items():
                weight_map[k] = fname
                total += v.numel() * v.element_size()
            save_file({k: v.contiguous() for k, v in out.items()}, str(tmp / fname),
                      metadata={"format": "pt"})
            del out
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(official_config(model.cfg, block), indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
    return ExportReport(str(dst), n, len(weight_map), total, formats, errors.result())


__all__ = ["export_official", "official_config", "stored_bytes", "ExportReport",
           "DEFAULT_SHARD_BYTES", "NotOfficialError"]
