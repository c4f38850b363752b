"""Step 2 of loading an official checkpoint: what it costs in RAM once dequantised to float32
(from the headers alone), against the memory this process can use; too large fails before
anything is read."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from cedlm.official import layout as L
from cedlm.official.errors import CheckpointTooLargeError, size_text
from cedlm.official.headers import PACKED_FP4, TensorInfo, read_tensor_infos

HEADROOM = 1.10                 # RAM needed = float32 bytes x this (activations, allocator, Python)


def float32_numel(info: TensorInfo, infos: dict[str, TensorInfo]) -> int:
    """Elements once dequantised (a packed FP4 byte holds two)."""
    if info.dtype in PACKED_FP4 and L.scale_name(info.name) in infos:
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
    component_disk_bytes: int                 # of which mtp / vision / aligner / image (loaded too)
    ram_bytes: int                            # float32 bytes of every tensor (Engram included)
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
               f"{size_text(self.disk_bytes)} on disk ({size_text(self.component_disk_bytes)} of it "
               "DSpark drafter / vision tower)",
               f"  dequantised to float32: {size_text(self.ram_bytes)}"
               + (f" (Engram tables {size_text(self.engram_bytes)})" if self.engram_bytes else "")]
        for cat, b in sorted(self.by_category.items(), key=lambda kv: -kv[1]):
            out.append(f"    {cat}: {size_text(b)}")
        out.append(f"  this machine: {size_text(self.available_bytes)} available of {size_text(self.total_bytes)}")
        verdict = "fits" if self.fits() else "does NOT fit"
        out.append(f"  load in RAM: needs {size_text(self.needed())} (x{self.headroom:g} headroom): {verdict}")
        if self.engram_bytes:
            v2 = "fits" if self.fits(True) else "does NOT fit"
            out.append(f"  with Engram tables memory-mapped (engram_mmap=DIR, {size_text(self.engram_bytes)} "
                       f"of disk): needs {size_text(self.needed(True))}: {v2}")
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
    disk = component = ram = engram = 0
    by_cat: dict[str, int] = {}
    for name, info in infos.items():
        disk += info.nbytes
        if L.component_kind(name):
            component += info.nbytes
        if L.is_scale(name) and L.weight_of_scale(name) in infos:
            continue
        b = 4 * float32_numel(info, infos)
        ram += b
        cat = L.category(name)
        by_cat[cat] = by_cat.get(cat, 0) + b
        if ".engram.embed." in name:
            engram += b
    avail, total = available_memory()
    if memory_bytes is not None:
        avail = int(memory_bytes)
    return MemoryAccount(str(ckpt), len(files), len(infos), disk, component, ram, engram, by_cat,
                         avail, total)


def check_memory(acc: MemoryAccount, engram_mmap: Path | None) -> None:
    if not acc.fits(engram_mmap is not None):
        hint = ""
        if acc.engram_bytes and engram_mmap is None and acc.fits(True):
            hint = (f" With engram_mmap=DIR the Engram tables ({size_text(acc.engram_bytes)}) are "
                    f"memory-mapped from disk and {size_text(acc.needed(True))} of RAM suffices.")
        raise CheckpointTooLargeError(
            f"checkpoint {acc.path} does not fit in RAM: loading it dequantised to float32 needs "
            f"{size_text(acc.needed(engram_mmap is not None))} ({size_text(acc.ram_bytes)} of tensors"
            + (", Engram tables memory-mapped" if engram_mmap is not None else "")
            + f", x{acc.headroom:g} headroom), but this machine has {size_text(acc.available_bytes)} "
            f"available ({size_text(acc.total_bytes)} total). The checkpoint is {size_text(acc.disk_bytes)} on "
            f"disk in {acc.shards} shard(s). Nothing was loaded.{hint}")
    if engram_mmap is not None and acc.engram_bytes:
        Path(engram_mmap).mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(engram_mmap).free
        if acc.engram_bytes > free:
            raise CheckpointTooLargeError(
                f"engram_mmap={engram_mmap}: the float32 Engram tables need {size_text(acc.engram_bytes)} "
                f"of disk, {size_text(free)} is free there. Nothing was loaded.")
