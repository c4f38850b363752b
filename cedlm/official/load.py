"""Reading a checkpoint in the official DeepSeek-V4.1 layout (sharded, quantised safetensors).

    DIR/config.json                         the official nested schema with `quantization_config`
    DIR/model.safetensors.index.json        {"metadata": {"total_size"}, "weight_map": {name: shard}}
    DIR/model-0000i-of-0000n.safetensors    the shards (or one model.safetensors without an index)
    DIR/tokenizer.json ...                  the tokenizer (read by `cedlm.checkpoint.load_model`)

Steps, each failing before the next starts:

1. headers: every shard's safetensors header is parsed (8-byte length + JSON); no tensor data
   is read. The index must agree with the headers.
2. memory: the float32 bytes of the text-model tensors (the model is dequantised at load) are
   compared with the RAM this process can use (MemAvailable, and the cgroup limit): too large
   fails here with the sizes, instead of swapping half-way. Engram tables can instead be
   memory-mapped from float32 `.npy` files (`engram_mmap=DIR`, checked against free disk).
3. layout: names, dtypes and shapes are checked against the model `config.json` describes
   (built on the meta device: no memory); missing, unexpected and malformed tensors are listed
   together, grouped by kind. The DSpark drafter (`mtp.*`) and the vision tower (`vision.*`,
   `aligner.*`, `image_*`) are part of the model when the checkpoint has their tensors
   (`model_config_for`, shared with cedlm's own layout) and then load as strictly as the rest;
   `ffn.gate.bias_vl` is loaded into its buffer.
4. load: the model is built with its large tensors left on the meta device (no init, no memory),
   then every tensor is read lazily through `safetensors.safe_open` (memory-mapped) in row
   chunks, dequantised (`dequant.py`) and assigned; peak memory is the float32 model plus one
   chunk.

`load_official(path)` returns the dequantised state dict (no model is kept);
`load_official_model(path)` returns a `CEDModel` in eval mode with its Engram token map set from
the directory's tokenizer; `cedlm.checkpoint.load_model` dispatches here for an official-layout
directory (`is_official_layout`).
"""
from __future__ import annotations

import math
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from cedlm.config import ModelConfig
from cedlm.model import build_model
from cedlm.official import layout as L
from cedlm.official.dequant import BLOCK, cdiv, dequant_fp4, dequant_fp8_block
from cedlm.official.errors import GIB, CheckpointTooLargeError, OfficialCheckpointError
from cedlm.official.headers import (
    INDEX_NAME, SINGLE_NAME, TensorInfo, checkpoint_files, is_official_layout, read_header, read_tensor_infos,
)
from cedlm.official.memory import HEADROOM, MemoryAccount, available_memory, check_memory, checkpoint_memory
from cedlm.official.plan import Entry, LoadReport, check_quant_config, plan_load, quantization_config

CHUNK_ELEMS = 1 << 24           # output elements dequantised per read (64 MiB of float32)
META_MIN_NUMEL = 1 << 12        # weights at least this large are built on the meta device

# The names importable from here before the steps moved to their own modules.
__all__ = [
    "INDEX_NAME", "SINGLE_NAME", "HEADROOM", "CHUNK_ELEMS", "META_MIN_NUMEL", "GIB",
    "OfficialCheckpointError", "CheckpointTooLargeError", "TensorInfo", "read_header", "checkpoint_files",
    "read_tensor_infos", "is_official_layout", "available_memory", "MemoryAccount", "checkpoint_memory",
    "Entry", "LoadReport", "quantization_config", "plan_load", "ShardReader", "load_official_model",
    "OfficialCheckpoint", "load_official",
]


# ============================================================================ 4. reading
class _LargeOnMeta(TorchFunctionMode):
    """`torch.empty` calls (how nn.Linear, nn.Embedding and the router allocate their weights)
    of at least `min_numel` elements without an explicit device go to the meta device, and
    in-place initialisation of meta tensors is skipped: the model's weights are then neither
    allocated nor initialised before the load overwrites them. Other factories (`randn`,
    `zeros`, ... followed by arithmetic) stay real: meta arithmetic goes through slow Python
    reference kernels."""

    def __init__(self, min_numel: int):
        super().__init__()
        self.min_numel = min_numel

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.startswith("_"):      # in-place (init) ops
            target = args[0] if args else kwargs.get("tensor", kwargs.get("input"))
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        if func is torch.empty and kwargs.get("device") is None:
            size = args[0] if args and isinstance(args[0], (tuple, list, torch.Size)) else args
            try:
                n = math.prod(int(x) for x in size)
            except (TypeError, ValueError):
                n = 0
            if n >= self.min_numel:
                kwargs["device"] = "meta"
        return func(*args, **kwargs)


def _build(cfg: ModelConfig, meta_min_numel: int, dspark: bool):
    with torch.no_grad(), _LargeOnMeta(meta_min_numel):
        return build_model(cfg, dspark=dspark)


def model_config_for(cfg: ModelConfig, names, where) -> tuple[ModelConfig, bool]:
    """The model a checkpoint's tensor names ask for, in either layout: (config, build the DSpark
    drafter). The drafter is built when `mtp.*` tensors are present; the vision tower when its
    tensors are present (config.json must then describe it); a `vision_config` whose tensors are
    absent loads as the text model (the config is returned without it)."""
    from cedlm.config.vision import vision_enabled
    dspark, vision = L.components(names)
    if vision and not vision_enabled(cfg):
        raise OfficialCheckpointError(
            f"{where}: the checkpoint has vision tensors (vision.*, aligner.*, image_*) but "
            "config.json describes no vision tower (vision_config and image_token_id)")
    return (cfg if vision else _without(cfg, ("vision_config",))), dspark


class ShardReader:
    """Lazy tensor slices through safe_open (one memory-mapped handle per shard)."""

    def __init__(self, stack: ExitStack):
        from safetensors import safe_open
        self._open, self._stack, self._handles = safe_open, stack, {}

    def slice(self, info: TensorInfo, r0: int, r1: int) -> torch.Tensor:
        h = self._handles.get(info.file)
        if h is None:
            h = self._handles[info.file] = self._stack.enter_context(
                self._open(str(info.file), framework="pt", device="cpu"))
        sl = h.get_slice(info.name)
        return sl[r0:r1] if info.shape else sl[:]


def _chunks(e: Entry) -> list[tuple[int, int]]:
    rows = e.shape[0] if e.shape else 1
    width = math.prod(e.shape[1:]) if len(e.shape) > 1 else 1
    step = max(1, CHUNK_ELEMS // max(width, 1))
    if e.fmt in (L.FP8_BLOCK,):
        step = max(e.block[0], step // e.block[0] * e.block[0])
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def _read_into(e: Entry, reader: ShardReader, out: torch.Tensor) -> None:
    """Dequantise entry `e` chunk by chunk into the float32 tensor `out` (shape e.shape)."""
    for r0, r1 in _chunks(e):
        w = reader.slice(e.weight, r0, r1)
        if e.fmt == "plain":
            part = w
        elif e.fmt == L.FP4_EXPERT:
            part = dequant_fp4(w, reader.slice(e.scale, r0, r1), k=e.shape[1])
        elif e.fmt == L.FP8_ROWS:
            part = dequant_fp8_block(w, reader.slice(e.scale, r0, r1), (1, BLOCK))
        else:
            br = e.block[0]
            part = dequant_fp8_block(w, reader.slice(e.scale, r0 // br, cdiv(r1, br)), e.block)
        if out.dim() == 0:
            out.copy_(part.reshape(()))
        else:
            out[r0:r1].copy_(part)


def _current(model: nn.Module, name: str) -> torch.Tensor:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    return getattr(mod, attr)


def _assign(model: nn.Module, name: str, value: torch.Tensor) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    old = mod._parameters.get(attr)
    if old is not None:
        setattr(mod, attr, nn.Parameter(value, requires_grad=old.requires_grad))
    elif attr in mod._buffers:
        setattr(mod, attr, value)
    else:                                           # plan_load matched names: cannot happen
        raise OfficialCheckpointError(f"{name}: no such parameter or buffer in the model")


def _prepare(path, memory_bytes, engram_mmap, meta_min_numel):
    """Headers, memory check, model skeleton (large tensors on meta), layout check."""
    ckpt = Path(path)
    infos, files = read_tensor_infos(ckpt)
    acc = checkpoint_memory(ckpt, memory_bytes, infos)
    check_memory(acc, None if engram_mmap is None else Path(engram_mmap))
    cfg = ModelConfig.from_json(ckpt / "config.json")
    qc = quantization_config(cfg)
    check_quant_config(qc, ckpt)
    cfg, dspark = model_config_for(_without(cfg, ("quantization_config",)), infos, ckpt)
    if cfg.engram_layer_ids and not (ckpt / "tokenizer.json").exists():
        raise OfficialCheckpointError(
            f"{ckpt}: no tokenizer.json: the Engram token map (compressed ids) comes from the "
            "checkpoint's tokenizer")
    model = _build(cfg, meta_min_numel, dspark)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    entries, report = plan_load(ckpt, infos, qc, files, expected)
    return ckpt, model, entries, report


def _without(cfg: ModelConfig, drop: tuple[str, ...]) -> ModelConfig:
    """cfg without the named top-level config.json blocks (`quantization_config`: the loaded
    model is float; `vision_config`: a text-only load)."""
    extra = dict(cfg.extra or {})
    if "top" in extra:
        extra["top"] = {k: v for k, v in extra["top"].items() if k not in drop}
    if "top_keys" in extra:
        extra["top_keys"] = [k for k in extra["top_keys"] if k not in drop]
    cfg.extra = extra
    return cfg


def load_official_model(path: str | Path, *, engram_mmap: str | Path | None = None,
                        memory_bytes: int | None = None, meta_min_numel: int = META_MIN_NUMEL,
                        device: str | torch.device = "cpu"):
    """-> (CEDModel in eval mode, LoadReport) from an official-layout checkpoint directory.

    Weights are dequantised to float32 at load. `engram_mmap=DIR`: the Engram tables are
    dequantised into float32 `.npy` files there and memory-mapped (`Engram.host_table`) instead
    of held in RAM. `memory_bytes` replaces the detected available RAM (the early size check).
    `device`: where the weights go (a torch.device or its name), each tensor moved there as it is
    read (the host holds one at a time); memory-mapped Engram tables stay in host memory.
    """
    device = torch.device(device)
    t0 = time.perf_counter()
    ckpt, model, entries, report = _prepare(path, memory_bytes, engram_mmap, meta_min_numel)
    mmap_dir = None if engram_mmap is None else Path(engram_mmap)
    ram = 0
    with ExitStack() as stack:
        reader = ShardReader(stack)
        for e in sorted(entries, key=lambda e: (str(e.weight.file), e.name)):
            dtype = _current(model, e.name).dtype
            if mmap_dir is not None and ".engram.embed." in e.name:
                _load_engram_mmap(model, e, reader, mmap_dir)
                continue
            out = torch.empty(e.shape, dtype=torch.float32)
            _read_into(e, reader, out)
            if dtype != torch.float32:
                out = out.to(dtype)
            _assign(model, e.name, out.to(device))
            ram += out.numel() * out.element_size()
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:                                         # a large tensor no checkpoint entry filled
        raise OfficialCheckpointError(f"{ckpt}: not loaded, left unallocated: {', '.join(left[:8])}")
    report.ram_bytes = ram
    _release_freed_memory()
    if mmap_dir is not None:
        report.engram = f"float32 .npy files memory-mapped from {mmap_dir}"
    model.to(device)                                 # what no entry replaced (small tensors, buffers)
    _set_token_map(model, ckpt)
    report.seconds = time.perf_counter() - t0
    model.eval()
    model.official_load_report = report
    return model, report


def _set_token_map(model: nn.Module, ckpt: Path) -> None:
    """The Engram map from the directory's tokenizer (as `cedlm.checkpoint.load_model` does for
    every layout): without it the model would hash the identity map."""
    from cedlm.text.engram_map import set_token_map
    from cedlm.text.tokenizer import load_tokenizer
    if model.cfg.engram_layer_ids:                   # tokenizer.json: checked in _prepare
        set_token_map(model, load_tokenizer(ckpt))


def _release_freed_memory() -> None:
    """Hand the load's freed temporaries back to the OS (glibc keeps them otherwise: measured
    on the small model, resident memory after the load drops from 1.8x to 1.17x the weights)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _load_engram_mmap(model: nn.Module, e: Entry, reader: ShardReader, directory: Path) -> None:
    """Dequantise an Engram table into DIR/engram.L.npy and memory-map it (Engram.host_table)."""
    layer = int(e.name.split(".")[1])
    eng = model.layers[layer].engram
    path = directory / f"engram.{layer}.npy"
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=e.shape)
    _read_into(e, reader, torch.from_numpy(arr))
    arr.flush()
    del arr
    eng.host_table = np.load(path, mmap_mode="r")
    del eng.embed


@dataclass
class OfficialCheckpoint:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    report: LoadReport


def load_official(path: str | Path, *, memory_bytes: int | None = None) -> OfficialCheckpoint:
    """The dequantised float32 state dict (cedlm = official names), the config and the report,
    without building a model (`CEDModel(cfg).load_state_dict(sd, strict=False)` takes it; the
    optional tensors in `report.defaulted` keep their built value)."""
    t0 = time.perf_counter()
    ckpt, model, entries, report = _prepare(path, memory_bytes, None, META_MIN_NUMEL)
    cfg = model.cfg
    del model
    sd: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        reader = ShardReader(stack)
        for e in sorted(entries, key=lambda e: (str(e.weight.file), e.name)):
            out = torch.empty(e.shape, dtype=torch.float32)
            _read_into(e, reader, out)
            sd[e.name] = out
    report.ram_bytes = sum(t.numel() * 4 for t in sd.values())
    _release_freed_memory()
    report.seconds = time.perf_counter() - t0
    return OfficialCheckpoint(cfg, sd, report)
