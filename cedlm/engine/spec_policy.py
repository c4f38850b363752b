"""When to speculate: the engine's per-step choice between a DSpark speculative step (draft a
block, verify it in one target forward) and a plain decode step, from what it has measured.

Plain Python over numbers (no model, no torch), so the decisions can be tested from given costs
and acceptance. The engine (`engine.py`, through `DSparkSpeculator`) asks `decide(n_spec,
n_other)` before each decode step, times each step it runs (`observe("plain" | "spec", batch,
seconds)`) and reports the tokens each verification kept (`observe_acceptance`).

The model of a step:
- acceptance `a`: tokens a sequence emits per verification (1 + accepted drafts), an exponential
  moving average over verified sequences (global: the drafter's agreement with the target is a
  property of the text, not of the batch);
- cost: seconds per step of each kind (`plain`: one token per sequence; `spec`: draft + verify +
  accept, the whole speculative step) keyed by batch-size bucket (1, 2, 4, 8, ...: the next power
  of two), moving averages robust to a one-off slow step (a graph compiling, a page fault); and
  `step`, what an engine step costs besides its decoding (scheduling, outputs, statistics), paid
  once per step whatever its kind, so fewer steps per token save it too;
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

from dataclasses import dataclass, field

from cedlm.config.modes import SPEC_POLICIES

POLICIES = SPEC_POLICIES


def bucket(n: int) -> int:
    """The batch-size bucket of n sequences: the next power of two >= n (0 for none)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


@dataclass
class PolicyConfig:
    mode: str = "adaptive"        # "adaptive": decide per step from measurements; "always": speculate
    alpha: float = 0.05           # acceptance EMA weight per verified sequence
    cost_alpha: float = 0.2       # step-cost EMA weight per step
    margin: float = 0.03          # hysteresis: switch when the other option is this much faster
    explore: float = 0.02         # the share of decode time exploration may cost
    burst: int = 3                # speculative steps per exploration
    min_interval: int = 8         # exploited steps between two explorations (per bucket)
    min_samples: int = 2          # steps of a kind measured per bucket before it is trusted
    cold_loss: float = 0.5        # share of the drafts' gain the first speculative step after a
    #                               plain one loses (the drafter's latest context rows are missing)

    def __post_init__(self):
        if self.mode not in POLICIES:
            raise ValueError(f"speculative_policy: {self.mode!r} is not one of {POLICIES}")
        if not 0 < self.alpha <= 1 or not 0 < self.cost_alpha <= 1:
            raise ValueError("speculative policy: alpha / cost_alpha must be in (0, 1]")
        if self.explore < 0 or self.margin < 0 or self.burst < 1 or self.min_samples < 1:
            raise ValueError("speculative policy: explore, margin >= 0; burst, min_samples >= 1")
        if not 0 <= self.cold_loss <= 1:
            raise ValueError("speculative policy: cold_loss must be in [0, 1]")


class StepCost:
    """Seconds per step of one kind at one bucket: an EMA whose step up is capped at twice the
    estimate (a one-off slow step moves it little), and which drops to a sample under half the
    estimate at once (the first sample was a compile or a cold cache, or a faster graph came in)."""

    def __init__(self, alpha: float):
        self.alpha, self.value, self.samples = alpha, None, 0

    def add(self, seconds: float) -> None:
        if seconds < 0:
            return
        if self.value is None or seconds < self.value / 2:
            self.value = seconds
        else:
            self.value += self.alpha * (min(seconds, 2 * self.value) - self.value)
        self.samples += 1


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
    acceptance: float | None = None          # tokens per verified sequence, EMA
    acceptance_samples: int = 0
    costs: dict = field(default_factory=dict)          # (kind, bucket) -> StepCost


class SpecPolicy:
    def __init__(self, config: PolicyConfig | None = None, measured: Measurements | None = None):
        self.config = config or PolicyConfig()
        self.measured = measured if measured is not None else Measurements()
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
        return self.measured.acceptance

    @property
    def costs(self) -> dict:
        return self.measured.costs

    # ---------------------------------------------------------------- measurements
    def observe(self, kind: str, n: int, seconds: float) -> None:
        """One step of `kind` ("plain" | "spec": its decoding; "step": the rest of an engine step)
        over n sequences took `seconds`."""
        if kind not in ("plain", "spec", "step"):
            raise ValueError(f"observe: kind {kind!r} is not 'plain', 'spec' or 'step'")
        if n > 0:
            self.costs.setdefault((kind, bucket(n)), StepCost(self.config.cost_alpha)).add(seconds)

    def observe_acceptance(self, tokens_per_verify) -> None:
        """Tokens kept by each verified sequence (1 + its accepted drafts), counted ones only."""
        m = self.measured
        for x in tokens_per_verify:
            if m.acceptance is None:
                m.acceptance = float(x)
            else:
                m.acceptance += self.config.alpha * (float(x) - m.acceptance)
            m.acceptance_samples += 1

    def reset_costs(self) -> None:
        """Forget the step costs (the decode step changed: a compiled graph came in)."""
        self.costs.clear()
        for b in self.buckets.values():
            b.current, b.burst, b.since = None, 0, 0

    def cost(self, kind: str, n: int) -> float | None:
        """Estimated seconds of a step of `kind` over n sequences (0 for none); None until
        measured `min_samples` times at n's bucket."""
        if n <= 0:
            return 0.0
        c = self.costs.get((kind, bucket(n)))
        return c.value if c is not None and c.samples >= self.config.min_samples else None

    def ratio(self, bk: int) -> float | None:
        """Seconds of a speculative engine step / a plain one (decoding and the rest of the step)
        at bucket bk, where both kinds are measured."""
        s, p = self.cost("spec", bk), self.cost("plain", bk)
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
        s, p, pm = self.cost("spec", n_spec), self.cost("plain", n_spec + n_other), self.cost("plain", n_other)
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
        if a is None:                                     # measure speculation first: the
            return Decision(True, "measuring")            # drafter's context is whole after prefill
        s, p = self.cost("spec", n_spec), self.cost("plain", n_spec + n_other)
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
        """{bucket: spec step seconds / plain step seconds} where both are measured."""
        out = {}
        for (kind, bk), c in sorted(self.costs.items()):
            other = self.costs.get(("plain", bk))
            if kind == "spec" and other is not None and c.value and other.value:
                out[bk] = c.value / other.value
        return out

    def as_dict(self) -> dict:
        return {"spec_policy": self.config.mode,
                "spec_speculative_steps": self.speculative_steps,
                "spec_plain_steps": self.plain_steps,
                "spec_exploration_steps": self.exploration_steps,
                "spec_tokens_per_verify_ema": self.acceptance or 0.0,
                "spec_enabled": int(bool(self.last and self.last.speculate)),
                "spec_cost_ratio_by_batch": self.cost_ratios()}
