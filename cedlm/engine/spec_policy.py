"""When to speculate: the engine's per-step choice between a DSpark speculative step (draft a
block, verify it in one target forward) and a plain decode step, from what it has measured.

Plain Python over numbers (no model, no torch), so the decisions can be tested from given costs
and acceptance. The engine (`engine.py`, through `DSparkSpeculator`) asks `decide(n_spec,
n_other)` before each decode step, times each step it runs (`observe("plain" | "spec", batch,
seconds)`) and reports the tokens each verification kept (`observe_acceptance`).

The model of a step:
- acceptance `a`: tokens a sequence emits per verification (1 + accepted drafts): each
  sequence's own moving average, leaning on the global one (over every verified sequence) until
  it has a few verifications of its own (the drafter's agreement with the target is a property
  of the text: one document's continuation is predictable, another's is not); a step's is the
  mean over its batch;
- cost: seconds per step of each kind (`plain`: one token per sequence; `spec`: draft + verify +
  accept, the whole speculative step) keyed by batch-size bucket (1, 2, 4, 8, ...: the next power
  of two), moving averages robust to a one-off slow step (a graph compiling, a page fault); and
  `step`, what an engine step costs besides its decoding (scheduling, outputs, statistics), paid
  once per step whatever its kind, so fewer steps per token save it too; and, per bucket, the
  ratio of a speculative step to a plain one from samples taken close together in time (a sample
  of one kind against the other's estimate when that was measured within `pair_seconds`): on a
  shared machine both kinds slow down and speed up together, so the ratio holds where the
  estimate of the kind not run lately has gone stale; the kind measured last anchors the other;
- a step of n_spec sequences that may speculate and n_other that may not (logprobs, penalties:
  they decode plainly either way): speculating costs spec(n_spec) + plain(n_other) + step for
  n_other + a * n_spec tokens, not speculating plain(n_spec + n_other) + step for
  n_spec + n_other tokens; `gain` is the ratio of the two rates. Speculate while gain > 1 (with a small
  hysteresis `margin`, so that noise does not flip the choice every step).

Exploration keeps the estimates fresh: what is not measured yet is tried first (a speculative
step, then a plain one, each `min_samples` times per bucket) unless other buckets settle it
(`bounds`: a larger batch where a smaller one found speculation did not pay decodes plainly from
its first step), and after that the option not
chosen is tried again (a burst of `burst` speculative steps: the first after plain steps drafts
without the drafter's most recent context, so its acceptance is not counted; one plain step)
whenever the credit allows: each exploited step earns `explore` x its estimated seconds, a probe
spends its estimated loss against the chosen option (with the drafts lost to the missing context
rows on resuming, `cold_loss`). Exploration thus costs at most about `explore` of the decode time, and near the break-even point (where the choice matters and the loss
of a probe is small) it probes often. `mode="always"` speculates every step (benchmarks, tests
that need drafting every step) and still measures.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from cedlm.config.modes import SPEC_POLICIES

POLICIES = SPEC_POLICIES


def bucket(n: int) -> int:
    """The batch-size bucket of n sequences: the next power of two >= n (0 for none)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


@dataclass
class PolicyConfig:
    mode: str = "adaptive"        # "adaptive": decide per step from measurements; "always": speculate
    alpha: float = 0.05           # global acceptance: EMA weight per verified sequence
    seq_alpha: float = 0.25       # a sequence's own acceptance: EMA weight per verification
    prior_weight: float = 2.0     # the global average counts as this many of a sequence's own
    cost_alpha: float = 0.2       # step-cost EMA weight per step
    margin: float = 0.03          # hysteresis: switch when the other option is this much faster
    explore: float = 0.02         # the share of decode time exploration may cost
    burst: int = 3                # speculative steps per exploration
    min_interval: int = 8         # exploited steps between two explorations (per bucket)
    min_samples: int = 2          # steps of a kind measured per bucket before it is trusted
    min_verifies: int = 8         # verified sequences before the acceptance is trusted
    pair_seconds: float = 5.0     # a sample pairs with the other kind's estimate this fresh
    ratio_alpha: float = 0.3      # the spec / plain ratio's EMA weight per pair
    cold_loss: float = 0.5        # share of the drafts' gain the first speculative step after a
    #                               plain one loses (the drafter's latest context rows are missing)

    def __post_init__(self):
        if self.mode not in POLICIES:
            raise ValueError(f"speculative_policy: {self.mode!r} is not one of {POLICIES}")
        if not all(0 < x <= 1 for x in (self.alpha, self.seq_alpha, self.cost_alpha)):
            raise ValueError("speculative policy: alpha / seq_alpha / cost_alpha must be in (0, 1]")
        if self.prior_weight < 0:
            raise ValueError("speculative policy: prior_weight must be >= 0")
        if (self.explore < 0 or self.margin < 0 or self.burst < 1 or self.min_samples < 1
                or self.min_verifies < 1):
            raise ValueError("speculative policy: explore, margin >= 0; burst, min_samples, "
                             "min_verifies >= 1")
        if not 0 <= self.cold_loss <= 1:
            raise ValueError("speculative policy: cold_loss must be in [0, 1]")


class Acceptance:
    """Tokens per verification: an exponential moving average, bias-corrected (while the samples
    are few it is their mean, not the first one's echo)."""

    def __init__(self, alpha: float):
        self.alpha, self._m, self._w, self.samples = alpha, 0.0, 0.0, 0

    def add(self, x: float) -> None:
        self._m += self.alpha * (float(x) - self._m)
        self._w += self.alpha * (1.0 - self._w)
        self.samples += 1

    @property
    def value(self) -> float | None:
        return self._m / self._w if self._w > 0 else None

    def estimate(self, prior: float | None, prior_weight: float) -> float | None:
        """The own average, shrunk towards `prior` as if it were prior_weight samples."""
        if self.value is None or prior is None:
            return self.value if prior is None else prior
        w = self.samples / (self.samples + prior_weight)
        return w * self.value + (1 - w) * prior


class StepCost:
    """Seconds per step of one kind at one bucket: an EMA whose step up is capped at twice the
    estimate (a one-off slow step moves it little), and which drops to a sample under half the
    estimate at once (the first sample was a compile or a cold cache, or a faster graph came in)."""

    def __init__(self, alpha: float):
        self.alpha, self.value, self.samples, self.at = alpha, None, 0, None

    def add(self, seconds: float, at: float | None = None) -> None:
        """A sample; `at`: when (the clock's seconds)."""
        if seconds < 0:
            return
        if self.value is None or seconds < self.value / 2:
            self.value = seconds
        else:
            self.value += self.alpha * (min(seconds, 2 * self.value) - self.value)
        self.samples += 1
        self.at = at


@dataclass
class _Bucket:
    """The decision state of one (speculating, not speculating) bucket pair."""
    current: bool | None = None   # the exploited choice (True: speculate)
    credit: float = 0.0           # seconds exploration may still spend
    since: int = 0                # exploited steps since the last exploration
    burst: int = 0                # exploration steps still to run
    burst_kind: bool = False


@dataclass
class Decision:
    speculate: bool
    reason: str                   # "always", "measuring", "exploit", "explore"
    gain: float | None = None     # estimated rate(speculating) / rate(plain)


@dataclass
class Measurements:
    """What the policy has measured: the acceptance and the step costs. Several policies may share
    one (engines of the same model, decode step and drafting options, one after another: a
    benchmark, a server restarting its engine), as the costs are the machine's."""
    accept: Acceptance = field(default_factory=lambda: Acceptance(PolicyConfig.alpha))   # global
    costs: dict = field(default_factory=dict)          # (kind, bucket) -> StepCost
    ratios: dict = field(default_factory=dict)         # bucket -> Acceptance (an EMA) of spec / plain


class SpecPolicy:
    def __init__(self, config: PolicyConfig | None = None, measured: Measurements | None = None,
                 clock=time.monotonic):
        self.config, self.clock = config or PolicyConfig(), clock
        self.measured = measured if measured is not None else Measurements(Acceptance(self.config.alpha))
        self.buckets: dict = {}              # (bucket(n_spec), bucket(n_other)) -> _Bucket
        self.speculative_steps = 0           # engine steps that speculated (exploration included)
        self.plain_steps = 0                 # engine steps that could have and did not
        self.exploration_steps = 0           # of either kind, chosen to measure (first) or re-measure
        self.last: Decision | None = None

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def acceptance(self) -> float | None:
        """The global acceptance (tokens per verified sequence)."""
        return self.measured.accept.value

    @property
    def costs(self) -> dict:
        return self.measured.costs

    # ---------------------------------------------------------------- measurements
    def observe(self, kind: str, n: int, seconds: float) -> None:
        """One step of `kind` ("plain" | "spec": its decoding; "step": the rest of an engine step)
        over n sequences took `seconds`."""
        if kind not in ("plain", "spec", "step"):
            raise ValueError(f"observe: kind {kind!r} is not 'plain', 'spec' or 'step'")
        if n <= 0 or seconds < 0:
            return
        bk, now = bucket(n), self.clock()
        c = self.costs.setdefault((kind, bk), StepCost(self.config.cost_alpha))
        other = self.costs.get(({"spec": "plain", "plain": "spec"}.get(kind), bk))
        if (other is not None and other.value and seconds > 0 and other.at is not None
                and now - other.at <= self.config.pair_seconds):
            r = seconds / other.value if kind == "spec" else other.value / seconds
            avg = self.measured.ratios.setdefault(bk, Acceptance(self.config.ratio_alpha))
            if avg.value is not None:                     # a one-off slow step moves it little
                r = min(max(r, avg.value / 2), avg.value * 2)
            avg.add(r)
        c.add(seconds, now)

    def observe_acceptance(self, tokens_per_verify, sequences=None) -> None:
        """Tokens kept by each verified sequence (1 + its accepted drafts), counted ones only;
        `sequences`: each one's own `Acceptance` (`sequence_acceptance`), or None."""
        for i, x in enumerate(tokens_per_verify):
            self.measured.accept.add(x)
            if sequences is not None and sequences[i] is not None:
                sequences[i].add(x)

    def sequence_acceptance(self) -> Acceptance:
        """A new sequence's own acceptance record."""
        return Acceptance(self.config.seq_alpha)

    def batch_acceptance(self, sequences) -> float | None:
        """Tokens per verification expected of a batch: the mean of its sequences' estimates
        (their own averages, leaning on the global one while they have few samples; None for a
        sequence with none)."""
        g = self.acceptance
        est = [g if a is None else a.estimate(g, self.config.prior_weight) for a in sequences]
        est = [e for e in est if e is not None]
        return sum(est) / len(est) if est else None

    def reset_costs(self) -> None:
        """Forget the step costs (the decode step changed: a compiled graph came in)."""
        self.costs.clear()
        self.measured.ratios.clear()
        for b in self.buckets.values():
            b.current, b.burst, b.since = None, 0, 0

    def cost(self, kind: str, n: int) -> float | None:
        """Estimated seconds of a step of `kind` over n sequences (0 for none); None until
        measured `min_samples` times at n's bucket."""
        if n <= 0:
            return 0.0
        c = self.costs.get((kind, bucket(n)))
        return c.value if c is not None and c.samples >= self.config.min_samples else None

    def paired(self, n: int) -> tuple[float | None, float | None]:
        """(spec, plain) seconds at n's bucket where both are measured: the kind measured last as
        it is, the other from it through the paired ratio (when there is one); else each as
        measured (None if not)."""
        s, p = self.cost("spec", n), self.cost("plain", n)
        r = self.measured.ratios.get(bucket(n))
        if s is None or p is None or r is None or r.value is None:
            return s, p
        cs, cp = self.costs[("spec", bucket(n))], self.costs[("plain", bucket(n))]
        if (cs.at or 0) >= (cp.at or 0):
            return s, s / r.value
        return p * r.value, p

    def ratio(self, bk: int) -> float | None:
        """Seconds of a speculative engine step / a plain one (decoding and the rest of the step)
        at bucket bk, where both kinds are measured."""
        s, p = self.paired(bk)
        if s is None or p is None:
            return None
        o = self.cost("step", bk) or 0.0
        return (s + o) / (p + o) if p + o > 0 else None

    def bounds(self, n: int) -> tuple[float | None, float | None]:
        """(low, high) bounds on `ratio` at n's bucket from the measured buckets below and above
        it, on the premise that the ratio does not fall as the batch grows (a plain step is
        bound by reading the weights, which a verification's extra rows share, until the rows
        make it bound by compute). Speculation does not pay where acceptance < low, and pays
        where acceptance > high; the policy takes this instead of measuring a bucket's losing
        kind first (a larger batch is not first made to speculate where a smaller one found it
        did not pay). Measurements of the bucket itself always win."""
        k = bucket(n)
        below = [r for bk in {b for _, b in self.costs} if bk < k and (r := self.ratio(bk)) is not None]
        above = [r for bk in {b for _, b in self.costs} if bk > k and (r := self.ratio(bk)) is not None]
        return (max(below) if below else None), (min(above) if above else None)

    def gain(self, n_spec: int, n_other: int = 0, acceptance: float | None = None) -> float | None:
        """rate(speculating) / rate(plain) for a step of n_spec + n_other sequences (None while a
        needed estimate is missing)."""
        a = self.acceptance if acceptance is None else acceptance
        s, p = self.paired(n_spec) if n_other == 0 else (self.cost("spec", n_spec),
                                                          self.cost("plain", n_spec + n_other))
        pm = self.cost("plain", n_other)
        if a is None or s is None or p is None or pm is None:
            return None
        o = self.cost("step", n_spec + n_other) or 0.0
        if s + pm + o <= 0 or p + o <= 0:
            return None
        return ((n_other + a * n_spec) / (s + pm + o)) / ((n_other + n_spec) / (p + o))

    # ---------------------------------------------------------------- decisions
    def decide(self, n_spec: int, n_other: int = 0, acceptance: float | None = None) -> bool:
        """Whether this step speculates for its n_spec sequences that may (n_other decode plainly
        in any case). `acceptance`: tokens per verification expected of this batch (default the
        global average)."""
        if n_spec <= 0:
            return False
        d = self._decide(n_spec, n_other, acceptance)
        self.last = d
        if d.speculate:
            self.speculative_steps += 1
        else:
            self.plain_steps += 1
        if d.reason in ("explore", "measuring"):
            self.exploration_steps += 1
        return d.speculate

    def _decide(self, n_spec: int, n_other: int, acceptance: float | None) -> Decision:
        cfg = self.config
        if cfg.mode == "always":
            return Decision(True, "always")
        b = self.buckets.setdefault((bucket(n_spec), bucket(n_other)), _Bucket())
        if b.burst > 0:                                   # an exploration burst goes on
            b.burst -= 1
            return Decision(b.burst_kind, "explore")
        a = self.acceptance if acceptance is None else acceptance
        if a is None or self.measured.accept.samples < cfg.min_verifies:   # speculation first:
            return Decision(True, "measuring")            # the drafter's context is whole after prefill
        s, p = self.paired(n_spec) if n_other == 0 else (self.cost("spec", n_spec),
                                                          self.cost("plain", n_spec + n_other))
        pm, o = self.cost("plain", n_other), self.cost("step", n_spec + n_other) or 0.0
        if n_other == 0 and (s is None or p is None):
            # a bucket not measured yet: what other buckets measured may settle it (`bounds`)
            lo, hi = self.bounds(n_spec)
            if lo is not None and a < lo:                 # does not pay here either
                if p is None:
                    return Decision(False, "measuring")
                s = (p + o) * lo - o                      # the bound as the estimate, until probed
            elif hi is not None and a > hi:               # pays here too
                if s is None:
                    return Decision(True, "measuring")
                p = (s + o) / hi - o
        if s is None or pm is None:
            return Decision(True, "measuring")
        if p is None:
            return Decision(False, "measuring")
        spec_s, plain_s = s + pm + o, p + o
        tok_spec, tok_plain = n_other + a * n_spec, n_other + n_spec
        g = (tok_spec / spec_s) / (tok_plain / plain_s)
        best = g > (1 - cfg.margin if b.current else 1 + cfg.margin)
        b.current = best
        b.credit += cfg.explore * (spec_s if best else plain_s)
        b.since += 1
        # a probe's loss: its time less what the chosen option takes for its tokens, plus the
        # drafts the first speculative step after a plain one loses (`cold_loss`)
        cold = cfg.cold_loss * max(a - 1, 0.0) * n_spec
        if best:
            loss, burst = plain_s - tok_plain * spec_s / tok_spec + cold * spec_s / tok_spec, 1
        else:
            loss, burst = spec_s - tok_spec * plain_s / tok_plain + cold * plain_s / tok_plain, cfg.burst
        loss = max(loss, 0.0)
        if cfg.explore > 0 and b.since >= cfg.min_interval and b.credit >= burst * loss:
            b.credit -= burst * loss
            b.since, b.burst, b.burst_kind = 0, burst - 1, not best
            return Decision(not best, "explore", g)
        return Decision(best, "exploit", g)

    # ---------------------------------------------------------------- reporting
    def cost_ratios(self) -> dict[int, float]:
        """{bucket: spec step seconds / plain step seconds (decoding)} where both are measured."""
        out = {}
        for bk in sorted({b for _, b in self.costs}):
            s, p = self.paired(bk)
            if s and p:
                out[bk] = s / p
        return out

    def as_dict(self) -> dict:
        return {"spec_policy": self.config.mode,
                "spec_speculative_steps": self.speculative_steps,
                "spec_plain_steps": self.plain_steps,
                "spec_exploration_steps": self.exploration_steps,
                "spec_tokens_per_verify_ema": self.acceptance or 0.0,
                "spec_enabled": int(bool(self.last and self.last.speculate)),
                "spec_cost_ratio_by_batch": self.cost_ratios()}
