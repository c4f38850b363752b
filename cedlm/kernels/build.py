"""Ahead-of-time build and lazy load of the compiled kernels (``csrc/codecs.cpp``, which includes
``mhc.h``, ``rope.h``, ``index.h``, ``attend.h``, ``attend_packed.h`` and ``dispatch.h``: the KV
codecs, the mHC mixes, the RoPE rotation, the indexer's scores and top-k, the sparse attention, and
the CPU kernels of the custom ops ``torch.ops.cedlm.*``).

    python -m cedlm.kernels.build            # ./setup.sh runs this; 1-2 minutes of CPU
    python -m cedlm.kernels.build status     # built? where? loadable?

Where: a per-user cache, ``$CEDLM_KERNEL_DIR/<key>`` when ``CEDLM_KERNEL_DIR`` is set, else
``$XDG_CACHE_HOME/cedlm/kernels/<key>`` (``~/.cache/cedlm/kernels/<key>``). ``<key>`` hashes the
sources, the compiler flags (ISA defines included), the ABI version, torch's and Python's versions
and the machine type, so a checkout and an installed wheel share a build when they agree, and a
change of any of these builds anew instead of loading a stale module (older builds stay until the
directory is deleted; nothing else writes there). The build goes through
``torch.utils.cpp_extension.load`` (g++ + ninja; torch's file lock keeps two builders apart) and
writes a stamp last; ``load()`` imports the built module directly (no compiler: milliseconds) and
never compiles. When nothing is built, ``gate.py`` logs one line and the torch paths run.

Instruction sets (``CEDLM_KERNEL_ISA``, read when the module is loaded or built):

* ``auto`` (default): the portable build (no ``-march``: SSE2, the x86-64 baseline, in the codecs
  and the indexer's 4-lane dot products), plus the indexer's 8-lane AVX2 + FMA scorer chosen at
  run time where the CPU has it (the only run-time dispatch; a float32 rounding difference from
  the SSE2 scorer, within the tolerance tests/test_index_fast.py states).
* ``sse2``: the same build with the AVX2 + FMA choice turned off: SSE2 paths only.
* ``generic``: a separate build (its own key) with ``-DCEDLM_CODECS_SCALAR``: plain scalar C++
  loops, no intrinsics at all. The codecs give the same bytes and floats on every setting
  (tests/test_kernel_isa.py checks ``generic`` against ``auto`` bit for bit).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import sys
from pathlib import Path

import torch

__all__ = ["NAME", "CSRC", "SOURCE", "DIR_VAR", "ISA_VAR", "ISAS", "ABI_VERSION", "isa", "flags",
           "key", "cache_root", "build_dir", "build", "status", "load", "main"]

NAME = "cedlm_kernels"
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE = CSRC / "codecs.cpp"
DIR_VAR = "CEDLM_KERNEL_DIR"
ISA_VAR = "CEDLM_KERNEL_ISA"
ISAS = ("auto", "sse2", "generic")
# No -ffast-math, no FP contraction, no -march=native (the build may be copied to another CPU).
CFLAGS = ["-O3", "-fno-fast-math", "-ffp-contract=off", "-fno-finite-math-only"]
ABI_VERSION = 9


def isa(value: str | None = None) -> str:
    """The instruction-set setting: ``value``, else ``$CEDLM_KERNEL_ISA``, else "auto"."""
    v = (os.environ.get(ISA_VAR, "") if value is None else value).strip().lower() or "auto"
    if v not in ISAS:
        raise ValueError(f"{ISA_VAR}={v!r}: one of {', '.join(ISAS)}")
    return v


def flags(isa_name: str | None = None) -> list[str]:
    """The compiler flags of the build for an ISA setting."""
    return CFLAGS + (["-DCEDLM_CODECS_SCALAR"] if isa(isa_name) == "generic" else [])


def _digest(isa_name: str | None) -> str:
    h = hashlib.sha256()
    for src in [SOURCE, *sorted(CSRC.glob("*.h"))]:          # the headers are included by SOURCE
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    for part in (*flags(isa_name), torch.__version__, sys.version, platform.machine(),
                 str(ABI_VERSION)):
        h.update(b"\0" + part.encode())
    return h.hexdigest()


def key(isa_name: str | None = None) -> str:
    """The cache key (16 hex digits) of the build for an ISA setting on this interpreter."""
    return _digest(isa_name)[:16]


def cache_root() -> Path:
    """``$CEDLM_KERNEL_DIR``, else ``$XDG_CACHE_HOME/cedlm/kernels`` (``~/.cache/...``)."""
    d = os.environ.get(DIR_VAR, "").strip()
    if d:
        return Path(d).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "cedlm" / "kernels"


def build_dir(isa_name: str | None = None) -> Path:
    """Where the build for an ISA setting lives: ``cache_root() / key(isa)``."""
    return cache_root() / key(isa_name)


def _paths(isa_name: str | None) -> tuple[Path, Path]:
    d = build_dir(isa_name)
    return d / f"{NAME}.so", d / f"{NAME}.stamp"


def build(verbose: bool = True, isa_name: str | None = None) -> Path:
    """Compile the kernels into ``build_dir(isa)`` (raises on failure); returns the library."""
    from torch.utils.cpp_extension import load as jit_load
    so, stamp = _paths(isa_name)
    so.parent.mkdir(parents=True, exist_ok=True)
    venv_bin = str(Path(sys.executable).parent)        # pip's ninja lands next to the interpreter
    if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    stamp.unlink(missing_ok=True)
    mod = jit_load(NAME, [str(SOURCE)], extra_cflags=flags(isa_name),
                   build_directory=str(so.parent), verbose=verbose)
    if mod.abi_version() != ABI_VERSION or not so.exists():
        raise RuntimeError(f"cedlm.kernels: unexpected build result in {so.parent}")
    stamp.write_text(_digest(isa_name) + "\n")
    return so


def status(isa_name: str | None = None) -> tuple[bool, str]:
    """(loadable, why) without importing the module."""
    so, stamp = _paths(isa_name)
    if not so.exists():
        return False, (f"not built ({so} missing; run ./setup.sh or python -m "
                       f"cedlm.kernels.build)")
    try:
        ok = stamp.read_text().strip() == _digest(isa_name)
    except OSError:
        ok = False
    if not ok:
        return False, (f"incomplete build in {so.parent} (no matching stamp); run python -m "
                       f"cedlm.kernels.build")
    return True, f"built: {so}"


def load(isa_name: str | None = None):
    """(the compiled module, why) or (None, why) when it is not available. Never compiles."""
    try:
        ok, why = status(isa_name)
    except ValueError as e:                # a bad CEDLM_KERNEL_ISA: say so, run the torch paths
        return None, str(e)
    if not ok:
        return None, why
    so, _ = _paths(isa_name)
    try:
        spec = importlib.util.spec_from_file_location(NAME, so)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        if mod.abi_version() != ABI_VERSION:
            return None, f"{so}: ABI version {mod.abi_version()} != {ABI_VERSION}"
    except Exception as e:  # noqa: BLE001 - any import failure means: use the torch path
        return None, f"{so} failed to load: {type(e).__name__}: {e}"
    return mod, why


def main(argv: list[str] | None = None) -> int:
    """``build [-v] [--isa auto|sse2|generic]`` (the default command) or ``status``."""
    args = sys.argv[1:] if argv is None else list(argv)
    isa_name = None
    if "--isa" in args:
        i = args.index("--isa")
        if i + 1 >= len(args):
            print("--isa needs a value: one of " + ", ".join(ISAS), file=sys.stderr)
            return 2
        isa_name = isa(args[i + 1])
        del args[i:i + 2]
    cmd = args[0] if args and not args[0].startswith("-") else "build"
    if cmd == "build":
        print(f"cedlm.kernels: building {SOURCE.name} ({isa(isa_name)}) into "
              f"{build_dir(isa_name)} ...", flush=True)
        print(f"cedlm.kernels: built {build(verbose='-v' in args, isa_name=isa_name)}")
        return 0
    if cmd == "status":
        ok, why = status(isa_name)
        print(why)
        return 0 if ok else 1
    print("usage: python -m cedlm.kernels.build [build [-v] | status] [--isa auto|sse2|generic]",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
