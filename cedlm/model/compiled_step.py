"""The compiled decode step: `model.decode_step` captured by torch.compile, fed from and written
back to the sequences' states. `CEDModel.decode` stays the reference (and the fallback).

    step = CompiledDecode(model)              # compiles on first use (cached on disk by inductor)
    logits = step(ids, states)                # same contract as model.decode(ids, states)

Before the call the host gathers plain tensors: token ids and positions, the Engram history, the
window rings ([layers, B, slots, bytes]: a view for one sequence), each row kind's block pool and
the batch's block table (paged rows as they are; contiguous rows as a one-block pool), entry
counts and the pending compressor rows; with an Engram table offloaded to host memory (the seeds'
design beside a model on the GPU) also the Engram rows, looked up on the host before the step
(the step itself then reads no host memory). After it, it writes back what the step returns: one
ring row per layer, the completed entries (appended to the sequences' rows, which allocate blocks
as usual), the pending rows, the token. Integer bookkeeping only; no tensor value is read back.

The step runs where it is exact to the reference within float rounding and falls back to
`model.decode` otherwise (`why_not`): decisions being recorded or replayed (a test pins them),
a dense-reference config (index_topk covering every position), training mode. Modes
(`decode_step` of the engine args, `CEDLM_DECODE_STEP`): "compiled" (the default on the CPU),
"cudagraph" (the default on CUDA: the static step captured as CUDA graphs over bucketed shapes,
`step_graph.py`), "static" (the same static step without the compiler) and "eager"
(`model.decode`); `CEDLM_REFERENCE_KERNELS=1` means "eager".

Devices: the host builds the step's inputs on the model's device (block tables, positions and
counts from Python ints on the CPU, moved once; padded pools and pending rows made there) and
writes the outputs back to the sequence state on whatever device it lives.
"""
from __future__ import annotations

import copy
import functools
import logging
import os
import time
import weakref
from contextlib import contextmanager

import torch

from cedlm.config.modes import DECODE_STEPS
from cedlm.model import graph_store
from cedlm.model.block import Block
from cedlm.model.model import decode_step, engram_rows, prepare_static
from cedlm.model.static_kv import StepShapes
from cedlm.model.state import ByteRows, SequenceState
from cedlm.model.step_graph import StepGraphs

ENV_VAR = "CEDLM_DECODE_STEP"
# (cedlm/__init__.py points TORCHINDUCTOR_CACHE_DIR at $CEDLM_CACHE_DIR/inductor, default
# ~/.cache/cedlm/inductor: a second start of the same model loads the compiled graphs instead of
# compiling them)
MODES = DECODE_STEPS
# The decode step compiled by region: one compiled `Block.step` per layer kind (`Block.kind`),
# reused by every layer of that kind and called from `decode_step` run uncompiled, rather than
# the whole step as one graph (CEDLM_COMPILE_REGIONS=1/0 overrides; see `Regions`).
REGIONS = os.environ.get("CEDLM_COMPILE_REGIONS", "0") == "1"
# The widest product `products_as_loops` generates as loops (the vocabulary head is 4,096 wide),
# and the most rows: measured faster than MKL at one row and at six (the verify step of a 5-draft
# block); a step of more rows keeps MKL's products (`loop_rows_for`).
LOOP_MAX_WIDTH = 1 << 20
LOOP_MAX_ROWS = 8
_LOOP_LIMITS = ("cpu_max_first_dimension_decomposition", "cpu_max_other_dimension_decomposition")
# torch.compile's backend for the compiled steps. Another one ("eager": dynamo's capture and
# guards without code generation) lets a test count graphs and recompilations in seconds.
BACKEND = "inductor"


def default_mode(device=None) -> str:
    """The mode CEDLM_DECODE_STEP names, else "cudagraph" for a model on CUDA (`device`) and
    "compiled" otherwise; "eager" when the reference kernels are forced (CEDLM_REFERENCE_KERNELS=1
    turns every fast path off)."""
    from cedlm.kernels import reference_kernels
    if reference_kernels():
        return "eager"
    auto = "cudagraph" if device is not None and torch.device(device).type == "cuda" else "compiled"
    v = os.environ.get(ENV_VAR, "").strip().lower() or auto
    if v not in MODES:
        raise ValueError(f"{ENV_VAR}: {v!r} is not one of {MODES}")
    return v


# model -> {mode: CompiledDecode}; weak, so a model that is dropped takes its graphs with it
_STEPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def own_copy(fn):
    """`fn` with a code object of its own: torch.compile keeps compiled graphs and their guards per
    code object, so each CompiledDecode (one per model) gets its own cache."""
    import types
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)


# The optimisation level of the C++ inductor generates for the steps (CEDLM_COMPILE_OPT: O1, O2,
# O3, the default, inductor's own). Measured on the shipped model's batch-1 decode graph
# (bench/scripts/compile_cost.py, docs/development.md): g++ takes 214 CPU-seconds at -O3 with line
# tables, 202 without (the steps drop them), 61 at -O2 and 33 at -O1, but the -O2 graph decodes
# about 1.25x slower, so -O3 stays the default and -O2 is a knob for a machine that compiles
# often.
OPT_LEVEL = os.environ.get("CEDLM_COMPILE_OPT", "O3").strip().upper().lstrip("-") or "O3"
if OPT_LEVEL not in ("O1", "O2", "O3"):
    raise ValueError(f"CEDLM_COMPILE_OPT: {OPT_LEVEL!r} is not one of O1, O2, O3")


def _opt_level_flags() -> None:
    """Make inductor's C++ builds use OPT_LEVEL in place of -O3 (once per process; torch's
    `cpp_builder._get_optimization_cflags`, pinned with torch 2.13.0; left alone if it moved)."""
    if OPT_LEVEL == "O3":
        return
    try:
        from torch._inductor import cpp_builder
    except ImportError:
        return
    orig = getattr(cpp_builder, "_get_optimization_cflags", None)
    if orig is None or getattr(orig, "cedlm_opt", None) == OPT_LEVEL:
        return
    orig = getattr(orig, "original", orig)
    level = OPT_LEVEL

    def flags(cpp_compiler, min_optimize=False):
        cflags, ldflags = orig(cpp_compiler, min_optimize)
        return [level if f == "O3" else f for f in cflags], ldflags

    flags.cedlm_opt, flags.original = level, orig
    cpp_builder._get_optimization_cflags = flags


def stored_step(model, name: str, fn=None, loop_rows: int = 0):
    """The compiled step `fn` (default `model.decode_step`) for `model`, its graphs saved to and
    loaded from the graph store (`graph_store.py`); the lazily compiled function alone when the
    store is off (CEDLM_GRAPH_STORE=0) or the backend is not inductor. loop_rows: the rows of
    its batch-1 graph's products, generated as loops (`inductor_options`); 0: MKL's."""
    lazy = compile_step(model.device, fn, loop_rows)
    if BACKEND != "inductor" or not graph_store.enabled():
        return lazy
    return graph_store.GraphStore(model, name, lazy,
                                  lambda: compile_step(model.device, fn, loop_rows, portable=True),
                                  extra={"opt": OPT_LEVEL, "loop_rows": loop_rows},
                                  config=inductor_options(model.device, loop_rows))


def _portable_guards(entries):
    """The guards a stored graph keeps (`graph_store.py`): tensor metadata, shape relations and
    global state, none on the model's modules (the store's key covers the model)."""
    keep = torch.compiler.keep_portable_guards_unsafe(entries)
    return [k and not e.orig_guard.source.is_unspecialized_nn_module() for k, e in zip(keep, entries)]


def compile_step(device, fn=None, loop_rows: int = 0, portable: bool = False):
    """`fn` (default `model.decode_step`; a copy of its own, `own_copy`) through torch.compile for
    a model on `device`: the decode step's graphs, the verify step's or the draft step's
    (`dspark_steps.py`), their batch-1 products of `loop_rows` rows as loops; portable: with the
    guards a stored graph keeps."""
    # The guards on the model's modules and parameters (hundreds of checks, measured at 2.8 ms
    # of a 9 ms step) are dropped: this object compiles its own copy of the step for one model,
    # whose structure does not change; what could change is checked by `why_not` before every
    # call (decisions attached, training mode) or is an input (Engram rows looked up on the host
    # when the table is offloaded: None or not, guarded). The guards on the step's tensor inputs
    # stay.
    guards = _portable_guards if portable else torch.compiler.skip_guard_on_all_nn_modules_unsafe
    if BACKEND != "inductor":
        return torch.compile(own_copy(fn or decode_step), backend=BACKEND, fullgraph=True,
                             options={"guard_filter_fn": guards})
    if torch.device(device).type == "cpu":
        _opt_level_flags()
    return torch.compile(own_copy(fn or decode_step), fullgraph=True, options={
        **inductor_options(device, loop_rows), "guard_filter_fn": guards})


def inductor_options(device, loop_rows: int = 0) -> dict:
    """Inductor's settings for a step's graphs: while compiling, and while loading a stored graph
    (`graph_store.py`: its C++ is built, or found in inductor's cache, under the same flags)."""
    cpu = torch.device(device).type == "cpu"
    options = {
        # On the CPU the graph's kernels are called from generated C++ rather than a generated
        # Python function, one Python call per step instead of one per kernel (the shipped
        # model at 512 tokens, batch 1: 7.3 -> 6.0 ms per token; its first compile takes
        # longer, about 3 min cold, then loads from the cache).
        "cpp_wrapper": cpu,
        # The generated C++ reads the thread count when it runs instead of baking it in, so the
        # cached graphs serve `cedlm serve` (1 thread) and `cedlm generate` (2) alike: inductor
        # keys its cache by the thread count it specialised on.
        "cpp.dynamic_threads": True}
    if cpu:
        options["aot_inductor.enable_line_tables"] = False
    if loop_rows and cpu:
        # The products of a batch-1 graph (one row for the decode step, the block's rows for the
        # verify and draft steps) as multiply-and-sum loops that inductor generates and fuses
        # with their neighbours, not calls of MKL: inductor's own pass (`decompose_mm_pass`).
        # Measured with every projection and expert of the shipped model in one compiled graph
        # of products, one thread: one row 7.8 -> 3.2 ms, six rows 10.4 -> 5.2 ms; the verify
        # step (6 rows) went from 2.05 to about 1.8 plain steps (bench/scripts/
        # verify_step_time.py). The pass reads its limits from module globals, which
        # `products_as_loops` sets around each call; they are here too so that inductor's cache
        # tells the graphs apart. Graphs of a dynamic batch (>= 2) keep MKL.
        options["post_grad_fusion_options"] = {"decompose_mm_pass": {
            "cpu_max_first_dimension_decomposition": loop_rows,
            "cpu_max_other_dimension_decomposition": LOOP_MAX_WIDTH}}
    return options


class Regions:
    """`decode_step` with each layer's `Block.step` compiled once per layer kind: cold compile
    time grows with the number of distinct kinds, not with depth. Called as the whole compiled
    step is (`fn(shapes, *args)`); the loop over the layers runs in Python between the regions.
    Each region's inputs are marked dynamic where the whole graph's are (the batch, the block
    table and pool sizes), so one graph per kind serves every context length and every batch
    size >= 2."""

    def __init__(self, model, device):
        kinds: dict[tuple, object] = {}
        self.blocks = {}
        for l, layer in enumerate(model.layers):
            k = layer.kind()
            if k not in kinds:
                kinds[k] = compile_step(device, Block.step, loop_rows=1)
            self.blocks[l] = _Region(kinds[k])
        self.kinds = len(kinds)

    def __call__(self, shapes, *args):
        return decode_step(shapes, *args, blocks=self.blocks)


class _Region:
    def __init__(self, fn):
        self.fn = fn

    def __call__(self, layer, shapes, x, pre, p1, io, engram, image):
        mark = torch._dynamo.maybe_mark_dynamic
        for k in ("kv_pool", "idx_pool"):
            if k in io:
                mark(io[k], 0)
                mark(io[k], 1)
        mark(io["table"], 1)
        if "idx_rows" in io:
            mark(io["idx_rows"][0], 1)
        if x.shape[0] > 1:                   # one graph for every batch size >= 2
            for t in (x, pre, p1, engram, image, *_tensors(io)):
                if t is not None and t.dim() and t.shape[0] == x.shape[0]:
                    mark(t, 0)
        return self.fn(layer, shapes, x, pre, p1, io, engram, image)


def _tensors(io: dict):
    for k, v in io.items():
        if k in ("kv_pool", "idx_pool"):
            continue
        yield from (v if isinstance(v, tuple) else (v,))


def graph_name(batch: int, flat: bool) -> str:
    """The graph a call of `batch` sequences runs ("1", ">= 2", ", contiguous rows" when `flat`):
    the keys of `compile_s`."""
    return ("1" if batch == 1 else ">= 2") + (", contiguous rows" if flat else "")


def mark_dynamic(*pairs) -> None:
    """(tensor, dim) pairs whose size varies between calls of one graph (batch, blocks)."""
    for t, d in pairs:
        torch._dynamo.mark_dynamic(t, d)


def error_line(e: Exception) -> str:
    """The first line of an exception's message (at most 200 characters), for a one-line log."""
    return (str(e).strip().splitlines() or [""])[0][:200]


@functools.lru_cache(maxsize=None)
def _decompose_pass():
    """torch's `decompose_mem_bound_mm` module if it has the limits `products_as_loops` sets, else
    None: looked up once, not at every step."""
    try:
        from torch._inductor.fx_passes import decompose_mem_bound_mm as dm
    except ImportError:
        return None
    return dm if all(hasattr(dm, n) for n in _LOOP_LIMITS) else None


def loop_rows_for(rows: int) -> int:
    """The `loop_rows` of a step whose batch-1 graph multiplies `rows` rows: 0 (MKL's products)
    beyond `LOOP_MAX_ROWS`."""
    return rows if 0 < rows <= LOOP_MAX_ROWS else 0


@contextmanager
def products_as_loops(rows: int):
    """While a step's graph may compile: products of at most `rows` rows (a static count) and
    at most `LOOP_MAX_WIDTH` columns become inductor's loops (`inductor_options`), the others
    stay MKL's. torch's pass (`decompose_mem_bound_mm`, pinned with torch 2.13.0) reads these
    limits from module globals set when it is first imported, not from the options a compile
    passes; a graph of a dynamic batch is compiled with 1 row (a larger limit would make the
    pass guard its batched products on the batch size). Left alone if the names moved."""
    dm = _decompose_pass()
    if dm is None:
        yield
        return
    old = [getattr(dm, n) for n in _LOOP_LIMITS]
    dm.cpu_max_first_dimension_decomposition = rows
    dm.cpu_max_other_dimension_decomposition = LOOP_MAX_WIDTH
    try:
        yield
    finally:
        for n, v in zip(_LOOP_LIMITS, old):
            setattr(dm, n, v)


def call(fn, graph: str, *args, loop_rows: int = 0):
    """`fn(*args)`; a stored step (`graph_store.GraphStore`) also told which graph the call runs
    (`graph_name`), which spares it working that out from the arguments at every step. A step
    with `loop_rows` runs under `products_as_loops` (that many rows in its batch-1 graph, 1 in
    the others)."""
    if loop_rows:
        with products_as_loops(loop_rows if graph.startswith("1") else 1):
            return call(fn, graph, *args)
    if isinstance(fn, graph_store.GraphStore):
        return fn(*args, graph=graph)
    return fn(*args)


def how(fn) -> str:
    """How a compiled step's last graph came, for its log line."""
    last = getattr(fn, "last", None)
    if last == "loaded":
        return "loaded from the graph store"
    if last == "compiled":
        return "compiled (saved to the graph store for the next start)"
    if last == "unsaved":
        return "compiled (not saved to the graph store: see the warning above)"
    return "compiled (inductor; its code cached on disk)"


def run_step(step, name: str, uncompiled, args, graph: str):
    """`step.fn(*args)` for a step object compiled apart from the decode step (the verify and
    draft steps: `fn`, `compile`, `compile_s`, `log`, `loop_rows`): if torch.compile fails (no
    compiler here), log one line and run `uncompiled` from then on; the first call of each
    compiled `graph` is timed into `compile_s` (and logged)."""
    t0 = time.perf_counter()
    try:
        result = call(step.fn, graph, *args, loop_rows=step.loop_rows if step.compile else 0)
    except Exception as e:
        if not step.compile:
            raise
        logging.getLogger(__name__).warning("%s: torch.compile failed (%s: %s); running it "
                                            "uncompiled", name, type(e).__name__, error_line(e))
        step.compile, step.fn = False, uncompiled
        result = step.fn(*args)
    if step.compile and graph not in step.compile_s:
        step.compile_s[graph] = time.perf_counter() - t0
        if step.log:
            step.log(f"{name} {how(step.fn)} for batch {graph} in {step.compile_s[graph]:.1f} s")
    return result


def defer(step):
    """Take `step`'s compiled function off its serving path: from now on `step` (a CompiledDecode,
    VerifyStep or DraftStep) runs `step.uncompiled`, the same step without the compiler, and the
    returned shadow (a shallow copy: same model, same `compile_s`) holds the compiled function,
    to be built on scratch inputs in another thread; `adopt` then puts it back at a step
    boundary. None when `step` does not compile."""
    if not step.compile:
        return None
    shadow = copy.copy(step)
    step.fn, step.compile = step.uncompiled, False
    return shadow


def adopt(step, shadow) -> bool:
    """Give `step` its shadow's compiled function (`defer`); False when compiling failed (the
    shadow fell back to running uncompiled: `step` stays as it is)."""
    if shadow is None or not shadow.compile:
        return False
    step.fn, step.compile = shadow.fn, True
    return True


def scratch_states(model, batch: int, rows=None) -> list[SequenceState]:
    """`batch` short sequences (4 prefilled tokens) to compile a step on before any request;
    rows: a rows factory (the engine's block pool), else contiguous rows."""
    states = [model.new_state(None if rows is None else rows()) for _ in range(batch)]
    for st in states:
        model.prefill(torch.arange(3, 7), st)
    return states


class CompiledDecode:
    """`model.decode` as one compiled call per step (see the module docstring).

    mode: "compiled" (the static step through torch.compile / inductor), "cudagraph" (the static
    step replayed as CUDA graphs, `step_graph.StepGraphs`; on the CPU its bucketed buffers without
    the capture), "static" (the same static step run eagerly: its logic without the compiler,
    what most tests exercise), "eager" (`model.decode` itself, the reference). None:
    `default_mode(the model's device)`."""

    def __init__(self, model, mode: str | None = None, log=None):
        self.model = model
        self.device = model.device                    # where the step runs, its inputs are built
        self.mode = default_mode(self.device) if mode is None else mode
        if self.mode not in MODES:
            raise ValueError(f"decode_step: {self.mode!r} is not one of {MODES}")
        self.compile = self.mode == "compiled"
        self.graphs = None
        if self.mode == "cudagraph":
            self.graphs = StepGraphs(decode_step, capture=self.device.type == "cuda")
            if self.device.type != "cuda":
                logging.getLogger(__name__).warning(
                    "decode_step cudagraph: the model is on %s, not CUDA; the step runs through "
                    "the graphs' bucketed buffers without capturing a graph", self.device)
        self.shapes = StepShapes(model)
        self._shapes: dict[bool, StepShapes] = {}
        if self.mode != "eager":
            prepare_static(model)
        self.fn = self.uncompiled = decode_step
        self.loop_rows = 1                            # the products of its batch-1 graph: one row
        if self.compile:
            self.fn = (Regions(model, self.device) if REGIONS else
                       stored_step(model, "decode", loop_rows=1))
        # the modules whose state can take a call off the step (decisions), and the Engram
        # modules (an offloaded table: its rows are looked up on the host, before the step)
        self._watched = [mod for mod in model.modules() if hasattr(mod, "decisions")]
        self._engrams = [mod for mod in model.modules() if hasattr(mod, "host_table")]
        self.compile_s: dict[str, float] = {}     # graph ("1", ">= 2", ...) -> seconds of its first call
        # (BackgroundCompile, [(step object, shadow)]) while graphs of this step (and DSpark's
        # verify and draft steps) are built off the serving path (`Engine.compile_in_background`)
        self.pending = None
        self.calls = self.fallbacks = 0
        self._said: set[str] = set()
        self.log = log

    @classmethod
    def of(cls, model, mode: str | None = None, log=None) -> "CompiledDecode":
        """The model's step for `mode` (None: `default_mode()`), made once per model and mode:
        engines built one after another on the same model share its compiled graphs (a new
        object would trace and load them again, about 20 s)."""
        mode = default_mode(model.device) if mode is None else mode
        steps = _STEPS.setdefault(model, {})
        key = (mode, str(model.device))           # a model moved to another device: new graphs
        if key not in steps:
            steps[key] = cls(model, mode, log=log)
        return steps[key]

    @property
    def min_entries(self) -> int:
        """The fewest entry slots a row kind is given: index_topk, and the candidate pool's
        candidate_topk_blocks x candidate_block_size where a layer takes a candidate pool."""
        cfg = self.model.cfg
        pool = (cfg.candidate_topk_blocks * cfg.candidate_block_size
                if cfg.candidate_source_layer_id is not None and cfg.candidate_topk_blocks else 0)
        return max(cfg.index_topk, pool)

    @property
    def active_mode(self) -> str:
        """The step that runs now: `mode`, or "static" while the compiled graphs are not in use
        (being built in the background: `defer`, or given up after a compiler failure)."""
        return "static" if self.mode == "compiled" and not self.compile else self.mode

    # ---------------------------------------------------------------- eligibility
    def why_not(self) -> str | None:
        """Why this model's decode must take the reference path now, or None."""
        m, cfg = self.model, self.model.cfg
        if self.mode == "eager":
            return "decode_step is eager"
        if m.training:
            return "training mode"
        if cfg.index_topk >= cfg.max_position_embeddings:
            return "dense reference config (index_topk covers every position)"
        for mod in self._watched:
            if getattr(mod, "decisions", None) is not None:
                return "decisions recorded or replayed"
        return None

    # ---------------------------------------------------------------- the call
    @torch.no_grad()
    def __call__(self, input_ids, states: list[SequenceState], paged: bool | None = None) -> torch.Tensor:
        """`model.decode(input_ids, states)`. paged: read the rows through the block table even
        when they are one contiguous buffer (None: as they are kept)."""
        why = self.why_not()
        if why is not None:
            self.fallbacks += 1
            if self.mode != "eager" and why not in self._said:       # once per reason
                self._said.add(why)
                logging.getLogger(__name__).info("decode step: the reference CEDModel.decode "
                                                 "runs while %s", why)
            return self.model.decode(input_ids, states)
        toks = (input_ids.flatten().tolist() if isinstance(input_ids, torch.Tensor)
                else [int(t) for t in input_ids])             # the host's ids (one read, if any)
        if len(toks) != len(states):
            raise ValueError(f"input_ids: {len(toks)} tokens for {len(states)} states")
        ids = torch.tensor(toks, dtype=torch.int64, device="cpu")
        logits, out = self.forward(ids, states, paged)
        self.calls += 1
        self.write_back(toks, states, out)
        return logits

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, states: list[SequenceState], paged: bool | None = None):
        """(logits [B, vocab], out) of the step for these states (see `model.decode_step`), nothing
        written back: the static step compiled, replayed as a CUDA graph or called, by mode. A
        compiler or a capture that fails logs one warning and the static step runs uncompiled from
        then on (nothing was written yet)."""
        shapes = self.shape_for(states, paged)
        args, copied = self._inputs(ids, states)
        graph = graph_name(len(states), shapes.flat)
        t0 = time.perf_counter()
        try:
            if self.graphs is not None:
                logits, out = self.graphs(shapes, args, copied)
            else:
                logits, out = call(self.fn, graph, shapes, *args,
                                   loop_rows=self.loop_rows if self.compile else 0)
        except Exception as e:
            # torch.compile without a compiler or Python headers, an inductor bug, a CUDA graph
            # capture that fails: the same step uncompiled (nothing was written yet)
            if not self.compile and not (self.graphs is not None and self.graphs.capture):
                raise
            self._give_up_compiling(e)
            logits, out = self.fn(shapes, *args)
        if self.compile and graph not in self.compile_s:
            self.compile_s[graph] = time.perf_counter() - t0
            if self.log:
                self.log(f"decode step {how(self.fn)} for batch {graph} in {self.compile_s[graph]:.1f} s")
        for label, sec in (self.graphs.capture_s.items() if self.graphs is not None else ()):
            if label not in self.compile_s:
                self.compile_s[label] = sec
                if self.log:
                    self.log(f"decode step captured ({label}) in {sec:.2f} s")
        return logits, out

    def _give_up_compiling(self, e: Exception) -> None:
        why = error_line(e)
        what = "CUDA graph capture" if self.graphs is not None else "torch.compile"
        logging.getLogger(__name__).warning(
            "decode step: %s failed (%s: %s); running the step uncompiled "
            "(--decode-step static)", what, type(e).__name__, why)
        self.compile, self.mode, self.fn, self.graphs = False, "static", decode_step, None

    @torch.no_grad()
    def warm_up(self, batch_sizes: tuple[int, ...] = (1, 2), rows=None) -> dict[str, float]:
        """Compile the engine's graphs (batch 1 and batch >= 2, rows read through a block table;
        cudagraph: capture the buckets of `batch_sizes` at a short context) on scratch states
        before the first request, so that no request waits for the compiler; returns {graph:
        seconds} (nothing when neither compiling nor capturing). rows: the `SequenceState` rows
        factory of the engine's block pool (`Engine.warm_up` passes it and frees the blocks), so
        the scratch states have the pool's shapes; without it, contiguous rows."""
        capturing = self.graphs is not None and self.graphs.capture
        if not (self.compile or capturing) or self.why_not() is not None:
            return {}
        for B in batch_sizes:
            self(list(range(B)), scratch_states(self.model, B, rows), paged=True)
        return dict(self.compile_s)

    def shape_for(self, states: list[SequenceState], paged: bool | None = None) -> StepShapes:
        """The step's static description for this call: `flat` when one sequence's rows are
        contiguous buffers (read in place; the engine's paged rows go through the table)."""
        flat = not paged and self._one_contiguous(states)
        if flat not in self._shapes:
            sh = copy.copy(self.shapes)
            sh.flat = flat
            self._shapes[flat] = sh
        return self._shapes[flat]

    def _one_contiguous(self, states: list[SequenceState]) -> bool:
        """Whether the call is one sequence whose rows are its own contiguous buffers
        (`ByteRows`), not rows of the engine's paged pool."""
        return len(states) == 1 and isinstance(states[0].kv[self.shapes.sources[0]], ByteRows)

    def inputs(self, ids: torch.Tensor, states: list[SequenceState]):
        """The step's tensors (see `model.decode_step`), on the model's device."""
        return self._inputs(ids, states)[0]

    def _inputs(self, ids: torch.Tensor, states: list[SequenceState]):
        """(the step's tensors, whether the pools are copies made for this call). ids [B] or
        [B, T] (the verify step: room for T new entries past the stored ones)."""
        cfg, dev = self.model.cfg, self.device
        B = len(states)
        T = ids.shape[1] if ids.dim() == 2 else 1
        ids = ids.to(dev, non_blocking=True)
        pos = torch.tensor([st.num_tokens for st in states], dtype=torch.int64, device="cpu")
        h = max(cfg.engram_max_ngram_size - 1, 0) if cfg.engram_layer_ids else 0
        hist = [[cfg.engram_pad_token_id] * h for _ in states]
        for b, st in enumerate(states):
            prev = st.token_ids[max(0, st.num_tokens - h): st.num_tokens] if h else []
            if prev:
                hist[b][h - len(prev):] = prev
        hist = torch.tensor(hist, dtype=torch.int64, device="cpu").view(B, h)
        if B == 1:
            rings, ring_pos = states[0].window_all.unsqueeze(1), states[0].window_pos_all.unsqueeze(1)
        else:
            rings = torch.stack([st.window_all for st in states], 1)
            ring_pos = torch.stack([st.window_pos_all for st in states], 1)
        if self._one_contiguous(states):
            st = states[0]                   # the entry this token may complete needs a row,
            for rows in (*st.kv.values(), *st.index.values()):    # and the top-k a full k
                rows.reserve(max(rows.n + T, self.min_entries))
        pools, table, copied = self._pools(states, T)
        counts = {s: torch.tensor([st.kv[s].n for st in states], dtype=torch.int64, device="cpu")
                  for s in self.shapes.sources}
        pending = {}
        for s, r in self.shapes.ratio.items():
            if r > 1:                        # every sequence's rows in one copy (not one per row)
                ks, gs = zip(*(st.pending[s] for st in states))
                d = ks[0].shape[1]
                pk, pg = torch.zeros(B, r - 1, d, device=dev), torch.zeros(B, r - 1, d, device=dev)
                at = [b * (r - 1) + j for b, k in enumerate(ks) for j in range(k.shape[0])]
                if at:
                    at = torch.tensor(at, dtype=torch.int64, device="cpu").to(dev, non_blocking=True)
                    pk.view(B * (r - 1), d).index_copy_(0, at, torch.cat(ks).to(dev, non_blocking=True))
                    pg.view(B * (r - 1), d).index_copy_(0, at, torch.cat(gs).to(dev, non_blocking=True))
                pending[s] = (pk, pg)
        # host-built integers and the windows to the model's device (no-ops on the CPU)
        pos, hist, rings, ring_pos = (t.to(dev, non_blocking=True) for t in (pos, hist, rings, ring_pos))
        counts = {s: c.to(dev, non_blocking=True) for s, c in counts.items()}
        engram = None                        # an offloaded table: its rows gathered on the host now
        if any(e.host_table is not None for e in self._engrams):
            engram = engram_rows(self.model, ids, hist)
        if self.compile and B > 1:           # one graph for every batch size >= 2
            mark_dynamic((ids, 0), (pos, 0), (hist, 0), (rings, 1), (ring_pos, 1), (table, 0),
                         *((c, 0) for c in counts.values()), *((x, 0) for p in pending.values() for x in p),
                         *((e, 0) for e in (engram or {}).values()))
        return (ids, pos, hist, rings, ring_pos, pools, table, counts, pending, engram), copied

    def _pools(self, states, T: int = 1):
        """Each row kind's pool and one block table for the batch (spare column at the end), and
        whether the pools are copies made for this call: paged rows of one pool as they are; one
        sequence's contiguous rows as a one-block pool; contiguous rows of several sequences
        copied into one padded pool (and rows kept on another device than the model's copied
        there)."""
        kinds = [("kv", s) for s in self.shapes.sources] + [("idx", s) for s in sorted(self.shapes.key_sources)]

        def rows(st, k):
            return (st.kv if k[0] == "kv" else st.index)[k[1]]

        dev = self.device
        first = {k: rows(states[0], k).blocks()[0] for k in kinds}
        shared = all(rows(st, k).blocks()[0].data_ptr() == first[k].data_ptr()
                     for st in states[1:] for k in kinds)
        if shared:
            copied = any(p.device != dev for p in first.values())
            pools = {k: p.to(dev) for k, p in first.items()}
            tables = [rows(st, kinds[0]).blocks()[1] for st in states]
            pad = [0] * len(states)
        else:
            copied, pools = True, {}
            for k in kinds:
                bufs = [rows(st, k).blocks()[0][0] for st in states]
                cap = max(max(b.shape[0] for b in bufs), self.min_entries)
                # a whole number of candidate blocks: the graph's candidate-block view of N =
                # blocks x cap entries guards on N % candidate_block_size, and a cap that broke
                # it recompiled the batch >= 2 graph (minutes) when the rows grew past a block
                cb = self.model.cfg.candidate_block_size or 1
                cap = -(-cap // cb) * cb
                pool = torch.zeros(len(bufs), cap, bufs[0].shape[1], dtype=torch.uint8, device=dev)
                for b, buf in enumerate(bufs):
                    pool[b, : buf.shape[0]] = buf
                pools[k] = pool
            tables = [[b] for b in range(len(states))]
            pad = list(range(len(states)))
        # spare columns (the entries the T tokens may complete), and at least `min_entries` slots
        # in every row kind: the top-k is then always k = index_topk wide and the candidate pool
        # always candidate_topk_blocks blocks (a k that followed the table width would be a
        # constant torch.compile specialises on: a longer prompt would recompile mid-request)
        per = min(p.shape[1] for p in pools.values())
        nb = max(max(len(t) for t in tables) + -(-T // per), -(-self.min_entries // per))
        table = torch.tensor([list(t) + [pad[b]] * (nb - len(t)) for b, t in enumerate(tables)],
                             dtype=torch.int64, device="cpu").to(dev, non_blocking=True)
        if self.compile:                     # one graph for every context length
            mark_dynamic((table, 1), *((p, d) for p in pools.values() for d in (0, 1)))
        return pools, table, copied

    def write_back(self, ids, states: list[SequenceState], out: dict, keep: list[int] | None = None) -> None:
        """Put what the step returns into the states (on whatever device each lives): one window
        row per layer, the entries a completed group made, the pending rows, the token (`ids`:
        the token ids, a list or a host tensor). For the verify step (ids [B, T]): the first
        keep[b] of sequence b's T rows (None: all), as if only they had been appended."""
        toks = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        rows = [t if isinstance(t, list) else [t] for t in toks]
        keep = [len(r) for r in rows] if keep is None else keep
        win = out["window"]                                   # [L, B, wb] or [L, B, T, wb]
        if win.dim() == 3:
            win = win.unsqueeze(2)
        S = states[0].window_all.shape[1]
        # the pending rows: one copy of the batch's per source, each state keeping its rows (a
        # view of it; pending rows are replaced, never written in place)
        dev0 = states[0].window_all.device
        pend = {s: (pk.to(dev0, copy=True), pg.to(dev0, copy=True)) for s, (pk, pg) in out["pending"].items()}
        for b, st in enumerate(states):
            p, n, sdev = st.num_tokens, keep[b], st.window_all.device
            if n == 1:
                st.window_all[:, p % S] = win[:, b, 0]
                st.window_pos_all[:, p % S] = p
            elif n:
                slots = torch.arange(p, p + n, device=sdev) % S
                st.window_all[:, slots] = win[:, b, :n].to(sdev)
                st.window_pos_all[:, slots] = torch.arange(p, p + n, device=sdev)
            for s, (main, idx, _) in out["entries"].items():
                r = self.shapes.ratio[s]
                made = (p + n) // r - p // r                          # groups the rows completed
                if made:
                    st.kv[s].append(main[b, :made])
                    if idx is not None:
                        st.index[s].append(idx[b, :made])
            for s, (pk, pg) in pend.items():
                # slot i of the step's pending rows holds position p - p % r + i
                r = self.shapes.ratio[s]
                end = p % r + n
                st.pending[s] = (pk[b, end - end % r: end].to(sdev), pg[b, end - end % r: end].to(sdev))
            st.advance(rows[b][:n])
