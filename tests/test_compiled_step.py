"""The static decode step (cedlm/model/model.py's decode_step) and its compiled form against the reference
`CEDModel.decode`: per step from identical states, the same discrete decisions (indexer top-k as
sets, MoE experts) and, where they agree, logits within float rounding; the states they leave
behind (window rings, entries, pending rows) byte-equal.

A comparison never hinges on a near-tie: each step starts both paths from the same state (a deep
copy), counts steps whose decisions differ (allowed: rarely, near-ties under another summation
order) and compares logits only where they agree. `static` runs the step's code eagerly (the
suite's engines use it); `compiled` goes through torch.compile (inductor): one graph for batch 1
and one for batch >= 2, a few minutes of compile on this machine the first time (cached on disk
afterwards; the time grows with the number of layers), so the default suite compiles them for a
6-layer model of the shipped widths with one layer of every kind (`every_kind`) and the shipped
model's own graphs are an opt-in (`slow`) run; `cudagraph` replays the step as CUDA graphs over
bucketed shapes (on the CPU: the same padded buffers, nothing captured).

The exactness tests run over `DEVICES` (tests/devices.py): on the CPU always, on CUDA when this
torch sees a GPU (there `cudagraph` captures and replays real graphs, `static` is the same step
uncaptured), skipped with the reason otherwise."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from cedlm.checkpoint import load_model
from cedlm.model.compiled_step import CompiledDecode, default_mode
from cedlm.model.decisions import Decisions
from tests.devices import DEVICES

TOL = 1e-3   # |logit difference| (logits of std ~3): float32 rounding of two summation orders, and
             # the rare FP4/FP8 code it moves to a neighbouring value


@pytest.fixture(scope="module")
def shipped():
    return load_model("cedlm/assets/model")[0].eval()


def every_kind_config(preset: str = "small", **kw):
    """The widths of `preset` (`small`: the shipped model's) in 6 layers, one of each kind a
    compiled graph traces: SWA, a ratio-2 Full layer with Engram and its ratio-2 Reuse layer, the
    ratio-1 global-KV and candidate source that starts the decoder, a Reindex layer and a ratio-1
    Reuse layer (torch.compile's time grows with the layers and their kinds); `kw` replaced."""
    from cedlm.config import ModelConfig
    from cedlm.config.engram_sizes import engram_table_rows
    c = ModelConfig.preset(preset)
    engram = [1]
    return c.replace(num_hidden_layers=6, compress_ratios=[0, 2, 2, 1, 1, 1, 0],
                     kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 3, 4],
                     candidate_source_layer_id=3, engram_layer_ids=engram,
                     engram_num_embeddings=engram_table_rows(engram, c.engram_vocab_size,
                                                             c.engram_max_ngram_size, c.engram_n_heads),
                     dspark_target_layer_ids=[5], **kw)


@pytest.fixture(scope="module")
def every_kind():
    """`every_kind_config()` with random weights at initializer_range 0.08 (logits of std ~1, not
    a near-constant)."""
    from cedlm.model import CEDModel
    torch.manual_seed(0)
    return CEDModel(every_kind_config(initializer_range=0.08)).eval()


_ON: dict[str, torch.nn.Module] = {}


def _shipped_on(device: str, shipped):
    """The shipped model on `device` (the module's CPU copy for "cpu"; one copy per device)."""
    if device == "cpu":
        return shipped
    if device not in _ON:
        _ON[device] = load_model("cedlm/assets/model", device=device)[0].eval()
    return _ON[device]


def _eager_decisions(model, ids, states):
    rec = Decisions.record(model)
    try:
        logits = model.decode(ids, states)
    finally:
        rec.detach()
    return logits, rec.log


def _agree(model, log, out) -> bool:
    """Whether the step's decisions (out) equal the eager ones (Decisions log of one call)."""
    for name, entries in log.items():
        (t,) = entries
        layer = int(name.split(".")[1])
        if name.endswith("indexer"):
            idx, ok = t[0], t[1].bool()                     # [B, 1, k]
            sidx, sok = out["topk"][layer]
            for b in range(idx.shape[0]):
                if set(idx[b, 0][ok[b, 0]].tolist()) != set(sidx[b, 0][sok[b, 0]].tolist()):
                    return False
        else:
            if not torch.equal(t.sort(-1).values, out["experts"][layer].sort(-1).values):
                return False
    return True


def _state_bytes(st):
    return (st.window_all.clone(), st.window_pos_all.clone(),
            {s: r.view().clone() for s, r in st.kv.items()},
            {s: r.view().clone() for s, r in st.index.items()},
            {s: (k.clone(), g.clone()) for s, (k, g) in st.pending.items()}, list(st.token_ids))


def _assert_same_state(a, b):
    """Positions, tokens and entry counts equal; the stored bytes equal but for rare codes that a
    last-bit difference of the input rounds to the neighbouring FP4/FP8 value (<= 0.5 %)."""
    wa, pa, _, _, _, ta = _state_bytes(a)
    wb, pb, _, _, _, tb = _state_bytes(b)
    assert torch.equal(pa, pb) and ta == tb
    assert wa.shape == wb.shape and (wa != wb).float().mean().item() <= 0.005
    assert_same_entries(a, b)


def assert_same_entries(a, b):
    """Entry codes (main KV, index keys) equal but for <= 0.5 %; pending rows within 1e-4."""
    _, _, kva, ia, pena, _ = _state_bytes(a)
    _, _, kvb, ib, penb, _ = _state_bytes(b)
    for x, y in [(kva[s], kvb[s]) for s in kva] + [(ia[s], ib[s]) for s in ia]:
        assert x.shape == y.shape
        assert (x != y).float().mean().item() <= 0.005
    for s in pena:
        assert pena[s][0].shape == penb[s][0].shape
        assert torch.allclose(pena[s][0], penb[s][0], atol=1e-4)


@torch.no_grad()
def _run(model, mode, prompts, steps, check_states=True, step=None):
    """Prefill each prompt, then `steps` decode steps; each compares one step of both paths
    from one state (through `step`, default a new CompiledDecode of `mode`). Returns (steps
    compared, steps whose decisions differed)."""
    step = step or CompiledDecode(model, mode)
    dev = step.device
    states = [model.new_state() for _ in prompts]
    toks = [int(model.prefill(p.to(dev), st)[-1].argmax()) for p, st in zip(prompts, states)]
    compared = differ = 0
    for _ in range(steps):
        ref_states = copy.deepcopy(states)
        ref, log = _eager_decisions(model, toks, ref_states)
        logits, out = step.forward(torch.tensor(toks), states)
        assert step.mode == mode                        # no fallback (a failed compile or capture)
        step.write_back(toks, states, out)
        compared += 1
        if not _agree(model, log, out):
            differ += 1
        else:
            assert (logits - ref).abs().max().item() < TOL
            if check_states:
                for a, b in zip(states, ref_states):
                    _assert_same_state(a, b)
        toks = ref.argmax(-1).tolist()
        # continue both from the step's own state (the reference state is discarded)
    return compared, differ


def _prompts(n, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4000, (L,), generator=g) for L in lengths][:n]


STEP_MODES = pytest.mark.parametrize("mode", ["static", "cudagraph"])
ON_DEVICES = pytest.mark.parametrize("device", DEVICES)


@ON_DEVICES
@STEP_MODES
def test_static_step_matches_reference_across_boundaries(shipped, device, mode):
    """Batch 1 from a 61-token prompt through 70 steps: the window ring wraps (64 slots), ratio-2
    groups complete every other token, paged-size boundaries of the contiguous rows are crossed
    (cudagraph: the contiguous buffer doubles, a graph per buffer)."""
    compared, differ = _run(_shipped_on(device, shipped), mode, _prompts(1, [61]), 70)
    assert differ <= 2, f"{differ} of {compared} steps chose differently"


@ON_DEVICES
@STEP_MODES
def test_static_step_batched_uneven_lengths(shipped, device, mode):
    """Three sequences of different lengths (different phases, entry counts, ring fill) at once:
    the contiguous rows of several sequences go through one padded pool (cudagraph: batch 3 in
    the bucket of 4, a dummy row)."""
    compared, differ = _run(_shipped_on(device, shipped), mode, _prompts(3, [5, 40, 130], seed=1), 12)
    assert differ <= 1


@ON_DEVICES
@STEP_MODES
@torch.no_grad()
def test_static_step_paged_rows_match_contiguous(shipped, device, mode):
    """The engine's paged rows (one pool, block tables) give the same logits as contiguous rows:
    bit for bit in the static step; within float rounding through the graphs' buckets (the two
    layouts pad the table to other widths, more masked slots in one of them)."""
    from cedlm.cache.block_pool import BlockPool, BlockTable
    model = _shipped_on(device, shipped)
    pool = BlockPool(model.kv_layout, 64, 64, device=model.device)
    prompts = [p.to(device) for p in _prompts(2, [70, 150], seed=2)]
    paged = [model.new_state(pool.rows(BlockTable(pool))) for _ in prompts]
    flat = [model.new_state() for _ in prompts]
    step = CompiledDecode(model, mode)
    toks = []
    for p, a, b in zip(prompts, paged, flat):
        toks.append(int(model.prefill(p, a)[-1].argmax()))
        model.prefill(p, b)
    for _ in range(6):
        la = step(toks, paged)
        lb = step(toks, flat)
        assert (la - lb).abs().max().item() <= (0.0 if mode == "static" and device == "cpu" else TOL)
        toks = la.argmax(-1).tolist()
    assert step.mode == mode and step.fallbacks == 0


def test_fallbacks_and_modes(shipped, monkeypatch):
    step = CompiledDecode(shipped, "static")
    assert step.why_not() is None
    rec = Decisions.record(shipped)
    try:
        assert "decisions" in step.why_not()
    finally:
        rec.detach()
    assert CompiledDecode(shipped, "eager").why_not() == "decode_step is eager"
    graphs = CompiledDecode(shipped, "cudagraph")     # on the CPU: its buffers, no capture
    st = shipped.new_state()
    shipped.prefill(torch.arange(5, 30), st)
    rec = Decisions.record(shipped)
    try:
        assert "decisions" in graphs.why_not()
        graphs([7], [st])                              # the reference decode runs
    finally:
        rec.detach()
    assert graphs.fallbacks == 1 and graphs.calls == 0 and not graphs.graphs.graphs
    graphs([8], [st])
    assert graphs.calls == 1 and len(graphs.graphs.graphs) == 1 and st.num_tokens == 27
    with pytest.raises(ValueError, match="decode_step"):
        CompiledDecode(shipped, "fast")
    monkeypatch.setenv("CEDLM_DECODE_STEP", "bogus")
    with pytest.raises(ValueError, match="CEDLM_DECODE_STEP"):
        default_mode()
    from cedlm.kernels.gate import reference_kernels_forced
    with reference_kernels_forced():
        assert default_mode() == "eager"


def test_engine_args_decode_step():
    from cedlm.engine.args import EngineArgs
    assert EngineArgs(decode_step="static").decode_step == "static"
    with pytest.raises(ValueError, match="decode_step"):
        EngineArgs(decode_step="jit")


@pytest.mark.ahead
@pytest.mark.compiled
@ON_DEVICES
def test_compiled_step_matches_reference_every_layer_kind(every_kind, device, tmp_path):
    """The step through torch.compile (inductor; Triton on CUDA) of the 6-layer model with every
    layer kind at the shipped widths (`every_kind_config`): batch 1 (the window ring wraps), then
    batch 3 (the graph for >= 2), one step object: each graph compiled once. The shipped model's
    12 layers take about twice the compile time of the same graphs (measured cold, batch 1:
    ~250 s of CPU against ~130 s): test_compiled_step_matches_reference, slow. A 12-layer model
    of these widths (CED-small, the benchmark's) is compiled for real in the default suite by
    test_bench.test_quick_compiled_step (batch 1, not fallen back). The graphs go through the
    graph store (`graph_store.py`: saved on the first run on a machine, loaded on later ones),
    and a second process loads both and computes the same logits bit for bit."""
    model = every_kind if device == "cpu" else copy.deepcopy(every_kind).to(device)
    step = CompiledDecode(model, "compiled")
    compared, differ = _run(model, "compiled", _prompts(1, [61]), 8, step=step)
    assert differ <= 1
    compared, differ = _run(model, "compiled", _prompts(3, [5, 40, 130], seed=1), 5, step=step)
    assert differ <= 1
    # both graphs came through the graph store (compiled and saved, or loaded: never the lazy
    # fallback), and a new process loads them without tracing and computes the same logits
    assert sorted(step.fn.source.values()) in (["compiled"] * 2, ["loaded"] * 2,
                                               ["compiled", "loaded"]), step.fn.source
    if device == "cpu":
        got = _load_in_a_new_process(tmp_path)
        for B in (1, 3):
            assert got[f"how{B}"] == "loaded"
            assert torch.equal(got[f"logits{B}"], _first_logits(step, B))


_SCRATCH = """
import sys, torch
from cedlm.model import CEDModel
from cedlm.model.compiled_step import CompiledDecode
from tests.test_compiled_step import every_kind_config, _first_logits
torch.set_num_threads(1)
torch.manual_seed(0)
model = CEDModel(every_kind_config(initializer_range=0.08)).eval()
step = CompiledDecode(model, "compiled")
got = {}
for B in (1, 3):
    got[f"logits{B}"] = _first_logits(step, B)
    got[f"how{B}"] = step.fn.last
torch.save(got, sys.argv[1])
"""


@torch.no_grad()
def _first_logits(step, B):
    """The step's logits after prefilling the prompts the test's run starts from (B = 1 or 3: the
    shapes its graphs were captured on), ids 5, 6, ..."""
    prompts = _prompts(1, [61]) if B == 1 else _prompts(3, [5, 40, 130], seed=1)
    states = [step.model.new_state() for _ in prompts]
    for p, st in zip(prompts, states):
        step.model.prefill(p, st)
    return step.forward(torch.arange(B) + 5, states)[0]


def _load_in_a_new_process(tmp_path) -> dict:
    import subprocess
    import sys
    out = tmp_path / "got.pt"
    subprocess.run([sys.executable, "-c", _SCRATCH, str(out)], check=True, timeout=600,
                   cwd=str(Path(__file__).resolve().parents[1]))
    return torch.load(out)


def test_regions_compile_each_layer_kind_once(shipped, monkeypatch):
    """Compiled by region (`compiled_step.Regions`), through dynamo's capture and guards without
    code generation (the "eager" backend): one compiled `Block.step` per layer kind, reused by
    every layer of the kind; batch 1 at two context lengths and batch 2 then 3 (one graph for
    >= 2) add no recompilation after the first of each; the logits equal the whole step's
    uncompiled within float rounding (the captured graphs' ops, a few ulps)."""
    import torch._dynamo as dynamo
    from cedlm.model import compiled_step
    monkeypatch.setattr(compiled_step, "BACKEND", "eager")
    monkeypatch.setattr(compiled_step, "REGIONS", True)
    dynamo.reset()
    step = CompiledDecode(shipped, "compiled")
    kinds = {layer.kind() for layer in shipped.layers}
    assert isinstance(step.fn, compiled_step.Regions) and step.fn.kinds == len(kinds) < len(shipped.layers)
    static = CompiledDecode(shipped, "static")
    frames = []
    base = dynamo.utils.counters["stats"]["unique_graphs"]      # a global count: other tests add
    with torch.no_grad():
        for lengths, steps in (([61], 2), ([300], 1), ([5, 40], 1), ([7, 90, 33], 1)):
            states = [shipped.new_state() for _ in lengths]
            toks = [int(shipped.prefill(p, st)[-1].argmax()) for p, st in zip(_prompts(len(lengths), lengths), states)]
            for _ in range(steps):
                ref, _ = static.forward(torch.tensor(toks), copy.deepcopy(states))
                got, out = step.forward(torch.tensor(toks), states)
                assert (got - ref).abs().max().item() <= 1e-4      # float rounding: a few ulps
                step.write_back(toks, states, out)
                toks = got.argmax(-1).tolist()
            frames.append(dynamo.utils.counters["stats"]["unique_graphs"] - base)
    # a graph per kind for batch 1 and one per kind for batch >= 2: the longer prompt and the
    # third sequence compiled nothing new
    assert frames[0] == len(kinds) and frames[1] == frames[0]
    assert frames[2] <= 2 * len(kinds) and frames[3] == frames[2]


@pytest.mark.slow            # cold: two graphs of 12 layers, about 10 minutes on this 2-core machine
@pytest.mark.compiled
@ON_DEVICES
def test_compiled_step_matches_reference(shipped, device):
    """The step through torch.compile (inductor; Triton on CUDA) of the shipped model: batch 1,
    then batch 3 (the graph for >= 2). The same checks as
    test_compiled_step_matches_reference_every_layer_kind, which covers them in the default suite
    on 6 layers of every kind at these widths."""
    model = _shipped_on(device, shipped)
    compared, differ = _run(model, "compiled", _prompts(1, [61]), 8)
    assert differ <= 1
    compared, differ = _run(model, "compiled", _prompts(3, [5, 40, 130], seed=1), 5)
    assert differ <= 1


@ON_DEVICES
@STEP_MODES
@torch.no_grad()
def test_static_step_incremental_equals_full_forward(device, mode):
    """Another config (the `tiny` preset: other widths, roles and ratios): prefill one token,
    then every later token through the static step; the logits equal the full causal forward's."""
    from cedlm import CEDModel, ModelConfig
    cfg = ModelConfig.preset("tiny").replace(initializer_range=0.08)
    torch.manual_seed(0)
    tiny = CEDModel(cfg).eval().to(device)
    S = 6 * cfg.sliding_window
    ids = torch.randint(0, cfg.vocab_size, (S,), generator=torch.Generator().manual_seed(1)).to(device)
    full = tiny(ids[None])[0]
    step = CompiledDecode(tiny, mode)
    st = tiny.new_state()
    out = [tiny.prefill(ids[:1], st, "full")[-1:]]
    for t in range(1, S - 1):
        out.append(step(ids[t:t + 1], [st]))
    assert step.fallbacks == 0
    inc = torch.cat(out)
    assert full.std() > 0.05                                    # the comparison is not vacuous
    assert (inc - full[:-1]).abs().max().item() < TOL


@torch.no_grad()
def test_compile_failure_falls_back_to_the_uncompiled_step(shipped, caplog):
    """A machine without a working compiler: the first compiled call raises; one warning line,
    and the same step runs uncompiled (the states untouched by the failed call)."""
    step = CompiledDecode(shipped, "static")
    step.compile, step.mode = True, "compiled"

    def broken(*a, **k):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")
    step.fn = broken
    st, ref = shipped.new_state(), shipped.new_state()
    prompt = torch.arange(5, 40)
    t = int(shipped.prefill(prompt, st)[-1].argmax())
    shipped.prefill(prompt, ref)
    with caplog.at_level("WARNING"):
        logits = step([t], [st])
    assert step.mode == "static" and not step.compile
    assert "torch.compile failed (RuntimeError: InvalidCxxCompiler: No working C++ compiler found)" in caplog.text
    assert (logits - shipped.decode([t], [ref])).abs().max().item() < TOL
    assert st.num_tokens == ref.num_tokens


@torch.no_grad()
def test_capture_failure_falls_back_to_the_uncompiled_step(shipped, caplog):
    """A CUDA graph capture that fails (a kernel that synchronises, no memory): one warning line,
    and the same step runs uncaptured from then on."""
    step = CompiledDecode(shipped, "cudagraph")

    class Broken:
        capture, capture_s = True, {}

        def __call__(self, *a):
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
    step.graphs = Broken()
    st, ref = shipped.new_state(), shipped.new_state()
    prompt = torch.arange(5, 40)
    t = int(shipped.prefill(prompt, st)[-1].argmax())
    shipped.prefill(prompt, ref)
    with caplog.at_level("WARNING"):
        logits = step([t], [st])
    assert step.mode == "static" and step.graphs is None
    assert "CUDA graph capture failed (RuntimeError: CUDA error: operation not permitted" in caplog.text
    assert (logits - shipped.decode([t], [ref])).abs().max().item() < TOL
    assert st.num_tokens == ref.num_tokens


@torch.no_grad()
def test_engine_warm_up_runs_in_its_pool_and_frees_it(shipped):
    """`Engine.warm_up` runs the step on scratch sequences in the engine's own block pool (the
    shapes the engine's graphs see) and gives every block back. The step runs uncompiled here
    (marked as compiling), which follows the same path without the compile time."""
    from cedlm.engine.args import EngineConfig
    from cedlm.engine.engine import Engine
    eng = Engine(shipped, None, EngineConfig(decode_step="static", kv_budget_bytes=8 << 20))
    free = eng.pool.num_free
    assert eng.warm_up() == {}                          # not compiling: nothing to do
    eng.decoder.compile = True                          # the warm-up flow, without inductor
    try:
        done = eng.warm_up()
    finally:
        eng.decoder.compile = False
    assert set(done) == {"1", ">= 2"} and eng.pool.num_free == free


def test_compile_opt_level_knob(monkeypatch):
    """CEDLM_COMPILE_OPT's level replaces inductor's -O3 in the C++ builds (the default O3 leaves
    inductor's flags alone); the steps compile without line tables."""
    from torch._inductor import cpp_builder
    from cedlm.model import compiled_step
    orig = cpp_builder._get_optimization_cflags
    monkeypatch.setattr(cpp_builder, "_get_optimization_cflags", orig)
    monkeypatch.setattr(compiled_step, "OPT_LEVEL", "O3")
    compiled_step._opt_level_flags()
    assert cpp_builder._get_optimization_cflags is orig
    monkeypatch.setattr(compiled_step, "OPT_LEVEL", "O2")
    compiled_step._opt_level_flags()
    cflags, _ = cpp_builder._get_optimization_cflags("g++")
    assert "O2" in cflags and "O3" not in cflags


def test_products_of_a_batch_1_graph_become_loops(tmp_path, monkeypatch):
    """A step with `loop_rows` compiles its batch-1 graph's products of that many rows as
    inductor's loops (torch's `decompose_mm_pass`, whose limits are module globals that the
    options alone do not reach), and leaves them MKL's in a graph of a dynamic batch; the limits
    are put back after each call, and the loops give MKL's values within float rounding."""
    from torch._dynamo.utils import counters
    from torch._inductor.fx_passes import decompose_mem_bound_mm as dm
    from cedlm.model import compiled_step
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))    # compiled, not found cached
    before = (dm.cpu_max_first_dimension_decomposition, dm.cpu_max_other_dimension_decomposition)

    def product(x, w):
        return x @ w

    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 4096, generator=g)
    x = torch.randn(6, 256, generator=g)
    counters.clear()
    fn = compiled_step.compile_step("cpu", product, loop_rows=6)
    y = compiled_step.call(fn, "1", x, w, loop_rows=6)
    assert counters["inductor"]["decompose_mm"] == 1
    assert (dm.cpu_max_first_dimension_decomposition, dm.cpu_max_other_dimension_decomposition) == before
    torch.testing.assert_close(y, x @ w, rtol=1e-4, atol=1e-4)
    counters.clear()
    fn = compiled_step.compile_step("cpu", product, loop_rows=6)
    xs = torch.randn(6, 256, generator=g)
    compiled_step.mark_dynamic((xs, 0))                              # rows vary, as a batch does
    compiled_step.call(fn, ">= 2", xs, w, loop_rows=6)
    assert counters["inductor"]["decompose_mm"] == 0
    opts = compiled_step.inductor_options("cpu", 6)["post_grad_fusion_options"]["decompose_mm_pass"]
    assert opts["cpu_max_first_dimension_decomposition"] == 6       # inductor's cache key tells them apart
    assert "post_grad_fusion_options" not in compiled_step.inductor_options("cpu", 0)
    assert compiled_step.loop_rows_for(6) == 6                       # the verify step of 5 drafts
    assert compiled_step.loop_rows_for(compiled_step.LOOP_MAX_ROWS + 1) == 0   # more rows: MKL's
