"""Step 3 of loading an official checkpoint: match its tensors (names, dtypes, shapes, scales)
to the model its config.json describes; every missing, unexpected and malformed tensor is listed
together, grouped by kind. The result is the load plan (`Entry` per tensor) and its report."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cedlm.config import ModelConfig
from cedlm.official import layout as L
from cedlm.official.dequant import BLOCK, block_scale_shape, cdiv, fp4_scale_shape, rows_scale_shape
from cedlm.official.errors import OfficialCheckpointError, size_text
from cedlm.official.headers import FP8, PACKED_FP4, TensorInfo


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
    loaded: dict[str, int] = field(default_factory=dict)  # tensors by stored format
    components: dict[str, int] = field(default_factory=dict)  # of which outside the text model, by kind
    unused: dict[str, int] = field(default_factory=dict)  # loaded, not used by this model
    defaulted: list[str] = field(default_factory=list)    # optional tensors the checkpoint lacks
    disk_bytes: int = 0
    ram_bytes: int = 0                                    # float32 bytes held in RAM
    engram: str = "host memory (float32)"
    quantization: dict = field(default_factory=dict)
    seconds: float = 0.0

    def summary(self) -> str:
        fm = ", ".join(f"{k} {v:,}" for k, v in sorted(self.loaded.items()))
        lines = [f"loaded {self.path} ({self.shards} shard(s), {self.tensors:,} tensors, "
                 f"{size_text(self.disk_bytes)} on disk) in {self.seconds:.2f} s: {fm}; "
                 f"{size_text(self.ram_bytes)} float32 in RAM; Engram tables in {self.engram}"]
        if self.components:
            lines.append("beside the text model: "
                         + ", ".join(f"{k} {v:,}" for k, v in sorted(self.components.items())))
        for k, v in sorted(self.unused.items()):
            lines.append(f"unused: {k} x{v:,}")
        if self.defaulted:
            lines.append(f"absent, kept at their built value: {len(self.defaulted)} "
                         f"({', '.join(self.defaulted[:3])}{', ...' if len(self.defaulted) > 3 else ''})")
        return "\n".join(lines)


def quantization_config(cfg: ModelConfig) -> dict:
    """The config's `quantization_config` (kept by ModelConfig in `extra`), or {}."""
    return dict((cfg.extra or {}).get("top", {}).get("quantization_config") or {})


def fp8_block(qc: dict) -> tuple[int, int]:
    b = qc.get("weight_block_size") or [BLOCK, BLOCK]
    if len(b) != 2 or not all(isinstance(x, int) and x > 0 for x in b):
        raise OfficialCheckpointError(f"quantization_config.weight_block_size: {b!r} is not [rows, cols]")
    return int(b[0]), int(b[1])


def check_quant_config(qc: dict, ckpt: Path) -> None:
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
        if w.dtype in FP8 + PACKED_FP4:
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
    if w.dtype in PACKED_FP4:
        fmt, stored, sshape = L.FP4_EXPERT, (shape[0], cdiv(shape[1], 2)), fp4_scale_shape(shape)
    elif w.dtype in FP8 and L.storage_format(name) == L.FP8_ROWS:
        fmt, stored, sshape = L.FP8_ROWS, shape, rows_scale_shape(shape)
        block = (1, BLOCK)
    elif w.dtype in FP8:
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
    block = fp8_block(qc)
    report = LoadReport(str(ckpt), len(files), len(infos), quantization=qc,
                        disk_bytes=sum(i.nbytes for i in infos.values()))
    entries, missing, malformed, defaulted = [], [], [], []
    vision = any(n.startswith(L.VISION_PREFIXES) for n in expected)
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
        if kind and not vision:
            report.unused[kind] = report.unused.get(kind, 0) + 1
        kind = L.component_kind(name)
        if kind:
            report.components[kind] = report.components.get(kind, 0) + 1
    used_scales = {e.scale.name for e in entries if e.scale is not None}
    unexpected = []
    for name in infos:
        if name in expected or name in used_scales:
            continue
        if not (L.is_scale(name) and L.weight_of_scale(name) in expected):      # else counted as malformed
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
