"""When to speculate (cedlm/engine/spec_policy.py): the decision from measured step costs and
acceptance, without a model; simulated runs for exploration and for a change of costs."""
import pytest

from cedlm.engine.spec_policy import Acceptance, PolicyConfig, SpecPolicy, StepCost, bucket


def primed(costs: dict, acceptance: float, **cfg) -> SpecPolicy:
    """A policy that has measured {(kind, n): seconds} min_samples times, and this acceptance."""
    p = SpecPolicy(PolicyConfig(**cfg))
    for (kind, n), s in costs.items():
        for _ in range(p.config.min_samples):
            p.observe(kind, n, s)
    p.observe_acceptance([acceptance] * p.config.min_verifies)
    return p


def run(p: SpecPolicy, steps: int, n: int, spec_s, plain_s, accept, n_other: int = 0):
    """Drive the policy like the engine: decide, 'run' the step (its cost observed), and the
    acceptance of a speculative step. spec_s / plain_s / accept: a value or a function of the
    step's index. Returns the decisions and the seconds spent."""
    val = (lambda f, i: f(i) if callable(f) else f)
    out, spent = [], 0.0
    for i in range(steps):
        s = p.decide(n, n_other)
        if s:
            p.observe("spec", n, val(spec_s, i))
            if n_other:
                p.observe("plain", n_other, val(plain_s, i))
            p.observe_acceptance([val(accept, i)] * n)
            spent += val(spec_s, i) + (val(plain_s, i) if n_other else 0)
        else:
            p.observe("plain", n + n_other, val(plain_s, i))
            spent += val(plain_s, i)
        out.append(s)
    return out, spent


def test_bucket():
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 4, 4, 8, 8, 16, 16, 32]


def test_what_is_not_measured_is_measured_first():
    """Speculative steps first (the drafter's context is whole after a prefill) until their cost
    and the acceptance are known, then plain steps until theirs is; then the cheaper one."""
    p = SpecPolicy()
    got, _ = run(p, 6, 8, spec_s=0.030, plain_s=0.010, accept=2.0)
    assert got == [True, True, False, False, False, False]
    assert [p.last.reason] == ["exploit"] and p.exploration_steps == 4
    assert p.gain(8) == pytest.approx((8 * 2.0 / 0.030) / (8 / 0.010))


@pytest.mark.parametrize("plain,spec,a,want", [
    (0.010, 0.025, 2.0, False),      # a verify of 2.5 plain steps for 2 tokens: slower
    (0.010, 0.015, 2.0, True),       # 1.5 plain steps for 2 tokens: faster
    (0.010, 0.030, 3.5, True),       # expensive, but drafts accepted often enough
    (0.010, 0.0195, 2.0, False),     # 2.6% faster: inside the margin, not worth switching
    (0.010, 0.0190, 2.0, True),      # 5%
])
def test_decision_from_costs_and_acceptance(plain, spec, a, want):
    p = primed({("plain", 8): plain, ("spec", 8): spec}, a)
    assert p.gain(8) == pytest.approx(a * plain / spec)
    assert p.decide(8) is want and p.last.reason == "exploit"


def test_batch_size_is_its_own_measurement():
    """Cheap to verify at batch 1, not at batch 8 (the CPU's case): one policy, two answers."""
    p = primed({("plain", 1): 0.010, ("spec", 1): 0.015, ("plain", 8): 0.020, ("spec", 8): 0.050}, 2.0)
    assert p.decide(1) is True
    assert p.decide(8) is False
    assert p.decide(7) is False                       # bucket 8
    assert p.cost_ratios() == {1: pytest.approx(1.5), 8: pytest.approx(2.5)}


def test_sequences_that_cannot_speculate_cost_an_extra_forward():
    """2 sequences may speculate, 3 may not (logprobs): speculating runs a plain step for the 3
    besides the verification; plain decoding runs one step for all 5."""
    p = primed({("plain", 5): 0.020, ("plain", 3): 0.015, ("spec", 2): 0.014, ("plain", 2): 0.010}, 2.0)
    want = ((3 + 2 * 2.0) / (0.014 + 0.015)) / (5 / 0.020)
    assert p.gain(2, 3) == pytest.approx(want) and want < 1
    assert p.decide(2, 3) is False
    assert p.decide(2) is True                        # alone, the same two speculate


def test_hysteresis_keeps_the_current_choice_near_break_even():
    p = primed({("plain", 8): 0.010, ("spec", 8): 0.015}, 2.0)
    p.measured.ratios.clear()                         # the costs as set below
    assert p.decide(8) is True
    p.costs[("spec", 8)].value = 0.0198               # gain 1.01: within the margin
    assert p.decide(8) is True
    p.costs[("spec", 8)].value = 0.0210               # gain 0.95: past it
    assert p.decide(8) is False
    p.costs[("spec", 8)].value = 0.0198               # back to 1.01: stays plain
    assert p.decide(8) is False


def test_exploration_is_bounded_and_refreshes_the_estimates():
    """Speculation loses (2.2 plain steps for 2 tokens): it is still tried now and then, in bursts,
    at a cost bounded by `explore` of the decode time."""
    p = primed({("plain", 8): 0.010, ("spec", 8): 0.022}, 2.0)
    got, spent = run(p, 3000, 8, spec_s=0.022, plain_s=0.010, accept=2.0)
    spec_steps = sum(got)
    assert spec_steps >= 2 * p.config.burst            # probed more than once
    runs_of_spec = [len(r) for r in "".join("s" if g else "." for g in got).split(".") if r]
    assert set(runs_of_spec) == {p.config.burst}       # in bursts
    tokens = 8 * (2.0 * spec_steps + (len(got) - spec_steps))
    plain_only = tokens / 8 * 0.010                    # the time plain decoding takes for them
    assert spent / plain_only - 1 <= 1.2 * p.config.explore
    assert p.exploration_steps == spec_steps


def test_probes_are_frequent_near_break_even_and_rare_far_from_it():
    near = primed({("plain", 8): 0.010, ("spec", 8): 0.0205}, 2.0)
    far = primed({("plain", 8): 0.010, ("spec", 8): 0.060}, 2.0)
    n_near = sum(run(near, 2000, 8, 0.0205, 0.010, 2.0)[0])
    n_far = sum(run(far, 2000, 8, 0.060, 0.010, 2.0)[0])
    assert n_near > 10 * max(n_far, 1) and n_far >= 1


def test_switches_when_speculation_starts_to_pay():
    """The verification gets cheaper at step 500 (a compiled graph, a shorter batch): the probes
    see it and the policy turns to speculation; it turns back when acceptance drops."""
    p = primed({("plain", 8): 0.010, ("spec", 8): 0.025}, 2.0)
    got, _ = run(p, 1500, 8, spec_s=lambda i: 0.025 if i < 500 else 0.013, plain_s=0.010,
                 accept=lambda i: 2.0 if i < 1000 else 1.1)
    assert sum(got[:500]) < 25                          # probes only
    assert sum(got[850:1000]) > 0.9 * 150               # speculating
    assert sum(got[1100:1500]) < 0.1 * 400              # acceptance fell: plain again


def test_switches_when_speculation_stops_paying():
    p = primed({("plain", 1): 0.010, ("spec", 1): 0.013}, 2.0)
    got, _ = run(p, 400, 1, spec_s=lambda i: 0.013 if i < 100 else 0.030, plain_s=0.010, accept=2.0)
    assert sum(got[:100]) > 90
    assert sum(got[150:400]) < 0.1 * 250


def test_always_speculates_and_still_measures():
    p = SpecPolicy(PolicyConfig(mode="always"))
    got, _ = run(p, 50, 8, spec_s=0.05, plain_s=0.01, accept=1.0)
    assert all(got) and p.speculative_steps == 50 and p.plain_steps == 0
    assert p.cost("spec", 8) == pytest.approx(0.05) and p.as_dict()["spec_policy"] == "always"


def test_nothing_to_speculate_is_not_a_step():
    p = SpecPolicy()
    assert p.decide(0, 4) is False and p.speculative_steps == p.plain_steps == 0


def test_step_cost_ignores_a_slow_first_step_and_caps_spikes():
    c = StepCost(alpha=0.2)
    c.add(30.0)                                        # the graph compiled in this one
    c.add(0.010)
    assert c.value == pytest.approx(0.010)
    c.add(1.0)                                         # a page fault: counted as twice the estimate
    assert c.value == pytest.approx(0.012)
    for _ in range(50):
        c.add(0.020)                                   # a real change is followed
    assert c.value == pytest.approx(0.020, rel=1e-3)


def test_reset_costs_measures_again():
    p = primed({("plain", 8): 0.010, ("spec", 8): 0.025}, 2.0)
    assert p.decide(8) is False
    p.reset_costs()
    assert p.decide(8) is True and p.last.reason == "measuring"


def test_as_dict():
    p = primed({("plain", 8): 0.010, ("spec", 8): 0.025}, 2.0)
    p.decide(8)
    d = p.as_dict()
    assert d["spec_policy"] == "adaptive" and d["spec_plain_steps"] == 1 and d["spec_enabled"] == 0
    assert d["spec_tokens_per_verify_ema"] == 2.0 and d["spec_cost_ratio_by_batch"] == {8: pytest.approx(2.5)}


@pytest.mark.parametrize("kw,msg", [({"mode": "never"}, "speculative_policy"), ({"alpha": 0}, "alpha"),
                                    ({"burst": 0}, "burst")])
def test_bad_config(kw, msg):
    with pytest.raises(ValueError, match=msg):
        PolicyConfig(**kw)


def test_the_rest_of_an_engine_step_counts_for_both_kinds():
    """Scheduling and outputs cost the same per step whatever its kind: fewer steps per token
    save them too, so they tip a near-even choice towards speculating."""
    p = primed({("plain", 1): 0.010, ("spec", 1): 0.0205}, 2.0)
    assert p.gain(1) == pytest.approx(2 * 0.010 / 0.0205) and p.decide(1) is False
    for _ in range(p.config.min_samples):
        p.observe("step", 1, 0.004)
    assert p.gain(1) == pytest.approx((2 / 0.0245) / (1 / 0.014)) and p.decide(1) is True


def test_a_larger_batch_takes_a_smaller_ones_verdict_without_speculating():
    """Speculation did not pay at batch 2 (a verification of 3 plain steps for 2 tokens): batch 8,
    not measured yet, decodes plainly from its first step (its plain cost measured; speculation
    estimated from batch 2's ratio, a bound, until a probe measures it)."""
    p = primed({("plain", 2): 0.010, ("spec", 2): 0.030}, 2.0)
    assert p.bounds(8) == (pytest.approx(3.0), None)
    got, _ = run(p, 40, 8, spec_s=0.100, plain_s=0.020, accept=2.0)
    assert not any(got[:20]) and p.cost("plain", 8) == pytest.approx(0.020)


def test_a_smaller_batch_takes_a_larger_ones_verdict():
    p = primed({("plain", 8): 0.020, ("spec", 8): 0.030}, 2.0)          # pays at batch 8
    got, _ = run(p, 9, 2, spec_s=0.012, plain_s=0.010, accept=2.0)
    assert all(got) and p.cost("plain", 2) is None


def test_an_inconclusive_bound_measures_both():
    p = primed({("plain", 1): 0.010, ("spec", 1): 0.015}, 2.0)          # pays at batch 1: no bound
    got, _ = run(p, 5, 8, spec_s=0.100, plain_s=0.020, accept=2.0)     # for batch 8
    assert got == [True, True, False, False, False]


def test_acceptance_is_the_mean_while_samples_are_few():
    a = Acceptance(alpha=0.25)
    assert a.value is None and a.estimate(2.0, 2.0) == 2.0
    a.add(2.0)
    assert a.value == pytest.approx(2.0)
    a.add(4.0)                                         # weights 0.25 x 0.75 and 0.25
    assert a.value == pytest.approx((2.0 * 0.1875 + 4.0 * 0.25) / 0.4375)
    b = Acceptance(alpha=0.25)
    b.add(4.0)
    assert b.estimate(2.0, 2.0) == pytest.approx(4.0 / 3 + 2.0 * 2 / 3)   # leans on the prior
    for _ in range(20):
        b.add(4.0)
    assert b.estimate(2.0, 2.0) > 3.8


def test_a_sequence_that_drafts_well_speculates_where_the_average_does_not():
    """The global average (1.6 tokens per verification) says a verification of 2 plain steps does
    not pay; a batch whose sequences verified 3.5 on their own says it does."""
    p = primed({("plain", 2): 0.010, ("spec", 2): 0.020}, 1.6)
    p.observe_acceptance([1.6] * 50)                    # many sequences before these two
    assert p.decide(2, 0, p.batch_acceptance([None, None])) is False
    good = [p.sequence_acceptance() for _ in range(2)]
    p.observe_acceptance([3.5, 3.5, 3.5, 3.5], [good[0], good[1], good[0], good[1]])
    assert p.acceptance < 2.0                           # the global average moved a little
    a = p.batch_acceptance(good)
    assert a > 2.5 and p.decide(2, 0, a) is True
    assert p.batch_acceptance([good[0], None]) == pytest.approx((good[0].estimate(p.acceptance, 2.0)
                                                                 + p.acceptance) / 2)


def test_one_verification_is_not_trusted():
    """The first verified block accepted nothing: speculation goes on until min_verifies
    sequences are counted, rather than decoding plainly ever after on one sample."""
    p = SpecPolicy()
    for kind, s in (("plain", 0.010), ("spec", 0.015)):
        for _ in range(2):
            p.observe(kind, 1, s)
    p.observe_acceptance([1.0])
    assert p.decide(1) is True and p.last.reason == "measuring"
    p.observe_acceptance([3.0] * (p.config.min_verifies - 1))
    assert p.decide(1) is True and p.last.reason == "exploit"


def test_the_paired_ratio_outlasts_a_change_of_load():
    """Measured under load (spec 60 ms, plain 20 ms, close together: a ratio of 3), then plain
    steps only; later, the machine quiet, another engine sharing the measurements (policy
    'always') sees spec steps of 30 ms. The stale plain estimate (20 ms) would make speculation
    look cheap (2 x 20 / 30); the ratio anchors plain on the fresh spec estimate (10 ms)."""
    t = [0.0]
    clock = lambda: t[0]                                # noqa: E731
    adaptive = SpecPolicy(clock=clock)
    always = SpecPolicy(PolicyConfig(mode="always"), adaptive.measured, clock=clock)
    for kind, sec in (("spec", 0.060), ("spec", 0.060), ("plain", 0.020), ("plain", 0.020)):
        t[0] += 0.1
        adaptive.observe(kind, 8, sec)
    adaptive.observe_acceptance([2.0] * 8)
    assert adaptive.measured.ratios[8].value == pytest.approx(3.0)
    t[0] += 600                                         # later: quiet
    for _ in range(20):
        t[0] += 0.1
        always.observe("spec", 8, 0.030)
    assert adaptive.cost("plain", 8) == pytest.approx(0.020)                   # stale
    assert adaptive.paired(8) == (pytest.approx(0.030, rel=0.02), pytest.approx(0.010, rel=0.02))
    assert adaptive.gain(8) == pytest.approx(2.0 / 3.0) and adaptive.decide(8) is False
