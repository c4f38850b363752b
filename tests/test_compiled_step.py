"""The static decode step (cedlm/model/step.py) and its compiled form against the reference
`CEDModel.decode`: per step from identical states, the same discrete decisions (indexer top-k as
sets, MoE experts) and, where they agree, logits within float rounding; the states they leave
behind (window rings, entries, pending rows) byte-equal.

A comparison never hinges on a near-tie: each step starts both paths from the same state (a deep
copy), counts steps whose decisions differ (allowed: rarely, near-ties under another summation
order) and compares logits only where they agree. `static` runs the step's code eagerly (the
suite's engines use it); `compiled` goes through torch.compile (inductor): one graph for batch 1
and one for batch >= 2 of the shipped model, a few minutes of compile on this machine the first
time (cached on disk afterwards)."""
from __future__ import annotations

import copy

import pytest
import torch

from cedlm.checkpoint import load_model
from cedlm.model.compiled_step import CompiledDecode, default_mode
from cedlm.model.decisions import Decisions

TOL = 1e-3   # |logit difference| (logits of std ~3): float32 rounding of two summation orders, and
             # the rare FP4/FP8 code it moves to a neighbouring value


@pytest.fixture(scope="module")
def shipped():
    return load_model("cedlm/assets/model")[0].eval()


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
    wa, pa, kva, ia, pena, ta = _state_bytes(a)
    wb, pb, kvb, ib, penb, tb = _state_bytes(b)
    assert torch.equal(pa, pb) and ta == tb
    pairs = [(wa, wb)] + [(kva[s], kvb[s]) for s in kva] + [(ia[s], ib[s]) for s in ia]
    for x, y in pairs:
        assert x.shape == y.shape
        assert (x != y).float().mean().item() <= 0.005
    for s in pena:
        assert pena[s][0].shape == penb[s][0].shape
        assert torch.allclose(pena[s][0], penb[s][0], atol=1e-4)


@torch.no_grad()
def _run(model, mode, prompts, steps, check_states=True):
    """Prefill each prompt, then `steps` decode steps; each compares one step of both paths
    from one state. Returns (steps compared, steps whose decisions differed)."""
    step = CompiledDecode(model, mode)
    states = [model.new_state() for _ in prompts]
    toks = [int(model.prefill(p, st)[-1].argmax()) for p, st in zip(prompts, states)]
    compared = differ = 0
    for _ in range(steps):
        ref_states = copy.deepcopy(states)
        ref, log = _eager_decisions(model, toks, ref_states)
        args = step.inputs(torch.tensor(toks), states)
        logits, out = step.fn(step.shape_for(states), *args)
        step.write_back(torch.tensor(toks), states, out)
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


def test_static_step_matches_reference_across_boundaries(shipped):
    """Batch 1 from a 61-token prompt through 70 steps: the window ring wraps (64 slots), ratio-2
    groups complete every other token, paged-size boundaries of the contiguous rows are crossed."""
    compared, differ = _run(shipped, "static", _prompts(1, [61]), 70)
    assert differ <= 2, f"{differ} of {compared} steps chose differently"


def test_static_step_batched_uneven_lengths(shipped):
    """Three sequences of different lengths (different phases, entry counts, ring fill) at once:
    the contiguous rows of several sequences go through one padded pool."""
    compared, differ = _run(shipped, "static", _prompts(3, [5, 40, 130], seed=1), 12)
    assert differ <= 1


@torch.no_grad()
def test_static_step_paged_rows_match_contiguous(shipped):
    """The engine's paged rows (one pool, block tables) give the same logits as contiguous rows."""
    from cedlm.cache.block_pool import BlockPool, BlockTable
    pool = BlockPool(shipped.kv_layout, 64, 64)
    prompts = _prompts(2, [70, 150], seed=2)
    paged = [shipped.new_state(pool.rows(BlockTable(pool))) for _ in prompts]
    flat = [shipped.new_state() for _ in prompts]
    step = CompiledDecode(shipped, "static")
    toks = []
    for p, a, b in zip(prompts, paged, flat):
        toks.append(int(shipped.prefill(p, a)[-1].argmax()))
        shipped.prefill(p, b)
    for _ in range(6):
        la = step(toks, paged)
        lb = step(toks, flat)
        assert (la - lb).abs().max().item() == 0.0
        toks = la.argmax(-1).tolist()


def test_fallbacks_and_modes(shipped, monkeypatch):
    step = CompiledDecode(shipped, "static")
    assert step.why_not() is None
    rec = Decisions.record(shipped)
    try:
        assert "decisions" in step.why_not()
    finally:
        rec.detach()
    assert CompiledDecode(shipped, "eager").why_not() == "decode_step is eager"
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


@pytest.mark.compiled
def test_compiled_step_matches_reference(shipped):
    """The step through torch.compile (inductor): batch 1, then batch 3 (the graph for >= 2)."""
    compared, differ = _run(shipped, "compiled", _prompts(1, [61]), 8)
    assert differ <= 1
    compared, differ = _run(shipped, "compiled", _prompts(3, [5, 40, 130], seed=1), 5)
    assert differ <= 1


@torch.no_grad()
def test_static_step_incremental_equals_full_forward():
    """Another config (the `tiny` preset: other widths, roles and ratios): prefill one token,
    then every later token through the static step; the logits equal the full causal forward's."""
    from cedlm import CEDModel, ModelConfig
    cfg = ModelConfig.preset("tiny").replace(initializer_range=0.08)
    torch.manual_seed(0)
    tiny = CEDModel(cfg).eval()
    S = 6 * cfg.sliding_window
    ids = torch.randint(0, cfg.vocab_size, (S,), generator=torch.Generator().manual_seed(1))
    full = tiny(ids[None])[0]
    step = CompiledDecode(tiny, "static")
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
