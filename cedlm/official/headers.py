"""Step 1 of loading an official checkpoint: the safetensors headers (8-byte length + JSON) of
every shard, checked against the index; no tensor data is read. Also how to tell an
official-layout directory (`is_official_layout`)."""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from cedlm.official import layout as L
from cedlm.official.errors import OfficialCheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

PACKED_FP4 = ("I8", "U8")       # stored dtypes of packed FP4 (two values a byte)
FP8 = ("F8_E4M3",)              # stored dtype of FP8 weights


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
