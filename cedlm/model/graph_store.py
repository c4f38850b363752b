"""Compiled steps kept whole on disk: each graph a compiled step builds is saved with its guards
(torch's precompile: `aot_compile` on the compiled function, `torch.compiler.load_compiled_function`),
and a later process with the same code, model and torch loads it in about a second instead of
tracing the step again (for the shipped model dynamo's tracing alone takes 13-18 s per graph even
when inductor's cache holds the generated code; on a cold machine the trace, the code generation
and the C++ build take minutes).

    fn = GraphStore(model, "decode", lazy, precompile)    # both from `compiled_step.compile_step`
    logits, out = fn(shapes, *args)                        # called as the compiled step is

Each call is keyed by what its graph depends on besides the weights' values: the step (`name`),
the row layout of the call (`shapes.flat`, `shapes.taps`) and every tensor's dtype, rank, static
sizes and strides, with dims marked dynamic (batch >= 2, block tables and pools) left out. A file
is named by that key and by the store key: the cedlm sources (every .py/.cpp/.h file of the
package, hashed by content, so a second checkout folder or a wheel install of the same code
shares the files), torch's version, the Python version and machine, the model's config, kv
formats and parameter shapes and dtypes, the C++ optimisation level. The saved guards are the
portable ones (tensor metadata, dynamic-shape relations, global state: `keep_portable_guards_unsafe`
without the guards on the model's modules, which the store key covers); they are still checked at
every call.

Anything that goes wrong falls back to the lazily compiled function (`lazy`, torch.compile as
before): a file that does not load (another torch, a torn file: it is rebuilt), a guard that fails
(logged once per graph), a step that cannot be saved. `CEDLM_GRAPH_STORE=0` turns the store off.
Files live in `$CEDLM_CACHE_DIR/graphs` (default `~/.cache/cedlm/graphs`), written atomically;
the oldest beyond `MAX_BYTES` are removed.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import platform
import sys
import time
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch
import torch._inductor.config

from cedlm.util import atomic_write_bytes, cache_root

log = logging.getLogger(__name__)

ENV_VAR = "CEDLM_GRAPH_STORE"
MAX_BYTES = 2 << 30                  # the store's size; the least recently used files go first
# the flag torch.compiler's dim marks leave on a tensor (`torch._dynamo.mark_dynamic`, pinned with
# torch 2.13.0): a loaded graph's guards require it absent (they were built on the trace's fake
# tensors, which carry no marks), so it is taken off while the graph runs; the marks themselves
# stay, read only where the flag is set
MARKS = ("_has_dynamo_dim_marking",)


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "1").strip() not in ("0", "false", "no", "off")


def store_dir() -> Path:
    return cache_root() / "graphs"


@lru_cache(maxsize=1)
def code_digest() -> str:
    """The cedlm sources by content (not by path): every .py, .cpp and .h file of the package."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.suffix in (".py", ".cpp", ".h") and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def model_digest(model, extra: dict) -> str:
    """What a graph of this model depends on besides the weights' values."""
    from cedlm.model.static_kv import StepShapes
    sh = StepShapes(model)
    desc = {
        "code": code_digest(), "torch": torch.__version__, "python": sys.version.split()[0],
        "machine": platform.machine(), "config": model.cfg.to_dict(),
        "formats": repr((sh.window_fmt, sh.window_dim, sh.kv_fmt, sh.idx_fmt, sh.ratio, sh.row_width)),
        "tensors": [(n, tuple(t.shape), str(t.dtype), str(t.device.type))
                    for n, t in (*model.named_parameters(), *model.named_buffers())],
        **extra,
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True, default=repr).encode()).hexdigest()


def _leaves(x):
    if isinstance(x, dict):
        for k in sorted(x, key=repr):
            yield from _leaves(x[k])
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _leaves(v)
    else:
        yield x


def call_key(name: str, args) -> str:
    """The graph a call runs: the step, the shapes' row layout, each input's structure."""
    shapes, rest = args[0], args[1:]
    parts = [name, f"flat={getattr(shapes, 'flat', None)}", f"taps={getattr(shapes, 'taps', None)}",
             repr([sorted(a, key=repr) if isinstance(a, dict) else type(a).__name__ for a in rest])]
    for t in _leaves(rest):
        if isinstance(t, torch.Tensor):
            dyn = getattr(t, "_dynamo_dynamic_indices", set())
            size = tuple("*" if d in dyn else s for d, s in enumerate(t.shape))
            stride = tuple(t.stride()) if not dyn else t.is_contiguous()
            parts.append(f"{t.dtype}{size}{stride}{t.device.type}")
        else:
            parts.append(repr(t) if t is None or isinstance(t, (bool, int, float, str)) else type(t).__name__)
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


@contextmanager
def _unmarked(args):
    """The dim marks of the call's tensors taken off while a loaded graph runs, then put back (the
    lazy step, a fallback, compiles from them). An alias without them would not do: a guard may
    read a view's base."""
    saved = []
    for t in _leaves(args):
        if isinstance(t, torch.Tensor) and getattr(t, "_has_dynamo_dim_marking", False):
            attrs = {a: getattr(t, a) for a in MARKS if hasattr(t, a)}
            saved.append((t, attrs))
            for a in attrs:
                delattr(t, a)
    try:
        yield
    finally:
        for t, attrs in saved:
            for a, v in attrs.items():
                setattr(t, a, v)


class GraphStore:
    """A compiled step whose graphs are saved and loaded whole (see the module docstring).
    lazy: the step through torch.compile (the fallback); precompile: makes the same with the
    portable guards, whose `aot_compile` builds a graph to save (a new code object per graph: a
    second capture of one code object would inherit dynamo's automatic-dynamic state of the
    first, and guards that do not hold). config: inductor's settings while compiling, set again
    while loading (the loader builds the graph's C++ under the settings in force, and finds the
    library in inductor's cache only when they are the same: otherwise a first load in a new
    process takes as long as compiling)."""

    def __init__(self, model, name: str, lazy, precompile, extra: dict | None = None,
                 config: dict | None = None):
        self.model, self.name, self.lazy, self.precompile = model, name, lazy, precompile
        self.config = config or {}                   # inductor's settings the graphs were built under
        self.prefix = f"{name}-{model_digest(model, extra or {})[:16]}"
        self.graphs: dict[str, object] = {}          # call key -> loaded or built function, or None
        self.labels: dict[str, str] = {}             # the caller's graph name -> call key
        self.source: dict[str, str] = {}             # call key -> "loaded" / "compiled" / "unsaved" / "lazy"
        self.last = None                             # how the last call's graph was obtained

    def path(self, key: str) -> Path:
        return store_dir() / f"{self.prefix}-{key}.pt2"

    def __call__(self, *args, graph: str | None = None):
        """The step on `args`. graph: the caller's name for the graph this call runs (batch 1 or
        >= 2, the rows' layout): the key is worked out from the arguments once per name (about
        0.1 ms) and then reused, the guards still checking each call."""
        key = self.labels.get(graph) if graph is not None else None
        if key is None:
            key = call_key(self.name, args)
            if graph is not None:
                self.labels[graph] = key
        if key not in self.graphs:
            self.graphs[key] = self._get(key, args)
        fn = self.graphs[key]
        self.last = self.source.get(key, "lazy")
        if fn is not None:
            try:
                with _unmarked(args):
                    return fn(*args)
            except RuntimeError as e:
                if "GuardManager check failed" not in str(e):
                    raise
                log.warning("%s step: the stored graph's guards do not hold for this call (%s); "
                            "compiling it as usual", self.name, str(e).splitlines()[0][:200])
                self.graphs[key], self.source[key] = None, "lazy"
                self.last = "lazy"
        return self.lazy(*args)

    def _get(self, key: str, args):
        path = self.path(key)
        ext = {"model": self.model}
        if path.exists():
            t0 = time.perf_counter()
            try:
                with torch._inductor.config.patch(self.config):
                    fn = torch.compiler.load_compiled_function(io.BytesIO(path.read_bytes()),
                                                              external_data=ext)
                self.source[key] = "loaded"
                log.info("%s step: graph loaded from %s in %.1f s", self.name, path,
                         time.perf_counter() - t0)
                try:
                    os.utime(path)                          # recently used: kept by `_trim`
                except OSError:                             # a store read-only to this user
                    pass
                return fn
            except Exception as e:                          # another torch, a damaged file
                log.warning("%s step: the stored graph %s does not load (%s: %s); building it again",
                            self.name, path.name, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        try:
            with torch.no_grad():
                fn = self.precompile().aot_compile((args, {}))
        except Exception as e:
            log.warning("%s step: precompiling failed (%s: %s); compiling it as usual", self.name,
                        type(e).__name__, (str(e).splitlines() or [""])[0][:200])
            return None
        try:
            atomic_write_bytes(path, type(fn).serialize(fn, ext).serialized_data)
            self.source[key] = "compiled"
            _trim(store_dir())
        except Exception as e:                              # a full disk, a read-only cache
            self.source[key] = "unsaved"
            log.warning("%s step: the compiled graph was not saved (%s: %s)", self.name,
                        type(e).__name__, (str(e).splitlines() or [""])[0][:200])
        return fn


def _trim(d: Path, max_bytes: int = MAX_BYTES) -> None:
    """Remove the least recently used files beyond max_bytes."""
    files = []
    for p in d.glob("*.pt2"):
        try:
            st = p.stat()
        except OSError:                                   # removed by another process meanwhile
            continue
        files.append((st.st_mtime, st.st_size, p))
    total = 0
    for _, size, p in sorted(files, key=lambda f: f[0], reverse=True):
        total += size
        if total > max_bytes:
            p.unlink(missing_ok=True)
