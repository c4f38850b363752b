"""The static DSpark draft step (cedlm/model/dspark.py's draft_step, wrapped by dspark_steps.DraftStep) against the reference
`dspark.draft_block`: from the same draft states, the same experts and, with them equal, the same
hidden rows and base logits within float rounding.

As in test_verify_step.py a comparison never hinges on a near-tie: the reference's router choices
are recorded (`Decisions`), a block whose experts differ is counted (allowed: rarely) and its
values are not compared. `static` runs the step's code eagerly; `compiled` goes through
torch.compile (a graph for batch 1 and one for batch >= 2, about half a minute each cold)."""
from __future__ import annotations

import pytest
import torch

from cedlm.checkpoint import load_model
from cedlm.config import ModelConfig
from cedlm.model import CEDModel, dspark
from cedlm.model.compiled_step import CompiledDecode
from cedlm.model.decisions import Decisions
from cedlm.model.dspark_steps import DraftStep

TOL = 1e-3            # relative to the largest value compared (float32 sums in another order)


@pytest.fixture(scope="module")
def shipped():
    return load_model("cedlm/assets/model")[0].eval()


def _state(model, n: int, p0: int, g) -> dspark.DraftState:
    """A draft state whose context rows are those of positions p0 .. p0 + n - 1 (random taps);
    n past the window wraps its ring."""
    st = dspark.DraftState(model.kv_layout, len(model.mtp))
    if n:
        taps = torch.randn(1, n, model.mtp[0].main_proj.in_features, generator=g)
        pos = torch.arange(p0, p0 + n)
        with torch.no_grad():
            rows = dspark.context_rows(model.mtp, taps, pos.view(1, -1))
        st.write([r[0] for r in rows], pos)
    return st


def _compare(model, step, states, anchors, P) -> bool:
    """The step and `draft_block` on the same states; returns whether the experts agreed (then
    h and the base logits were compared)."""
    rec = Decisions.record(model)
    try:
        ref_h, ref_base = dspark.draft_block(model, states, anchors, P)
    finally:
        rec.detach()
    h, base, experts = step(states, anchors, P, with_experts=True)
    assert h.shape == ref_h.shape and base.shape == ref_base.shape
    for s in range(len(model.mtp)):
        (want,) = rec.log[f"mtp.{s}.ffn.gate"]
        if not torch.equal(want.sort(-1).values, experts[s].sort(-1).values):
            return False
    assert (h - ref_h).abs().max().item() <= TOL * ref_h.abs().max().item()
    assert (base - ref_base).abs().max().item() <= TOL * ref_base.abs().max().item()
    return True


# (context rows per sequence, their first position, the block's position P)
CASES = [[(64, 448, 512)],                    # a full ring, the block right after it
         [(0, 0, 0)],                         # no context yet (the first block of a request)
         [(30, 0, 30), (150, 850, 1000)],     # a partial ring; one wrapped, the block past it
         [(10, 0, 10), (64, 0, 64), (100, 0, 90)]]   # some rows of the ring after P: unseen


@pytest.mark.parametrize("case", CASES)
def test_static_draft_matches_draft_block(shipped, case):
    step = DraftStep(CompiledDecode(shipped, "static"))
    g = torch.Generator().manual_seed(len(case))
    agreed = 0
    for anchor in (17, 99, 4000):
        states = [_state(shipped, n, p0, g) for n, p0, _ in case]
        anchors = torch.full((len(case),), anchor)
        agreed += _compare(shipped, step, states, anchors, torch.tensor([P for _, _, P in case]))
    assert agreed >= 2, f"experts differed in {3 - agreed} of 3 blocks"


def test_tiny_several_stages():
    """The tiny preset with 3 draft stages and a window of 8 wrapped many times."""
    cfg = ModelConfig.preset("tiny").replace(initializer_range=0.08, num_nextn_predict_layers=3)
    torch.manual_seed(0)
    m = CEDModel(cfg, dspark=True).eval()
    step = DraftStep(CompiledDecode(m, "static"))
    g = torch.Generator().manual_seed(2)
    agreed = 0
    for n, P in ((3, 3), (40, 40), (41, 45)):
        states = [_state(m, n, 0, g), _state(m, 5, 0, g)]
        agreed += _compare(m, step, states, torch.tensor([5, 9]), torch.tensor([P, 5]))
    assert agreed >= 2


def test_bad_calls_and_modes():
    cfg = ModelConfig.preset("tiny")
    with pytest.raises(ValueError, match="no DSpark drafter"):
        DraftStep(CompiledDecode(CEDModel(cfg).eval(), "static"))
    m = CEDModel(cfg, dspark=True).eval()
    step = DraftStep(CompiledDecode(m, "static"))
    st = dspark.DraftState(m.kv_layout, len(m.mtp))
    with pytest.raises(ValueError, match=r"must both be \[1\]"):
        step([st], torch.tensor([1, 2]), torch.tensor([0]))
    assert not DraftStep(CompiledDecode(m, "eager")).usable
    from cedlm.engine.speculative import DSparkSpeculator
    assert DSparkSpeculator(m, decoder=CompiledDecode(m, "static")).drafter.usable
    assert not DSparkSpeculator(m, decoder=CompiledDecode(m, "eager")).drafter.usable


@pytest.mark.slow            # cold: two graphs, about a minute on this 2-core machine
def test_compiled_draft_matches_draft_block(shipped):
    """The step through torch.compile (inductor; a graph for batch 1 and one for batch >= 2)."""
    step = DraftStep(CompiledDecode(shipped, "compiled"))
    g = torch.Generator().manual_seed(5)
    agreed = 0
    for case in CASES:
        states = [_state(shipped, n, p0, g) for n, p0, _ in case]
        agreed += _compare(shipped, step, states, torch.full((len(case),), 99),
                           torch.tensor([P for _, _, P in case]))
    assert step.compile, "the step fell back to running uncompiled"
    assert agreed >= len(CASES) - 1
