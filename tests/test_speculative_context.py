"""The DSpark drafter's context rows after a prefix-cache hit and after a fork (n > 1): the same
positions as after a full prefill of the same prompt (rebuilt by the replay's pass for a hit,
cloned from the source for a fork), so the drafts, and their acceptance, are the same."""
import pytest
import torch

from cedlm.config import ModelConfig
from cedlm.engine.engine import Engine, EngineConfig
from cedlm.engine.sampling_params import SamplingParams
from cedlm.engine.speculative import DSparkSpeculator, SpeculativeConfig
from cedlm.model import CEDModel
from cedlm.model.dspark import DraftState

PROMPT = [int(x) for x in torch.randint(3, 500, (37,), generator=torch.Generator().manual_seed(7))]


class Recording(DSparkSpeculator):
    """Keeps a copy of every sequence's drafter context at its first proposal."""

    def __init__(self, model, config=None):
        super().__init__(model, config)
        self.first: dict[str, DraftState] = {}

    def propose(self, reqs, runs, tokens_left):
        for r, u in zip(reqs, runs):
            if r.request_id not in self.first:
                self.first[r.request_id] = u.draft.clone() if u.draft is not None else None
        return super().propose(reqs, runs, tokens_left)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.preset("tiny").replace(initializer_range=0.08)
    torch.manual_seed(0)
    return CEDModel(cfg, dspark=True).eval()


def _engine(model, replay_mode="exact", prefill_mode="bounded"):
    e = Engine(model, None, EngineConfig(kv_budget_bytes=4 << 20, max_num_seqs=4, block_tokens=8,
                                         prefill_chunk=16, replay_mode=replay_mode,
                                         prefill_mode=prefill_mode),
               speculative=SpeculativeConfig(policy="always"))
    e.speculator = Recording(model, SpeculativeConfig(policy="always"))
    return e


def _run(e, prompt, params):
    reqs = e.add_samples(prompt, params) if params.num_samples > 1 else [e.add_request(prompt, params)]
    while e.has_work:
        e.step()
    return reqs


def _positions(d: DraftState) -> list[int]:
    return sorted(int(p) for p in d.window_pos[0] if p >= 0)


def _rows(d: DraftState, s: int = 0) -> torch.Tensor:
    k, pos = d.keys(s)
    return k[pos.argsort()][(pos >= 0)[pos.argsort()]]


@pytest.mark.parametrize("replay_mode,prefill_mode", [("exact", "full"), ("bounded", "bounded")])
def test_context_after_a_prefix_hit_equals_a_full_prefill(model, replay_mode, prefill_mode):
    """Exact replay against a full-mode prefill (both run every row exactly): the same rows; the
    bounded modes approximate the first rows each in its own way: the same positions."""
    e = _engine(model, replay_mode, prefill_mode)
    sp = SamplingParams(max_tokens=6, temperature=0)
    full = _run(e, PROMPT, sp)[0]
    hit = _run(e, PROMPT, sp)[0]
    assert full.num_cached_tokens == 0 and hit.num_cached_tokens >= 24
    a, b = e.speculator.first[full.request_id], e.speculator.first[hit.request_id]
    W = model.cfg.sliding_window
    assert _positions(a) == _positions(b) == list(range(len(PROMPT) - W, len(PROMPT)))
    if replay_mode == "exact":                      # exact replay: the same rows (window format)
        assert torch.allclose(_rows(a), _rows(b), atol=0.05, rtol=0.05)
        assert hit.output_ids == full.output_ids    # (bounded: the target's own states differ)


def test_forked_samples_start_from_the_source_context(model):
    e = _engine(model)
    reqs = _run(e, PROMPT, SamplingParams(max_tokens=6, temperature=0.8, n=3, seed=1))
    ctx = [e.speculator.first[r.request_id] for r in reqs]
    assert all(c is not None for c in ctx)
    W = model.cfg.sliding_window
    for c in ctx:
        assert _positions(c) == list(range(len(PROMPT) - W, len(PROMPT)))
        for s in range(len(model.mtp)):
            assert torch.equal(c.window[s], ctx[0].window[s])
