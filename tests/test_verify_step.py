"""The static DSpark verify step (cedlm/model/dspark_steps.py) against the reference
`rollback.verify` + `rollback.rollback`: from identical states, the same discrete decisions
(indexer top-k as sets per row, MoE experts) and, where they agree, logits and DSpark taps within
float rounding; after `commit` of any kept prefix, the state equals the one the reference leaves
after rolling the rest back (counts, positions, token ids exactly; stored codes but for rare
neighbouring FP4/FP8 values, see test_compiled_step.py; window rows compared decoded: a row whose
largest value sits on a power of two has two FP8 encodings, one scale apart, of the same values),
and the next decoded token agrees.

Like test_compiled_step.py, a comparison never hinges on a near-tie: both paths start from deep
copies of one state, rows whose decisions differ are counted (allowed: rarely) and logits are
compared only where they agree. `static` runs the step's code eagerly (the suite's engines use
it); `compiled` goes through torch.compile (one graph for batch 1 and one for batch >= 2, a few
minutes on this machine the first time, cached on disk after; marked slow, while
`cedlm bench --quick` in test_bench.py runs the compiled step through the engine)."""
from __future__ import annotations

import copy

import pytest
import torch

from cedlm.checkpoint import load_model
from cedlm.config import ModelConfig
from cedlm.model import CEDModel
from cedlm.model.compiled_step import CompiledDecode
from cedlm.model.decisions import Decisions
from cedlm.model.rollback import mark, rollback, verify
from cedlm.model.dspark_steps import VerifyStep
from cedlm.kernels import codecs
from tests.test_compiled_step import TOL, _state_bytes, assert_same_entries

T = 6                                        # anchor + the shipped drafter's 5 drafts


@pytest.fixture(scope="module")
def shipped():
    return load_model("cedlm/assets/model")[0].eval()


def _agree(log, out, B, t) -> bool:
    """The step's decisions (out) for the first t rows of each sequence equal the reference's."""
    for name, entries in log.items():
        (rec,) = entries
        layer = int(name.split(".")[1])
        if name.endswith("indexer"):
            idx, ok = rec[0], rec[1].bool()                            # [B, t, k]
            sidx, sok = out["topk"][layer]
            for b in range(B):
                for j in range(t):
                    if set(idx[b, j][ok[b, j]].tolist()) != set(sidx[b, j][sok[b, j]].tolist()):
                        return False
        else:                                                          # [B * t, k] rows
            mine = out["experts"][layer].view(B, T, -1)[:, :t].reshape(B * t, -1)
            if not torch.equal(rec.sort(-1).values, mine.sort(-1).values):
                return False
    return True


def _assert_same_state(model, a, b):
    """Positions, tokens, entry counts equal; window rows equal decoded (within a rounding step
    of their largest value); entry codes equal but for <= 0.5 %; pending rows within 1e-4."""
    wa, pa, _, _, _, ta = _state_bytes(a)
    wb, pb, _, _, _, tb = _state_bytes(b)
    assert torch.equal(pa, pb) and ta == tb
    lay = model.kv_layout
    da, db = (codecs.decode(w, lay.window_fmt, lay.window_dim) for w in (wa, wb))
    step = da.abs().amax(-1, keepdim=True) / 8                  # FP8 E4M3: 3 mantissa bits
    assert ((da - db).abs() <= step).all()
    assert ((da - db).abs() > 0).float().mean().item() <= 0.005
    assert_same_entries(a, b)


@torch.no_grad()
def _compare(model, step, prompts, blocks, keeps):
    """Prefill the prompts, verify blocks [B, t] both ways from one state, keep keeps[b] tokens;
    returns whether the decisions agreed (then everything else was checked)."""
    B, t = blocks.shape
    states = [model.new_state() for _ in prompts]
    for p, st in zip(prompts, states):
        model.prefill(p, st)
    ref = copy.deepcopy(states)
    marks = [mark(s, t) for s in ref]
    rec = Decisions.record(model)
    try:
        ref_logits, cap = verify(model, blocks, ref, taps=True)
    finally:
        rec.detach()
    logits, taps, out = step(blocks, states)
    assert logits.shape[:2] == (B, step.T) and taps.shape[:2] == (B, step.T)
    agree = _agree(rec.log, out, B, t)
    if agree:
        assert (logits[:, :t] - ref_logits).abs().max().item() < TOL
        assert (taps[:, :t] - cap.taps).abs().max().item() < TOL
    for b in range(B):
        rollback(model, ref[b], marks[b], keeps[b], cap, b)
    step.commit(blocks, states, out, keeps)
    if agree:
        for a, r in zip(states, ref):
            _assert_same_state(model, a, r)
        nxt = [5] * B
        la = step.decoder(nxt, states)
        lr = model.decode(nxt, ref)
        assert (la - lr).abs().max().item() < 10 * TOL
    return agree


@pytest.mark.parametrize("lengths", [(40,), (130,), (37, 64), (5, 200)])
def test_static_verify_matches_rollback(shipped, lengths):
    """Batch 1 and 2, contexts inside and past the 64-token window, both compression phases
    (ratio-2 sources: odd and even lengths), every kept length."""
    step = VerifyStep(CompiledDecode(shipped, "static"), T)
    g = torch.Generator().manual_seed(sum(lengths))
    prompts = [torch.randint(3, 4096, (n,), generator=g) for n in lengths]
    agreed = 0
    for keep in range(1, T + 1):
        blocks = torch.randint(3, 4096, (len(lengths), T), generator=g)
        keeps = [keep] + [T + 1 - keep] * (len(lengths) - 1)
        agreed += _compare(shipped, step, prompts, blocks, keeps)
    assert agreed >= T - 1, f"decisions differed in {T - agreed} of {T} blocks"


def test_short_blocks_are_padded(shipped):
    """A block shorter than the step's T (the drafts capped by max_tokens) runs the same graph,
    padded; its rows are the same as the reference's over the short block."""
    step = VerifyStep(CompiledDecode(shipped, "static"), T)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 4096, (50,), generator=g)]
    assert _compare(shipped, step, prompts, torch.randint(3, 4096, (1, 3), generator=g), [2])


def test_tiny_engram_and_every_ratio():
    """The tiny preset (ratio-1 and ratio-2 sources, Engram, a window of 8 that the block wraps):
    every kept length after contexts that cross the window several times."""
    cfg = ModelConfig.preset("tiny").replace(initializer_range=0.08)
    torch.manual_seed(0)
    m = CEDModel(cfg).eval()
    step = VerifyStep(CompiledDecode(m, "static"), T)
    g = torch.Generator().manual_seed(1)
    for n in (5, 20, 37, 150):
        prompt = torch.randint(3, cfg.vocab_size, (n,), generator=g)
        block = torch.randint(3, cfg.vocab_size, (1, T), generator=g)
        for keep in (1, 3, T):
            ref = m.new_state()
            m.prefill(prompt, ref)
            mk = mark(ref, T)
            ref_logits, cap = verify(m, block, [ref], taps=True)
            rollback(m, ref, mk, keep, cap, 0)
            st = m.new_state()
            m.prefill(prompt, st)
            logits, taps, out = step(block, [st])
            step.commit(block, [st], out, [keep])
            assert (logits - ref_logits).abs().max().item() < TOL
            assert (taps - cap.taps).abs().max().item() < TOL
            assert st.num_tokens == ref.num_tokens and st.token_ids == ref.token_ids
            for s in st.kv:
                assert st.kv[s].n == ref.kv[s].n and st.index.get(s, st.kv[s]).n == ref.index.get(s, ref.kv[s]).n
            assert torch.equal(st.window_pos_all, ref.window_pos_all)
            for s in st.pending:
                assert st.pending[s][0].shape == ref.pending[s][0].shape
                assert torch.allclose(st.pending[s][0], ref.pending[s][0], atol=1e-5)
            assert (m.decode([5], [st]) - m.decode([5], [ref])).abs().max().item() < TOL


def test_bad_calls_say_what():
    cfg = ModelConfig.preset("tiny")
    m = CEDModel(cfg).eval()
    with pytest.raises(ValueError, match="sliding_window"):
        VerifyStep(CompiledDecode(m, "static"), cfg.sliding_window + 1)
    step = VerifyStep(CompiledDecode(m, "static"), 3)
    st = m.new_state()
    m.prefill(torch.arange(3, 9), st)
    with pytest.raises(ValueError, match="expected 1..3"):
        step(torch.zeros(1, 4, dtype=torch.int64), [st])
    with pytest.raises(ValueError, match="2 rows for 1 states"):
        step(torch.zeros(2, 3, dtype=torch.int64), [st])
    _, _, out = step(torch.zeros(1, 3, dtype=torch.int64), [st])
    with pytest.raises(ValueError, match="keep 4"):
        step.commit([[1, 2, 3]], [st], out, [4])
    assert st.num_tokens == 6                                         # nothing written


def test_eager_mode_keeps_the_reference(shipped):
    """decode_step "eager" (CEDLM_REFERENCE_KERNELS=1 too): the speculator's verify step runs the
    reference (`rollback.verify`, every row appended, `commit` rolling back the rejected ones);
    "static": the static step. Both leave the same state and the same logits."""
    from cedlm.engine.speculative import DSparkSpeculator
    ref = DSparkSpeculator(shipped, decoder=CompiledDecode(shipped, "eager")).step
    assert not ref.usable
    assert DSparkSpeculator(shipped, decoder=CompiledDecode(shipped, "static")).step.usable
    static = VerifyStep(CompiledDecode(shipped, "static"), T)
    a = shipped.new_state()
    shipped.prefill(torch.arange(3, 80) % 4000, a)
    b = copy.deepcopy(a)
    ids = torch.tensor([[17, 250, 31, 9]])
    la, _, out_a = ref(ids, [a])
    lb, _, out_b = static(ids, [b])
    assert (la[:, :4] - lb[:, :4]).abs().max() <= TOL
    ref.commit(ids, [a], out_a, [2])
    static.commit(ids, [b], out_b, [2])
    assert a.num_tokens == b.num_tokens == 79 and a.token_ids == b.token_ids
    _assert_same_state(shipped, a, b)


@pytest.mark.slow            # cold: two graphs, about 15 minutes on this 2-core machine
@pytest.mark.parametrize("lengths", [(70,), (37, 64)])
def test_compiled_verify_matches_rollback(shipped, lengths):
    """The step through torch.compile (inductor; a graph for batch 1 and one for batch >= 2)."""
    step = VerifyStep(CompiledDecode(shipped, "compiled"), T)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 4096, (n,), generator=g) for n in lengths]
    agreed = 0
    for keep in (1, 4, T):
        blocks = torch.randint(3, 4096, (len(lengths), T), generator=g)
        agreed += _compare(shipped, step, prompts, blocks, [keep] * len(lengths))
    assert step.compile and step.compile_s, "fell back to the uncompiled step"
    assert agreed >= 2
