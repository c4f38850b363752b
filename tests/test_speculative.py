"""DSpark speculative decoding in the engine (cedlm/engine/speculative.py): the accept rules,
distribution preservation with sampling, greedy identity with continuous batching, options; the
policy's plain and speculative steps interleaved (greedy identity, the drafter's context)."""
import pytest
import torch

from cedlm.config import ModelConfig
from cedlm.engine.engine import Engine, EngineConfig
from cedlm.engine.sampling_params import SamplingParams
from cedlm.engine.spec_policy import Decision, SpecPolicy
from cedlm.engine.speculative import (DSparkSpeculator, SpeculativeConfig, accept_greedy,
                                      accept_sampled)
from cedlm.model import CEDModel
from tests.devices import DEVICES


def test_accept_greedy():
    assert accept_greedy([], [7]) == [7]
    assert accept_greedy([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert accept_greedy([1, 5, 3], [1, 2, 3, 4]) == [1, 2]
    assert accept_greedy([9, 2], [1, 2, 3]) == [1]


# ---------------------------------------------------------------- distribution preservation
V = 4
P_TAB = torch.tensor([[.50, .20, .20, .10], [.05, .05, .60, .30], [.25, .25, .25, .25], [.70, .10, .10, .10]])
Q_TAB = torch.tensor([[.10, .60, .10, .20], [.40, .40, .10, .10], [.10, .10, .10, .70], [.25, .25, .25, .25]])


def _speculative_pair(gen, accept, k=2):
    """The first two tokens after anchor 0 of a Markov 'target' P_TAB, drafted by Q_TAB."""
    out, anchor = [], 0
    while len(out) < 2:
        drafts, q, prev = [], [], anchor
        for _ in range(k):
            d = int(torch.multinomial(Q_TAB[prev], 1, generator=gen))
            drafts.append(d), q.append(Q_TAB[prev])
            prev = d
        p = torch.stack([P_TAB[t] for t in [anchor] + drafts])
        toks = accept(drafts, torch.stack(q), p, gen)
        out += toks
        anchor = toks[-1]
    return out[0], out[1]


def _chi2(accept, n=6000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(n):
        a, b = _speculative_pair(gen, accept)
        counts[a, b] += 1
    expect = n * P_TAB[0][:, None] * P_TAB                          # exact joint of (x1, x2)
    return float(((counts - expect) ** 2 / expect).sum())


def test_rejection_sampling_preserves_the_target_distribution():
    # 15 degrees of freedom: the 99.9th percentile of chi2(15) is 37.7.
    assert _chi2(accept_sampled) < 37.7


def test_the_statistical_test_can_fail():
    def keep_all(drafts, q, p, gen):                                # accept every draft: wrong
        return drafts + [int(torch.multinomial(p[len(drafts)], 1, generator=gen))]
    assert _chi2(keep_all, n=2000) > 100


# ---------------------------------------------------------------- engine
@pytest.fixture(scope="module", params=DEVICES)
def tiny(request):
    """The tiny model with a drafter, on each test device (CPU always, CUDA when present)."""
    cfg = ModelConfig.preset("tiny").replace(initializer_range=0.08)
    torch.manual_seed(0)
    return CEDModel(cfg, dspark=True).eval().to(request.param)


def _engine(model, spec=None, max_num_seqs=4):
    return Engine(model, None, EngineConfig(kv_budget_bytes=4 << 20, max_num_seqs=max_num_seqs,
                                            block_tokens=8, prefill_chunk=16), speculative=spec)


def _generate(e, prompts, params):
    reqs = [e.add_request(p, params) for p in prompts]
    while e.has_work:
        e.step()
    return [r.output_ids for r in reqs]


ALWAYS = SpeculativeConfig(policy="always")      # a verified draft block every step


class OracleDrafts(DSparkSpeculator):
    """Drafts from a reference greedy run, wrong wherever (position * salt) % 7 < 2: every
    accepted length from 0 to the block occurs, differently per sequence (every step speculates
    unless a config says otherwise)."""

    def __init__(self, model, ref, config=None):
        super().__init__(model, config or ALWAYS)
        self.ref = ref

    def draft(self, reqs, runs, anchors, P):
        N, Vv = self.model.cfg.dspark_block_size, self.model.cfg.vocab_size
        dev = next(self.model.parameters()).device
        toks = torch.zeros(len(reqs), N, dtype=torch.int64, device=dev)
        for b, r in enumerate(reqs):
            ref, n = self.ref[tuple(r.prompt_ids)], len(r.output_ids)
            for i in range(N):
                t = ref[n + i] if n + i < len(ref) else 0
                salt = 3 + len(r.prompt_ids) % 5
                toks[b, i] = (t + 1) % Vv if ((n + i) * salt) % 7 < 2 else t
        conf = torch.full((len(reqs), N), 0.8, device=dev)
        return toks, torch.zeros(len(reqs), N, Vv, device=dev), conf


PROMPT_LENS = (3, 26, 40)


def _prompts(cfg):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _assert_greedy_identical(model, prompts, ref, out, tol=0.1):
    """Identical, except where plain decoding itself is not canonical: the verification forward
    runs other GEMM shapes and MoE groupings than a one-token step, and on this random tiny model
    a value can then land on the other side of an FP8/FP4 rounding boundary and move a logit by a
    few hundredths. So a sequence may part from the reference only where a full forward over the
    reference prefix puts the two tokens within `tol` x (logit std) of each other; everything
    before must be equal, and most sequences equal throughout."""
    same = 0
    for p, a, b in zip(prompts, ref, out):
        if a == b:
            same += 1
            continue
        d = next(i for i in range(min(len(a), len(b))) if a[i] != b[i])
        st = model.new_state()
        logits = model.prefill(p + a[:d], st, "full")[-1]
        gap = abs(float(logits[a[d]] - logits[b[d]]))
        assert gap < tol * float(logits.std()), f"diverged at {d} with a logit gap of {gap:.4g}"
    assert same >= len(prompts) - 1


def test_greedy_identity_with_accepted_drafts_across_windows(tiny):
    """64 tokens (8 windows of 8, 32 compressor groups) for 3 sequences decoding together with
    different accepted lengths: the output equals plain greedy decoding."""
    prompts = _prompts(tiny.cfg)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    ref = _generate(_engine(tiny), prompts, params)
    e = _engine(tiny, SpeculativeConfig())
    e.speculator = OracleDrafts(tiny, {tuple(p): o for p, o in zip(prompts, ref)})
    out = _generate(e, prompts, params)
    _assert_greedy_identical(tiny, prompts, ref, out)
    s = e.all_counters()
    assert s["spec_accepted_tokens"] > 0.25 * s["spec_verified_tokens"]         # drafts really kept
    assert 0 < s["spec_acceptance_by_position"][-1] < 1
    assert s["generation_tokens"] == 3 * 64
    assert e.pool.num_used == 0                                                 # every block back
    # the scheduled verification (confidence 0.8, threshold 0.6: two drafts) is identical too
    e2 = _engine(tiny, SpeculativeConfig(threshold=0.6))
    e2.speculator = OracleDrafts(tiny, e.speculator.ref, SpeculativeConfig(threshold=0.6, policy="always"))
    _assert_greedy_identical(tiny, prompts, ref, _generate(e2, prompts, params))
    assert e2.speculator.stats.verified_at[2] == 0 and e2.speculator.stats.verified_at[1] > 0


def test_greedy_identity_batch_one_exact(tiny):
    """One sequence, 64 tokens: measured exactly identical on this CPU."""
    prompts = _prompts(tiny.cfg)[:1]
    params = SamplingParams(temperature=0.0, max_tokens=64)
    ref = _generate(_engine(tiny, max_num_seqs=1), prompts, params)
    e = _engine(tiny, SpeculativeConfig(), max_num_seqs=1)
    e.speculator = OracleDrafts(tiny, {tuple(prompts[0]): ref[0]})
    _assert_greedy_identical(tiny, prompts, ref, _generate(e, prompts, params))


def test_greedy_identity_with_the_drafter(tiny):
    prompts = _prompts(tiny.cfg)[:2]
    params = SamplingParams(temperature=0.0, max_tokens=30)
    _assert_greedy_identical(tiny, prompts, _generate(_engine(tiny), prompts, params),
                             _generate(_engine(tiny, ALWAYS), prompts, params))


def test_sampled_speculative_decoding_runs(tiny):
    prompts = _prompts(tiny.cfg)[:2]
    e = _engine(tiny, ALWAYS)
    out = _generate(e, prompts, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=1))
    assert [len(o) for o in out] == [20, 20] and e.speculator.stats.steps > 0
    again = _generate(_engine(tiny, ALWAYS), prompts,
                      SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=1))
    assert again == out                                                        # seeded: reproducible


def test_stop_inside_an_accepted_block(tiny):
    prompts = _prompts(tiny.cfg)[:1]
    ref = _generate(_engine(tiny), prompts, SamplingParams(temperature=0.0, max_tokens=40))[0]
    stop_tok = ref[17]
    params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_tok])
    plain = _generate(_engine(tiny), prompts, params)
    e = _engine(tiny, SpeculativeConfig())
    e.speculator = OracleDrafts(tiny, {tuple(prompts[0]): ref})
    _assert_greedy_identical(tiny, prompts, plain, _generate(e, prompts, params))


@pytest.mark.parametrize("kw,msg", [
    ({"method": "medusa"}, "speculative: unknown method"),
    ({"threshold": 1.5}, "speculative_threshold"),
    ({"num_draft_tokens": 0}, "num_draft_tokens"),
    ({"policy": "sometimes"}, "speculative_policy"),
])
def test_bad_options_name_the_option(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SpeculativeConfig(**kw)


def test_model_without_drafter_is_a_clear_error():
    cfg = ModelConfig.preset("tiny")
    with pytest.raises(ValueError, match="speculative: this model has no DSpark drafter"):
        _engine(CEDModel(cfg), SpeculativeConfig())


# ---------------------------------------------------------------- when to speculate (spec_policy.py)
class Scripted(SpecPolicy):
    """Speculates or not by a fixed pattern: switches between kinds mid-sequence, every few steps."""

    def __init__(self, pattern):
        super().__init__()
        self.pattern, self.i = pattern, 0

    def _decide(self, n_spec, n_other, acceptance):
        self.i += 1
        return Decision(self.pattern[(self.i - 1) % len(self.pattern)], "explore")


SWITCHING = [True, False, False, True, True, False, True, False, False, False, True, True, True]


class CheckedContext:
    """At every proposal, each sequence's drafter context holds, of the window before its next
    position, exactly the positions its prefill and its verifications kept: none of a plain
    step's, and every one a verification wrote (the rows the drafter's blocks see)."""

    def check_context(self, reqs, runs):
        W = self.model.cfg.sliding_window
        for r, u in zip(reqs, runs):
            P = u.state.num_tokens
            have = {int(p) for p in u.draft.window_pos[0].tolist() if P - W <= p < P} if u.draft else set()
            if r.request_id not in self.written:          # after the prefill: its rows
                self.written[r.request_id] = set(have)
            assert have == {p for p in self.written[r.request_id] if P - W <= p < P}, r.request_id
            self.checked += 1

    def propose(self, reqs, runs, tokens_left):
        self.check_context(reqs, runs)
        return super().propose(reqs, runs, tokens_left)

    def verify(self, prop, reqs, runs):
        out = super().verify(prop, reqs, runs)
        for b, r in enumerate(reqs):
            p0 = int(prop.positions[b])
            self.written[r.request_id].update(range(p0, p0 + len(out[b])))
        return out


class CheckedOracle(CheckedContext, OracleDrafts):
    def __init__(self, model, ref, decoder=None):
        DSparkSpeculator.__init__(self, model, SpeculativeConfig(), decoder)
        self.ref, self.written, self.checked = ref, {}, 0


class CheckedDrafter(CheckedContext, DSparkSpeculator):
    def __init__(self, model, decoder=None):
        super().__init__(model, SpeculativeConfig(), decoder)
        self.written, self.checked = {}, 0


@pytest.mark.parametrize("drafts", ["oracle", "drafter"])
def test_greedy_identity_when_the_policy_switches_mid_sequence(tiny, drafts):
    """Plain and speculative steps interleaved in every sequence (3 decoding together, the static
    verify step): the output equals plain greedy decoding, and the drafter's context never holds a
    row a plain step would have had to write."""
    prompts = _prompts(tiny.cfg)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    ref = _generate(_engine(tiny), prompts, params)
    e = _engine(tiny, SpeculativeConfig())
    e.speculator = (CheckedOracle(tiny, {tuple(p): o for p, o in zip(prompts, ref)}, e.decoder)
                    if drafts == "oracle" else CheckedDrafter(tiny, e.decoder))
    e.speculator.policy = Scripted(SWITCHING)
    out = _generate(e, prompts, params)
    _assert_greedy_identical(tiny, prompts, ref, out)
    c = e.all_counters()
    assert c["spec_speculative_steps"] > 5 and c["spec_plain_steps"] > 5
    assert c["spec_speculative_steps"] + c["spec_plain_steps"] == e.speculator.policy.i
    assert e.speculator.checked >= c["spec_speculative_steps"]
    if drafts == "oracle":
        assert c["spec_accepted_tokens"] > 0.25 * c["spec_verified_tokens"]
    assert e.pool.num_used == 0


def test_greedy_identity_with_the_adaptive_policy(tiny):
    """The default policy on its own measurements (whatever it decides on this machine): the
    same output as plain decoding; it measured both kinds of step."""
    prompts = _prompts(tiny.cfg)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    ref = _generate(_engine(tiny), prompts, params)
    e = _engine(tiny, SpeculativeConfig())
    e.speculator = CheckedDrafter(tiny, e.decoder)
    _assert_greedy_identical(tiny, prompts, ref, _generate(e, prompts, params))
    pol, c = e.speculator.policy, e.all_counters()
    assert pol.mode == "adaptive" and c["spec_policy"] == "adaptive"
    assert c["spec_speculative_steps"] >= pol.config.min_samples and c["spec_plain_steps"] >= 1
    assert pol.acceptance is not None and pol.cost("plain", 3) and pol.cost("spec", 3)
    # a second engine on the same model and decode step starts from these measurements
    e2 = _engine(tiny, SpeculativeConfig())
    e2.speculator = CheckedDrafter(tiny, e2.decoder)
    assert e2.speculator.policy.measured is pol.measured and e2.speculator.policy.speculative_steps == 0


def test_adaptive_falls_back_to_plain_steps_where_drafting_does_not_pay(tiny):
    """Given costs where a verification costs 4 plain steps, the engine decodes plainly, bar the
    bounded exploration; output identical."""
    prompts = _prompts(tiny.cfg)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    ref = _generate(_engine(tiny), prompts, params)
    e = _engine(tiny, SpeculativeConfig())
    pol = e.speculator.policy = SpecPolicy()            # measured nothing but what is given here
    for n in (1, 2, 3):
        for _ in range(pol.config.min_samples):
            pol.observe("plain", n, 0.010)
            pol.observe("spec", n, 0.040)
    pol.observe_acceptance([2.0] * pol.config.min_verifies)
    pol.observe = lambda kind, n, seconds: None         # the given costs stay
    _assert_greedy_identical(tiny, prompts, ref, _generate(e, prompts, params))
    c = e.all_counters()
    assert c["spec_plain_steps"] >= 40 and c["spec_speculative_steps"] == 0


def test_sampled_decoding_when_the_policy_switches(tiny):
    prompts = _prompts(tiny.cfg)[:2]
    e = _engine(tiny, SpeculativeConfig())
    e.speculator.policy = Scripted(SWITCHING)
    out = _generate(e, prompts, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24))
    assert [len(o) for o in out] == [24, 24]
    assert e.speculator.stats.steps > 0 and e.speculator.policy.plain_steps > 0


def test_which_requests_speculate(tiny):
    """Plain sampling speculates; logprobs do not; a seeded sampled request only under "always"
    (under the adaptive policy its tokens would depend on the batch and the machine's timing)."""
    adaptive = _engine(tiny, SpeculativeConfig()).speculator
    always = _engine(tiny, ALWAYS).speculator
    greedy, seeded = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3)
    assert adaptive.speculates(greedy) and always.speculates(greedy)
    assert adaptive.speculates(SamplingParams(temperature=0.8))
    assert not adaptive.speculates(seeded) and always.speculates(seeded)
    assert not adaptive.speculates(SamplingParams(temperature=0.0, logprobs=2))
