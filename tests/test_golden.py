"""Golden outputs recorded before the architecture move (tests/golden.py) are reproduced.

What is compared. Every case runs with the discrete choices of the recording (the indexers' top-k
entries and the MoE routing, `tests/fixtures/golden_decisions.pt`) replayed, so that the
comparison of logits does not hinge on which way a near-tie falls on this CPU; a separate test
checks that the choices this CPU takes on its own agree with the recording's on nearly every row.

Bounds. On the recording machine the outputs are bit-identical, pinned or not (set
CEDLM_GOLDEN_BITWISE=1 to compare the SHA-256 of every logit; the cases then run on the reference
kernels, since the compiled mHC mixes use the C library's exp and may differ from torch's in the
last bit). On another x86-64 CPU other SIMD kernels round differently, and an FP8/FP4 code or a
UE8M0/E4M3 block scale can land on the other side of a rounding boundary. Measured with the
choices pinned (max |logit difference| / logit std): `small` 1e-4 / 1.8 under
MKL_ENABLE_INSTRUCTIONS=SSE4_2, AVX2 and ATEN_CPU_CAPABILITY=default/avx2; `tiny` (random
weights, 64 wide: one flipped code moves its logits much more) 2.9e-2 / 0.63 under
MKL_ENABLE_INSTRUCTIONS=SSE4_2, 7.5e-3 under ATEN_CPU_CAPABILITY=default, 1e-6 under AVX2. The
bound is a share of the case's logit std: 2 % for `small` (1.6x its worst), 10 % for `tiny`
(2.2x its worst); argmax must agree wherever the recorded top-2 margin exceeds twice the bound.
Unpinned, the SSE4_2 path took another choice on 33 of 756 rows of `tiny/forward` (0 elsewhere).
"""
import os

import pytest
import torch

from tests.devices import DEVICES
from tests.golden import FIXTURE, cases, digest, load_decisions
from cedlm.model.decisions import agreement

REL = {"tiny": 0.10, "small": 0.02}
CHOICES_MAY_DIFFER = 0.10          # share of rows whose unpinned choice may differ from the recording


def _rel(case: str) -> float:
    return REL[case.split("/")[0]]


@pytest.fixture(scope="module")
def golden():
    if not FIXTURE.exists():
        pytest.fail(f"{FIXTURE} is missing: record it with `python -m tests.golden --write`")
    return torch.load(FIXTURE)


@pytest.fixture(scope="module")
def pins():
    return load_decisions()


@pytest.fixture(scope="module", params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(scope="module", params=["fast", "reference"])
def now(request, pins, device):
    """The cases recomputed with the recording's choices, on each test device (CPU always, CUDA
    when present: another machine's rounding, held to the same bounds), with the inference fast
    paths (the default) and with every reference kernel forced; the bitwise mode runs the
    references only, on the CPU."""
    from cedlm.kernels import reference_kernels_forced
    from conftest import portability_rerun_repeats
    bitwise = os.environ.get("CEDLM_GOLDEN_BITWISE") == "1"
    if bitwise and (request.param == "fast" or device != "cpu"):
        pytest.skip("CEDLM_GOLDEN_BITWISE=1 compares the reference kernels' bits on the CPU")
    if portability_rerun_repeats(request.param):
        pytest.skip(portability_rerun_repeats(request.param))
    with reference_kernels_forced(request.param == "reference"):
        return cases(pins=None if bitwise else pins, device=device)


def test_every_case_is_recorded_and_reproduced(golden, now):
    assert set(golden) == set(now)
    bitwise = os.environ.get("CEDLM_GOLDEN_BITWISE") == "1"
    for k, rec in golden.items():
        t = now[k]
        if "ids" in rec:
            assert torch.equal(t, rec["ids"]), k
            continue
        if bitwise:
            assert digest(t) == rec["sha256"], k
        ref = rec["logits"]
        got = t[rec["rows"]]
        tol = _rel(k) * ref.std().item()
        assert (got - ref).abs().max().item() <= tol, (k, (got - ref).abs().max().item(), tol)
        sure = rec["margin"] > 2 * tol          # rows where a rounding flip cannot change argmax
        assert torch.equal(t.argmax(-1)[sure], rec["argmax"][sure]), k


def test_choices_agree_with_the_recording(pins):
    """Unpinned, this CPU's indexers and routers choose as the recording did on nearly every row
    (a changed indexer or router would differ on most of them)."""
    logs: dict = {}
    cases(logs=logs)
    assert set(logs) == set(pins)
    for k in pins:
        differ, total = agreement(logs[k], pins[k])
        assert total > 0 and differ <= CHOICES_MAY_DIFFER * total, (k, differ, total)


def test_golden_comparison_can_fail(golden, now):
    """A perturbation one order of magnitude above the bound is caught."""
    k = "tiny/forward"
    rec = golden[k]
    bad = now[k][rec["rows"]] + 10 * _rel(k) * rec["logits"].std()
    assert (bad - rec["logits"]).abs().max().item() > _rel(k) * rec["logits"].std().item()


def test_a_replayed_choice_is_imposed():
    """A replayed choice replaces the module's own (changing the routing changes the output), the
    same choices reproduce the output exactly, and a replay that runs out of recorded choices or
    does not fit the call raises instead of choosing on its own."""
    from cedlm.model.decisions import Decisions
    from tests.golden import _tiny
    m = _tiny()
    ids = torch.arange(40)[None] % m.cfg.vocab_size
    with torch.no_grad():
        with Decisions.record(m) as rec:
            base = m(ids)
        with Decisions.replay(m, rec.log) as rep:
            assert torch.equal(m(ids), base)
        assert rep.all_replayed()
        gate = next(k for k in rec.log if k.endswith("gate"))
        flipped = {k: list(v) for k, v in rec.log.items()}
        n_exp = m.cfg.n_routed_experts
        flipped[gate] = [(t + 1) % n_exp for t in rec.log[gate]]
        with Decisions.replay(m, flipped):
            assert not torch.allclose(m(ids), base, atol=1e-3)
        with pytest.raises(RuntimeError, match="no recorded choice left"):
            with Decisions.replay(m, {k: v[:0] for k, v in rec.log.items()}):
                m(ids)
        with pytest.raises(RuntimeError, match="does not fit"):
            with Decisions.replay(m, rec.log):
                m(ids[:, :20])
