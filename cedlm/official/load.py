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
   together, grouped by kind. `mtp.*`, `vision.*`, `aligner.*` and `image_*` are skipped and
   reported; `ffn.gate.bias_vl` is loaded into its (text-unused) buffer.
4. load: the model is built with its large tensors left on the meta device (no init, no memory),
   then every tensor is read lazily through `safetensors.safe_open` (memory-mapped) in row
   chunks, dequantised (`dequant.py`) and assigned; peak memory is the float32 model plus one
   chunk.

`load_official(path)` returns the dequantised state dict (no model is kept);
`load_official_model(path)` returns a `CEDModel` in eval mode; `cedlm.checkpoint.load_model`
dispatches here for an official-layout directory (`is_official_layout`).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from cedlm.config import ModelConfig
from cedlm.model import build_model
from cedlm.official import layout as L
from cedlm.official.dequant import (BLOCK, block_scale_shape, cdiv, dequant_fp4, dequant_fp8_block,
                                    fp4_scale_shape, rows_scale_shape)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
HEADROOM = 1.10                 # RAM needed = float32 bytes x this (activations, allocator, Python)
CHUNK_ELEMS = 1 << 24           # output elements dequantised per read (64 MiB of float32)
META_MIN_NUMEL = 1 << 12        # weights at least this large are built on the meta device
GIB = 1 << 30

_DTYPE_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1,
                "BF16": 2, "F16": 2, "I16": 2, "F32": 4, "I32": 4, "F64": 8, "I64": 8}
_PACKED_FP4 = ("I8", "U8")
_FP8 = ("F8_E4M3",)


class OfficialCheckpointError(ValueError):
    """The directory does not hold a loadable official-layout checkpoint (the message lists why)."""


class CheckpointTooLargeError(MemoryError):
    """Loading would need more RAM (or disk) than this machine has; nothing was loaded."""


def _size(n: float) -> str:
    """Bytes in GiB, MiB or KiB (whichever reads best)."""
    if n >= GIB // 10:
        return f"{n / GIB:,.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):,.2f} MiB"
    return f"{n / 1024:,.1f} KiB"


# ============================================================================ 1. headers
@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """The tensors a safetensors file declares (name -> TensorInfo), from its header only."""
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise OfficialCheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise OfficialCheckpointError(f"{path}: safetensors header of {n:,} bytes; corrupt?")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise OfficialCheckpointError(f"{path}: unreadable safetensors header ({e})") from None
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        b0, b1 = h["data_offsets"]
        out[name] = TensorInfo(name, path, h["dtype"], tuple(h["shape"]), b1 - b0)
    return out


def checkpoint_files(ckpt: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or the directory's files."""
    ckpt = Path(ckpt)
    index = ckpt / INDEX_NAME
    if index.exists():
        wm = json.loads(index.read_text()).get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise OfficialCheckpointError(f"{index}: no weight_map")
        files = sorted({ckpt / f for f in wm.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise OfficialCheckpointError(
                f"{ckpt}: {len(missing)} of {len(files)} shards named by {INDEX_NAME} are missing: "
                + ", ".join(missing[:8]) + (", ..." if len(missing) > 8 else ""))
        return files
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{ckpt}: no *.safetensors files")
    return files


def read_tensor_infos(ckpt: str | Path) -> tuple[dict[str, TensorInfo], list[Path]]:
    """Every tensor of the checkpoint (all shard headers), checked against the index."""
    ckpt = Path(ckpt)
    files = checkpoint_files(ckpt)
    infos: dict[str, TensorInfo] = {}
    dup = []
    for f in files:
        for name, info in read_header(f).items():
            if name in infos:
                dup.append(f"{name} ({infos[name].file.name} and {f.name})")
            infos[name] = info
    problems = [f"in two shards: {d}" for d in dup[:8]]
    index = ckpt / INDEX_NAME
    if index.exists():
        wm = json.loads(index.read_text())["weight_map"]
        wrong = [n for n, f in wm.items() if n not in infos or infos[n].file.name != Path(f).name]
        extra = [n for n in infos if n not in wm]
        if wrong:
            problems.append(f"{len(wrong)} index entries not in the named shard: "
                            + ", ".join(sorted(wrong)[:8]))
        if extra:
            problems.append(f"{len(extra)} tensors missing from the index: " + ", ".join(sorted(extra)[:8]))
    if problems:
        raise OfficialCheckpointError(f"{ckpt}: shards and index disagree:\n  " + "\n  ".join(problems))
    return infos, files


def is_official_layout(ckpt: str | Path) -> bool:
    """An index file, a `quantization_config` in config.json, or `.scale` tensors."""
    ckpt = Path(ckpt)
    if (ckpt / INDEX_NAME).exists():
        return True
    try:
        if "quantization_config" in json.loads((ckpt / "config.json").read_text()):
            return True
    except (OSError, ValueError):
        pass
    single = ckpt / SINGLE_NAME
    if single.exists():
        try:
            return any(L.is_scale(n) for n in read_header(single))
        except OfficialCheckpointError:
            return False
    return False


# ============================================================================ 2. memory
def _float32_numel(info: TensorInfo, infos: dict[str, TensorInfo]) -> int:
    """Elements once dequantised (a packed FP4 byte holds two)."""
    if info.dtype in _PACKED_FP4 and L.scale_name(info.name) in infos:
        return 2 * info.numel
    return info.numel


def available_memory() -> tuple[int, int]:
    """(bytes this process can still allocate, total bytes): MemAvailable / MemTotal, capped by
    a cgroup (v2 or v1) memory limit minus its usage."""
    avail = total = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, v = line.split(":", 1)
            if k in ("MemAvailable", "MemTotal"):
                val = int(v.split()[0]) * 1024
                avail, total = (val, total) if k == "MemAvailable" else (avail, val)
    except OSError:
        pass
    if total is None:                                        # not Linux
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 0
    avail = total if avail is None else avail
    for lim_f, use_f in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            lim = Path(lim_f).read_text().strip()
            if lim != "max" and int(lim) < (1 << 60):
                used = int(Path(use_f).read_text().strip())
                total = min(total, int(lim))
                avail = min(avail, max(int(lim) - used, 0))
            break
        except (OSError, ValueError):
            continue
    return avail, total


@dataclass
class MemoryAccount:
    """What loading a checkpoint costs, from its headers alone."""
    path: str
    shards: int
    tensors: int
    disk_bytes: int                           # every tensor's stored bytes
    skipped_disk_bytes: int                   # mtp / vision / aligner / image (not loaded)
    ram_bytes: int                            # float32 bytes of the text model (Engram included)
    engram_bytes: int                         # ... of which the Engram tables
    by_category: dict[str, int]               # float32 bytes per kind
    available_bytes: int
    total_bytes: int
    headroom: float = HEADROOM

    def needed(self, engram_mmap: bool = False) -> int:
        return int((self.ram_bytes - (self.engram_bytes if engram_mmap else 0)) * self.headroom)

    def fits(self, engram_mmap: bool = False) -> bool:
        return self.needed(engram_mmap) <= self.available_bytes

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["needed_bytes"] = self.needed()
        d["needed_bytes_engram_mmap"] = self.needed(True)
        d["fits"] = self.fits()
        d["fits_engram_mmap"] = self.fits(True)
        return d

    def describe(self) -> list[str]:
        """Human lines: sizes, the verdict with and without memory-mapped Engram tables."""
        out = [f"checkpoint {self.path}: {self.tensors:,} tensors in {self.shards} shard(s), "
               f"{_size(self.disk_bytes)} on disk ({_size(self.skipped_disk_bytes)} skipped: "
               "mtp / vision / aligner / image)",
               f"  dequantised to float32: {_size(self.ram_bytes)}"
               + (f" (Engram tables {_size(self.engram_bytes)})" if self.engram_bytes else "")]
        for cat, b in sorted(self.by_category.items(), key=lambda kv: -kv[1]):
            out.append(f"    {cat}: {_size(b)}")
        out.append(f"  this machine: {_size(self.available_bytes)} available of {_size(self.total_bytes)}")
        verdict = "fits" if self.fits() else "does NOT fit"
        out.append(f"  load in RAM: needs {_size(self.needed())} (x{self.headroom:g} headroom): {verdict}")
        if self.engram_bytes:
            v2 = "fits" if self.fits(True) else "does NOT fit"
            out.append(f"  with Engram tables memory-mapped (engram_mmap=DIR, {_size(self.engram_bytes)} "
                       f"of disk): needs {_size(self.needed(True))}: {v2}")
        return out


def checkpoint_memory(ckpt: str | Path, memory_bytes: int | None = None,
                      infos: dict[str, TensorInfo] | None = None) -> MemoryAccount:
    """The memory account of a checkpoint directory (official layout or cedlm's own), from the
    safetensors headers; `memory_bytes` replaces the detected available RAM."""
    ckpt = Path(ckpt)
    if infos is None:
        infos, files = read_tensor_infos(ckpt)
    else:
        files = sorted({i.file for i in infos.values()})
    disk = skipped = ram = engram = 0
    by_cat: dict[str, int] = {}
    for name, info in infos.items():
        disk += info.nbytes
        if L.skipped_kind(name):
            skipped += info.nbytes
            continue
        if L.is_scale(name) and L.weight_of_scale(name) in infos:
            continue
        b = 4 * _float32_numel(info, infos)
        ram += b
        cat = L.category(name)
        by_cat[cat] = by_cat.get(cat, 0) + b
        if ".engram.embed." in name:
            engram += b
    avail, total = available_memory()
    if memory_bytes is not None:
        avail = int(memory_bytes)
    return MemoryAccount(str(ckpt), len(files), len(infos), disk, skipped, ram, engram, by_cat,
                         avail, total)


def _check_memory(acc: MemoryAccount, engram_mmap: Path | None) -> None:
    if not acc.fits(engram_mmap is not None):
        hint = ""
        if acc.engram_bytes and engram_mmap is None and acc.fits(True):
            hint = (f" With engram_mmap=DIR the Engram tables ({_size(acc.engram_bytes)}) are "
                    f"memory-mapped from disk and {_size(acc.needed(True))} of RAM suffices.")
        raise CheckpointTooLargeError(
            f"checkpoint {acc.path} does not fit in RAM: loading it dequantised to float32 needs "
            f"{_size(acc.needed(engram_mmap is not None))} ({_size(acc.ram_bytes)} of tensors"
            + (", Engram tables memory-mapped" if engram_mmap is not None else "")
            + f", x{acc.headroom:g} headroom), but this machine has {_size(acc.available_bytes)} "
            f"available ({_size(acc.total_bytes)} total). The checkpoint is {_size(acc.disk_bytes)} on "
            f"disk in {acc.shards} shard(s). Nothing was loaded.{hint}")
    if engram_mmap is not None and acc.engram_bytes:
        Path(engram_mmap).mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(engram_mmap).free
        if acc.engram_bytes > free:
            raise CheckpointTooLargeError(
                f"engram_mmap={engram_mmap}: the float32 Engram tables need {_size(acc.engram_bytes)} "
                f"of disk, {_size(free)} is free there. Nothing was loaded.")


# ============================================================================ 3. layout
@dataclass
class Entry:
    """One text-model tensor to load: its stored weight (and scale) and the target shape."""
    name: str
    fmt: str                          # fp8_block | fp4_expert | fp8_rows | plain
    weight: TensorInfo
    scale: TensorInfo | None
    shape: tuple[int, ...]
    block: tuple[int, int] = (BLOCK, BLOCK)


@dataclass
class LoadReport:
    path: str
    shards: int
    tensors: int                                          # in the checkpoint, scales included
    loaded: dict[str, int] = field(default_factory=dict)  # text-model tensors by stored format
    skipped: dict[str, int] = field(default_factory=dict)  # by kind (scales included)
    unused: dict[str, int] = field(default_factory=dict)  # loaded, not used by the text model
    defaulted: list[str] = field(default_factory=list)    # optional tensors the checkpoint lacks
    disk_bytes: int = 0
    ram_bytes: int = 0                                    # float32 bytes held in RAM
    engram: str = "host memory (float32)"
    quantization: dict = field(default_factory=dict)
    seconds: float = 0.0

    def summary(self) -> str:
        fm = ", ".join(f"{k} {v:,}" for k, v in sorted(self.loaded.items()))
        lines = [f"loaded {self.path} ({self.shards} shard(s), {self.tensors:,} tensors, "
                 f"{_size(self.disk_bytes)} on disk) in {self.seconds:.2f} s: {fm}; "
                 f"{_size(self.ram_bytes)} float32 in RAM; Engram tables in {self.engram}"]
        if self.skipped:
            lines.append("skipped (not part of the text model): "
                         + ", ".join(f"{k} {v:,}" for k, v in sorted(self.skipped.items())))
        for k, v in sorted(self.unused.items()):
            lines.append(f"unused: {k} x{v:,}")
        if self.defaulted:
            lines.append(f"absent, kept at their built value: {len(self.defaulted)} "
                         f"({', '.join(self.defaulted[:3])}{', ...' if len(self.defaulted) > 3 else ''})")
        return "\n".join(lines)


def quantization_config(cfg: ModelConfig) -> dict:
    """The config's `quantization_config` (kept by ModelConfig in `extra`), or {}."""
    return dict((cfg.extra or {}).get("top", {}).get("quantization_config") or {})


def _fp8_block(qc: dict) -> tuple[int, int]:
    b = qc.get("weight_block_size") or [BLOCK, BLOCK]
    if len(b) != 2 or not all(isinstance(x, int) and x > 0 for x in b):
        raise OfficialCheckpointError(f"quantization_config.weight_block_size: {b!r} is not [rows, cols]")
    return int(b[0]), int(b[1])


def _check_quant_config(qc: dict, ckpt: Path) -> None:
    if not qc:
        return
    method = qc.get("quant_method", "fp8")
    if method not in ("fp8", "deepseek_v4_fp8"):
        raise OfficialCheckpointError(f"{ckpt}: quantization_config.quant_method {method!r} is not "
                                      "supported (fp8 block weights with fp4 or fp8 experts)")
    fmt = qc.get("scale_fmt", "ue8m0")
    if fmt not in ("ue8m0", None):
        raise OfficialCheckpointError(f"{ckpt}: quantization_config.scale_fmt {fmt!r} is not supported")
    if qc.get("expert_dtype", "fp4") not in ("fp4", "fp8"):
        raise OfficialCheckpointError(f"{ckpt}: quantization_config.expert_dtype "
                                      f"{qc.get('expert_dtype')!r}: expected fp4 or fp8")


def _entry(name: str, shape: tuple[int, ...], infos: dict[str, TensorInfo], block: tuple[int, int]
           ) -> tuple[Entry | None, str | None]:
    """(Entry, None) or (None, why the stored tensor does not fit the model's)."""
    w = infos[name]
    s = infos.get(L.scale_name(name)) if name.endswith(L.WEIGHT_SUFFIX) else None
    want = list(shape)
    if s is None:
        if w.dtype in _FP8 + _PACKED_FP4:
            return None, f"{w.dtype} {list(w.shape)} without its {L.scale_name(name)}"
        if w.shape != shape:
            return None, f"shape {list(w.shape)}, the model has {want}"
        if w.dtype not in ("BF16", "F16", "F32", "F64"):
            return None, f"dtype {w.dtype}, expected a float"
        return Entry(name, "plain", w, None, shape), None
    if len(shape) != 2:
        return None, f"a .scale for a {len(shape)}-D tensor"
    if s.dtype not in ("F8_E8M0", "U8", "F32", "BF16"):
        return None, f"scale dtype {s.dtype}, expected F8_E8M0"
    if w.dtype in _PACKED_FP4:
        fmt, stored, sshape = L.FP4_EXPERT, (shape[0], cdiv(shape[1], 2)), fp4_scale_shape(shape)
    elif w.dtype in _FP8 and L.storage_format(name) == L.FP8_ROWS:
        fmt, stored, sshape = L.FP8_ROWS, shape, rows_scale_shape(shape)
        block = (1, BLOCK)
    elif w.dtype in _FP8:
        fmt, stored, sshape = L.FP8_BLOCK, shape, block_scale_shape(shape, block)
    else:
        return None, f"dtype {w.dtype} with a .scale (expected F8_E4M3 or packed-FP4 I8)"
    if w.shape != tuple(stored):
        return None, f"{w.dtype} {list(w.shape)}, expected {list(stored)} for the model's {want}"
    if s.shape != tuple(sshape):
        return None, f"scale {list(s.shape)}, expected {list(sshape)} ({fmt}, model shape {want})"
    return Entry(name, fmt, w, s, shape, block), None


def plan_load(ckpt: str | Path, infos: dict[str, TensorInfo], qc: dict, files: list[Path],
              expected: dict[str, tuple[int, ...]]) -> tuple[list[Entry], LoadReport]:
    """Match the checkpoint's tensors (`infos`, stored under `quantization_config` qc) to the
    model's (`expected`: name -> shape); raise listing every problem."""
    ckpt = Path(ckpt)
    block = _fp8_block(qc)
    report = LoadReport(str(ckpt), len(files), len(infos), quantization=qc,
                        disk_bytes=sum(i.nbytes for i in infos.values()))
    entries, missing, malformed, defaulted = [], [], [], []
    for name, shape in expected.items():
        if name not in infos:
            (defaulted if L.optional(name) else missing).append(name)
            continue
        e, why = _entry(name, shape, infos, block)
        if e is None:
            malformed.append(f"{name}: {why}")
            continue
        entries.append(e)
        report.loaded[e.fmt] = report.loaded.get(e.fmt, 0) + 1
        kind = L.unused_kind(name)
        if kind:
            report.unused[kind] = report.unused.get(kind, 0) + 1
    used_scales = {e.scale.name for e in entries if e.scale is not None}
    unexpected = []
    for name in infos:
        if name in expected or name in used_scales:
            continue
        kind = L.skipped_kind(name)
        if kind:
            report.skipped[kind] = report.skipped.get(kind, 0) + 1
        elif not (L.is_scale(name) and L.weight_of_scale(name) in expected):   # counted as malformed
            unexpected.append(name)
    report.defaulted = defaulted
    if missing or unexpected or malformed:
        raise OfficialCheckpointError(_layout_message(ckpt, missing, unexpected, malformed))
    return entries, report


def _layout_message(ckpt: Path, missing, unexpected, malformed) -> str:
    head = (f"checkpoint {ckpt} does not match the model its config.json describes: "
            f"{len(missing)} missing, {len(unexpected)} unexpected, {len(malformed)} malformed tensors")
    lines = [head]
    if missing:
        lines += [f"missing ({len(missing)}), by kind:"] + L.format_groups(missing)
    if unexpected:
        lines += [f"unexpected ({len(unexpected)}), by kind:"] + L.format_groups(unexpected)
    if malformed:
        lines += [f"malformed ({len(malformed)}):"] + [f"  {m}" for m in malformed[:20]]
        if len(malformed) > 20:
            lines.append(f"  ... and {len(malformed) - 20} more")
    return "\n".join(lines)


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


def _build(cfg: ModelConfig, meta_min_numel: int):
    with torch.no_grad(), _LargeOnMeta(meta_min_numel):
        return build_model(cfg)


class _Reader:
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


def _read_into(e: Entry, reader: _Reader, out: torch.Tensor) -> None:
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
    _check_memory(acc, None if engram_mmap is None else Path(engram_mmap))
    cfg = ModelConfig.from_json(ckpt / "config.json")
    qc = quantization_config(cfg)
    _check_quant_config(qc, ckpt)
    model = _build(_float_config(cfg), meta_min_numel)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    entries, report = plan_load(ckpt, infos, qc, files, expected)
    return ckpt, model, entries, report


def _float_config(cfg: ModelConfig) -> ModelConfig:
    """The loaded model's config: the same, without the storage's `quantization_config`, and
    without `vision_config` (this loader's scope is the text model: the vision tensors are skipped
    and reported, so the model is built without a tower)."""
    extra = dict(cfg.extra or {})
    drop = ("quantization_config", "vision_config")
    if "top" in extra:
        extra["top"] = {k: v for k, v in extra["top"].items() if k not in drop}
    if "top_keys" in extra:
        extra["top_keys"] = [k for k in extra["top_keys"] if k not in drop]
    cfg.extra = extra
    return cfg


def load_official_model(path: str | Path, *, engram_mmap: str | Path | None = None,
                        memory_bytes: int | None = None, meta_min_numel: int = META_MIN_NUMEL):
    """-> (CEDModel in eval mode, LoadReport) from an official-layout checkpoint directory.

    Weights are dequantised to float32 at load. `engram_mmap=DIR`: the Engram tables are
    dequantised into float32 `.npy` files there and memory-mapped (`Engram.host_table`) instead
    of held in RAM. `memory_bytes` replaces the detected available RAM (the early size check).
    """
    t0 = time.perf_counter()
    ckpt, model, entries, report = _prepare(path, memory_bytes, engram_mmap, meta_min_numel)
    mmap_dir = None if engram_mmap is None else Path(engram_mmap)
    ram = 0
    with ExitStack() as stack:
        reader = _Reader(stack)
        for e in sorted(entries, key=lambda e: (str(e.weight.file), e.name)):
            dtype = _current(model, e.name).dtype
            if mmap_dir is not None and ".engram.embed." in e.name:
                _load_engram_mmap(model, e, reader, mmap_dir)
                continue
            out = torch.empty(e.shape, dtype=torch.float32)
            _read_into(e, reader, out)
            if dtype != torch.float32:
                out = out.to(dtype)
            _assign(model, e.name, out)
            ram += out.numel() * out.element_size()
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:                                         # a large tensor no checkpoint entry filled
        raise OfficialCheckpointError(f"{ckpt}: not loaded, left unallocated: {', '.join(left[:8])}")
    report.ram_bytes = ram
    _release_freed_memory()
    if mmap_dir is not None:
        report.engram = f"float32 .npy files memory-mapped from {mmap_dir}"
    report.seconds = time.perf_counter() - t0
    model.eval()
    model.official_load_report = report
    return model, report


def _release_freed_memory() -> None:
    """Hand the load's freed temporaries back to the OS (glibc keeps them otherwise: measured
    on the small model, resident memory after the load drops from 1.8x to 1.17x the weights)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _load_engram_mmap(model: nn.Module, e: Entry, reader: _Reader, directory: Path) -> None:
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
        reader = _Reader(stack)
        for e in sorted(entries, key=lambda e: (str(e.weight.file), e.name)):
            out = torch.empty(e.shape, dtype=torch.float32)
            _read_into(e, reader, out)
            sd[e.name] = out
    report.ram_bytes = sum(t.numel() * 4 for t in sd.values())
    _release_freed_memory()
    report.seconds = time.perf_counter() - t0
    return OfficialCheckpoint(cfg, sd, report)
