"""The compiled extension (``csrc/codecs.cpp``, which includes ``mhc.h``, ``rope.h``,
``index.h`` and ``attend.h``): ahead-of-time build and load. It holds the KV codecs and, beside
them, inference kernels each reached through ``fast.ext_op``: the mHC mixes, collapse and expand
(cedlm/model/mhc.py), the RoPE rotation (rope.py), the indexer's scores read from packed keys and
its top-k (indexer.py), and the sparse attention over [window || selected || sink] (attention.py).

    python -m cedlm.quant.ext build      # ./setup.sh runs this; about a minute of CPU (torch headers)
    python -m cedlm.quant.ext status     # built? stale? loadable?

The build goes through ``torch.utils.cpp_extension.load`` (gcc + ninja) into ``build/cedlm_ext/``
at the repository root, with a stamp of the source, flags, torch and Python versions. At run time
``load()`` imports the built module directly (no compiler, no ninja: milliseconds); when it is
missing, stale or fails to import, ``load()`` returns None and ``fast.py`` logs ONE line and uses
its vectorised torch path, bit-identical like the extension.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import sys
from pathlib import Path

import torch

__all__ = ["NAME", "SOURCE", "BUILD_DIR", "build", "load", "status"]

NAME = "cedlm_codecs"
SOURCE = Path(__file__).resolve().parent / "csrc" / "codecs.cpp"
BUILD_DIR = Path(__file__).resolve().parents[2] / "build" / "cedlm_ext"
# No -ffast-math, no FP contraction, no -march=native (the build may be copied to another CPU).
CFLAGS = ["-O3", "-fno-fast-math", "-ffp-contract=off", "-fno-finite-math-only"]
ABI_VERSION = 7


def _stamp() -> str:
    h = hashlib.sha256()
    h.update(SOURCE.read_bytes())
    for header in sorted(SOURCE.parent.glob("*.h")):        # included by the source
        h.update(header.read_bytes())
    for part in (*CFLAGS, torch.__version__, sys.version, platform.machine(), str(ABI_VERSION)):
        h.update(b"\0" + part.encode())
    return h.hexdigest()


def _paths() -> tuple[Path, Path]:
    return BUILD_DIR / f"{NAME}.so", BUILD_DIR / f"{NAME}.stamp"


def build(verbose: bool = True) -> Path:
    """Compile the extension into ``BUILD_DIR`` (raises on failure); returns the library path."""
    from torch.utils.cpp_extension import load as jit_load
    so, stamp = _paths()
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    venv_bin = str(Path(sys.executable).parent)        # pip's ninja lands next to the interpreter
    if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    stamp.unlink(missing_ok=True)
    mod = jit_load(NAME, [str(SOURCE)], extra_cflags=CFLAGS, build_directory=str(BUILD_DIR),
                   verbose=verbose)
    if mod.abi_version() != ABI_VERSION or not so.exists():
        raise RuntimeError(f"cedlm.quant.ext: unexpected build result in {BUILD_DIR}")
    stamp.write_text(_stamp() + "\n")
    return so


def status() -> tuple[bool, str]:
    """(loadable, why) without importing the module."""
    so, stamp = _paths()
    if not so.exists():
        return False, f"not built ({so} missing; run ./setup.sh or python -m cedlm.quant.ext build)"
    try:
        ok = stamp.read_text().strip() == _stamp()
    except OSError:
        ok = False
    if not ok:
        return False, (f"stale build in {BUILD_DIR} (source, flags, torch or Python changed); "
                       f"run python -m cedlm.quant.ext build")
    return True, f"built: {so}"


def load():
    """The compiled module, or (None, reason) when it is not available. Never compiles."""
    ok, why = status()
    if not ok:
        return None, why
    so, _ = _paths()
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
    args = sys.argv[1:] if argv is None else argv
    cmd = args[0] if args else "status"
    if cmd == "build":
        print(f"cedlm.quant.ext: building {SOURCE.name} into {BUILD_DIR} ...", flush=True)
        print(f"cedlm.quant.ext: built {build(verbose='-v' in args)}")
        return 0
    if cmd == "status":
        ok, why = status()
        print(why)
        return 0 if ok else 1
    print("usage: python -m cedlm.quant.ext [build [-v] | status]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
