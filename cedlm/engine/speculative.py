"""DSpark speculative decoding as a propose / verify module: draft a block, verify it in one
target forward, keep the accepted prefix, roll back the rest, return the tokens.

Per engine step, for the running sequences that can speculate (no logits processing, no top
logprobs: their sampling distribution is the plain temperature / top-k / top-p one):
1. `propose`: the block's hidden rows (the draft step, `dspark_steps.DraftStep`: the static step,
   compiled like the decode step; `dspark.draft_block` in mode "eager") + `markov_decode` give
   N = dspark_block_size draft tokens per sequence (greedy rows take the argmax, sampled rows draw from the draft distribution q); the
   drafts to verify: while the running product of their confidences stays at or above
   `threshold` (0 verifies the whole block), capped by what the request may still emit;
2. the engine reserves the lookahead slots through the scheduler (`Scheduler.reserve_lookahead`;
   when the pool cannot hold them, `Proposal.without_drafts` verifies none: one plain token);
3. `verify`: one target forward over [anchor, drafts...] for the batch (`dspark_steps.VerifyStep`):
   the static step, compiled like the decode step (the engine's `decode_step` mode; it stores
   nothing, and the kept prefix is written back after acceptance), or, in mode "eager" and
   wherever the decode step takes the reference path, `rollback.verify` (rows padded to the
   longest verified length, the padding rolled back like a rejection);
4. accept (`accept_greedy` / `accept_sampled`): greedy keeps drafts while they equal the target's
   argmax, then the target's token (the plain greedy output, up to float near-ties: the
   verification forward runs other GEMM shapes and MoE groupings than a one-token step, as
   batching does); sampled runs standard speculative rejection sampling, which leaves the output
   distribution that of the target (tests/test_speculative.py);
5. write back the kept rows or roll back the rejected ones (`VerifyStep.commit`), write the
   drafter's context rows for the
   kept positions, and return each sequence's kept tokens with their logprobs. The engine then
   advances the scheduler's counts (which releases the unused slots) and emits the tokens
   through the stop checker one by one.
Other sequences decode one token as usual in the same step. This module touches the sequences'
model state and draft state (`SequenceRuntime.state`, `.draft`) and nothing else of the engine.

Whether a step speculates at all is the policy's (`spec_policy.SpecPolicy`; `policy` "adaptive" by
default): from the acceptance so far and the measured cost of a speculative step against a plain
one at that batch size, the engine runs a plain decode step wherever drafting does not pay
(`decide`, `observe`), and now and then the other kind to keep the estimates fresh; "always"
speculates every step. A plain step (the engine's ordinary decode step, which computes no taps)
writes no context rows: the drafter's rings then miss those positions, which a later block does
not see (`dspark.window_visible` keys on each slot's position; an unwritten slot holds an older
position, out of the window), as after a rejection. The next verification writes the rows of what
it keeps, so the context is whole again within a block or two (the drafter leans on its last few
rows: measured on the shipped model, 1.3 tokens per verification with none of the window, 1.9
with the last 2 rows, 2.0 with all 64); a verification whose last `WARM_ROWS` positions lack rows
is not counted in the policy's acceptance. Greedy output is the target's argmax either way, and
sampling is exact either way (the sampler's distribution, or rejection sampling against it);
under the adaptive policy a seeded sampled request decodes plainly (`speculates`), so that its
tokens depend neither on the batch nor on the machine's timing.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

from cedlm.config.modes import SPEC_METHODS
from cedlm.engine.loader import model_device
from cedlm.engine.sampler import apply_top_k_top_p
from cedlm.engine.spec_policy import POLICIES, Measurements, PolicyConfig, SpecPolicy
from cedlm.model import dspark
from cedlm.model.compiled_step import CompiledDecode
from cedlm.model.dspark_steps import DraftStep, VerifyStep
from cedlm.model.rollback import capture

METHODS = SPEC_METHODS
WARM_ROWS = 2        # context rows right before a block needed for its acceptance to be counted

# decode step (or model) -> {(speculator class, threshold, draft cap): Measurements}: what the
# policy measured outlives one engine (engines built one after another on the same model, decode
# step and drafting options share it); weak, so it goes with the model's decode step
_MEASURED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclass
class SpeculativeConfig:
    method: str = "dspark"
    threshold: float = 0.0           # verify drafts while prod(confidence) >= threshold; 0 = whole block
    num_draft_tokens: int | None = None   # at most this many drafts per block (None: dspark_block_size)
    policy: str = "adaptive"         # "adaptive": speculate where it pays (spec_policy.py); "always"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative: unknown method {self.method!r} (expected one of {METHODS})")
        if self.policy not in POLICIES:
            raise ValueError(f"speculative_policy: {self.policy!r} is not one of {POLICIES}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"speculative_threshold: {self.threshold} is not in [0, 1]")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens: must be >= 1, got {self.num_draft_tokens}")


def accept_greedy(drafts: list[int], target: list[int]) -> list[int]:
    """drafts d_1..d_k, target argmax t_0..t_k (t_j after the anchor and d_1..d_j): the emitted
    tokens: the drafts that equal the target's choice, then the target's own token."""
    out = []
    for d, t in zip(drafts, target):
        if d != t:
            break
        out.append(d)
    out.append(target[len(out)])
    return out


def accept_sampled(drafts: list[int], q: torch.Tensor, p: torch.Tensor, gen) -> list[int]:
    """Speculative rejection sampling. drafts d_1..d_k drawn from q [k, V]; p [k+1, V] the target
    distributions after the anchor and each draft. d_i is kept with probability
    min(1, p_i(d_i) / q_i(d_i)); the first rejected one is replaced by a draw from
    normalise(max(p_i - q_i, 0)); when all are kept one more token comes from p_k."""
    out = []
    for i, d in enumerate(drafts):
        u = torch.rand((), generator=gen, device=p.device).item()
        if u * float(q[i, d]) < float(p[i, d]):            # u < p/q without dividing by 0
            out.append(d)
            continue
        resid = (p[i] - q[i]).clamp_min(0)
        s = resid.sum()
        dist = resid / s if s > 0 else p[i]
        out.append(int(torch.multinomial(dist, 1, generator=gen)))
        return out
    out.append(int(torch.multinomial(p[len(drafts)], 1, generator=gen)))
    return out


def probs(logits: torch.Tensor, params) -> torch.Tensor:
    """The distribution the sampler draws from for plain params: [..., V] logits -> probs."""
    V = logits.shape[-1]
    x = logits.float() / params.temperature
    k = min(params.top_k, V) if params.top_k > 0 else V
    if k < V or params.top_p < 1.0:
        shape = x.shape
        x = x.reshape(-1, V)
        kk = torch.full((x.shape[0],), k, device=x.device) if k < V else None
        pp = (torch.full((x.shape[0],), params.top_p, dtype=x.dtype, device=x.device)
              if params.top_p < 1.0 else None)
        x = apply_top_k_top_p(x, kk, pp).reshape(shape)
    return x.softmax(-1)


def can_speculate(params) -> bool:
    return not params.processes_logits and not params.logprobs


@dataclass
class Proposal:
    """Draft blocks for a batch of running sequences: anchors [B] (each one's last token),
    positions P [B] (its next position), drafts [B, N] and their logits [B, N, V], and k[b], the
    drafts of sequence b to verify (the verify forward runs 1 + max(k) positions); counted[b]:
    whether its acceptance counts for the policy (its drafts not capped by what the request may
    still emit, the drafter's context holding the rows right before the block)."""
    anchors: torch.Tensor
    positions: torch.Tensor
    drafts: torch.Tensor
    draft_logits: torch.Tensor
    k: list[int]
    counted: list[bool] | None = None

    @property
    def num_lookahead(self) -> int:
        """Positions past each sequence's next one that the verify forward writes."""
        return max(self.k, default=0)

    def without_drafts(self) -> "Proposal":
        """Verify nothing (one plain token per sequence): the lookahead could not be reserved."""
        return Proposal(self.anchors, self.positions, self.drafts, self.draft_logits, [0] * len(self.k),
                        [False] * len(self.k))


@dataclass
class SpecStats:
    steps: int = 0                   # verify forwards (one per sequence per speculative step)
    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    emitted: int = 0
    verified_at: list[int] = field(default_factory=list)    # per draft position
    accepted_at: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0

    def as_dict(self) -> dict:
        acc = [a / v if v else 0.0 for a, v in zip(self.accepted_at, self.verified_at)]
        return {"spec_steps": self.steps, "spec_drafted_tokens": self.drafted,
                "spec_verified_tokens": self.verified, "spec_accepted_tokens": self.accepted,
                "spec_emitted_tokens": self.emitted,
                "spec_acceptance_rate": self.accepted / self.verified if self.verified else 0.0,
                "spec_tokens_per_forward": self.emitted / self.steps if self.steps else 0.0,
                "spec_acceptance_by_position": acc,
                "spec_verified_by_position": list(self.verified_at),
                "spec_accepted_by_position": list(self.accepted_at),
                "spec_draft_seconds": self.draft_s, "spec_verify_seconds": self.verify_s}


class DSparkSpeculator:
    def __init__(self, model, config: SpeculativeConfig | None = None, decoder=None, log=None):
        """decoder: the engine's `CompiledDecode`; its mode decides the draft and verify steps'
        (None or "eager": their references, `dspark.draft_block` and `rollback.verify`)."""
        if not hasattr(model, "mtp"):
            raise ValueError("speculative: this model has no DSpark drafter (no mtp.* weights; "
                             "a model directory ships them in mtp.safetensors, made by "
                             "`cedlm train dspark`)")
        self.model, self.cfg = model, config or SpeculativeConfig()
        self.device = model_device(model)           # the drafter's tensors go where the model is
        N = model.cfg.dspark_block_size
        self.k_max = min(self.cfg.num_draft_tokens or N, N, model.cfg.sliding_window - 1)
        shared = _MEASURED.setdefault(decoder if decoder is not None else model, {})
        measured = shared.setdefault((type(self), self.cfg.threshold, self.k_max), Measurements())
        self.policy = SpecPolicy(PolicyConfig(mode=self.cfg.policy), measured)
        self.decoder = decoder
        self._step_mode = self._decoder_mode()
        self._decode_s = 0.0                        # this engine step's decoding so far
        self._accept = weakref.WeakKeyDictionary()  # sequence runtime -> its own acceptance
        self.stats = SpecStats(verified_at=[0] * N, accepted_at=[0] * N)
        steps = decoder if decoder is not None else CompiledDecode.of(model, "eager")
        self.step = VerifyStep.of(steps, 1 + self.k_max, log=log)
        self.drafter = DraftStep.of(steps, log=log)

    # ---------------------------------------------------------------- policy
    def _decoder_mode(self):
        """The decode step's mode now (a compiled graph adopted mid-run changes it)."""
        d = self.decoder
        return None if d is None else (getattr(d, "active_mode", None) or getattr(d, "mode", None))

    def speculates(self, params) -> bool:
        """Whether a request with these sampling params takes part in speculative steps: plain
        sampling (`can_speculate`); under the adaptive policy not a seeded sampled one, whose
        tokens must not depend on the batch (the policy's choice does)."""
        if not can_speculate(params):
            return False
        return self.policy.mode == "always" or params.greedy or params.seed is None

    def decide(self, n_spec: int, n_other: int = 0, runs=None) -> bool:
        """Whether this decode step speculates for its n_spec sequences that may (runs: their
        runtimes; n_other decode one token plainly in any case): the policy's choice
        (`SpecPolicy.decide`) for the acceptance expected of these sequences."""
        mode = self._decoder_mode()
        if mode != self._step_mode:                 # another step now: its costs are to measure
            self._step_mode = mode
            self.policy.reset_costs()
        a = None if runs is None else self.policy.batch_acceptance([self._accept.get(u) for u in runs])
        return self.policy.decide(n_spec, n_other, a)

    def observe(self, kind: str, n: int, seconds: float) -> None:
        """The engine's decode step of `kind` ("plain" | "spec") over n sequences took seconds."""
        self._decode_s += seconds
        self.policy.observe(kind, n, seconds)

    def end_step(self, n: int, seconds: float, counted: bool = True) -> None:
        """An engine step that decoded n sequences took seconds: what it spent besides decoding
        (scheduling, outputs, statistics) is every step's cost, whatever its kind (`counted`:
        the step ran no prefill, whose time is not the decode's)."""
        if counted and n and self._decode_s > 0:
            self.policy.observe("step", n, max(seconds - self._decode_s, 0.0))
        self._decode_s = 0.0

    def _warm(self, runs, P: torch.Tensor) -> list[bool]:
        """Per sequence: whether its drafter context holds the WARM_ROWS positions before P."""
        W = self.model.cfg.sliding_window
        want = P.view(-1, 1) - torch.arange(1, WARM_ROWS + 1, device=P.device)       # [B, WARM]
        pos = torch.stack([u.draft.window_pos[0] for u in runs]).to(P.device)        # [B, W]
        have = pos.gather(1, want.clamp_min(0) % W)
        return ((have == want) | (want < 0)).all(1).tolist()

    # ---------------------------------------------------------------- drafter context
    def new_draft_state(self):
        return dspark.DraftState(self.model.kv_layout, len(self.model.mtp), device=self.device)

    def write_context(self, states, taps: torch.Tensor, p0: list[int], n: list[int]) -> None:
        """Draft-layer window rows for the first n[b] rows of taps [B, T, taps*D] (positions
        p0[b]...)."""
        dev = taps.device
        pos = torch.tensor(p0, device=dev).view(-1, 1) + torch.arange(taps.shape[1], device=dev)
        with torch.no_grad():
            rows = dspark.context_rows(self.model.mtp, taps, pos)
        for b, st in enumerate(states):
            if n[b]:
                st.write([r[b, : n[b]] for r in rows], pos[b, : n[b]])

    def _write_rows(self, run, taps) -> None:
        """Context rows for the last taps.shape[1] positions of run's state (taps [1, T, ...])."""
        if run.draft is None:
            run.draft = self.new_draft_state()
        if taps is not None:
            T = taps.shape[1]
            self.write_context([run.draft], taps, [run.state.num_tokens - T], [T])

    def prefill_step(self, run, num_tokens: int) -> bool:
        """One prefill chunk of run's `PrefillRun` (`num_tokens`, the scheduler's chunk); when the
        prompt is done, the drafter's context from its last rows goes into `run.draft` (after
        the rows `replay` wrote for a prefix-cache hit)."""
        with capture(self.model, taps=True) as cap:
            done = run.prefill.step(num_tokens)
        if done:
            self._write_rows(run, cap.taps)
        return done

    def replay(self, run, mode: str) -> None:
        """A prefix-cache hit: rebuild the windows of run's restored state (`model.replay`) and,
        from the same pass, the drafter's context rows of the replayed positions (the last
        `sliding_window` of them stay), as a full prefill would have left them."""
        with capture(self.model, taps=True) as cap:
            self.model.replay(run.state, mode)
        run.draft = None
        self._write_rows(run, cap.taps)

    # ---------------------------------------------------------------- propose
    def draft(self, reqs, runs, anchors: torch.Tensor, P: torch.Tensor):
        """One block per sequence: (draft tokens [B, N], draft logits [B, N, V], confidence
        [B, N]); greedy rows take the argmax, sampled rows draw from their draft distribution."""
        states = [u.draft for u in runs]
        h, base = self.drafter(states, anchors, P)

        def choose(logits, i):
            out = logits.argmax(-1)
            for b, r in enumerate(reqs):
                if not r.params.greedy:
                    out[b] = torch.multinomial(probs(logits[b], r.params), 1, generator=runs[b].generator)[0]
            return out
        return dspark.markov_decode(self.model, h, base, anchors, choose)

    @torch.no_grad()
    def propose(self, reqs, runs, tokens_left: list[int]) -> Proposal:
        """Draft a block for each running sequence (reqs, their runtimes); tokens_left[b]: what
        sequence b may still emit (max_tokens, max_model_len), so it verifies at most one fewer."""
        t0 = time.perf_counter()
        for u in runs:
            if u.draft is None:
                u.draft = self.new_draft_state()       # context fills as it decodes
        dev = self.device
        anchors = torch.tensor([r.output_ids[-1] for r in reqs], device=dev)
        P = torch.tensor([u.state.num_tokens for u in runs], device=dev)
        drafts, dlogits, conf = self.draft(reqs, runs, anchors, P)
        k = []
        for b, left in enumerate(tokens_left):
            kb = max(0, min(self.k_max, left - 1))
            if self.cfg.threshold > 0:
                surv = torch.cumprod(conf[b], 0)
                kb = min(kb, int((surv >= self.cfg.threshold).sum()))
            k.append(kb)
        counted = [w and left - 1 >= self.k_max for w, left in zip(self._warm(runs, P), tokens_left)]
        self.stats.draft_s += time.perf_counter() - t0
        return Proposal(anchors, P, drafts, dlogits, k, counted)

    def note_emitted(self, n: int = 1) -> None:
        """The engine emitted n verified tokens (fewer than kept when a stop ended the request)."""
        self.stats.emitted += n

    # ---------------------------------------------------------------- verify
    @torch.no_grad()
    def verify(self, prop: Proposal, reqs, runs) -> list[list[tuple[int, float]]]:
        """One target forward over [anchor, drafts...] for the batch; per sequence the kept
        tokens (accepted drafts, then the target's own token) with their raw logprobs. The
        states end as if only the kept tokens had been appended, and the drafter's context is
        written."""
        st, k = self.stats, prop.k
        T = 1 + prop.num_lookahead
        t0 = time.perf_counter()
        ids = torch.cat((prop.anchors[:, None], prop.drafts[:, : T - 1]), 1)
        states = [u.state for u in runs]
        logits, taps, out = self.step(ids.cpu(), states)
        logits, taps = logits[:, :T], taps[:, :T]
        st.verify_s += time.perf_counter() - t0
        kept, emitted = [], []
        for b, r in enumerate(reqs):
            d = prop.drafts[b, : k[b]].tolist()
            if r.params.greedy:
                toks = accept_greedy(d, logits[b, : k[b] + 1].argmax(-1).tolist())
            else:
                q = probs(prop.draft_logits[b, : k[b]], r.params)
                p = probs(logits[b, : k[b] + 1], r.params)
                toks = accept_sampled(d, q, p, runs[b].generator)
            n_acc = len(toks) - 1
            st.steps += 1
            st.drafted += prop.drafts.shape[1]
            st.verified += k[b]
            st.accepted += n_acc
            for i in range(k[b]):
                st.verified_at[i] += 1
                st.accepted_at[i] += int(i < n_acc)
            kept.append(1 + n_acc)
            emitted.append(toks)
        if prop.counted is not None:
            rows = [b for b, c in enumerate(prop.counted) if c]
            seqs = [self._accept.setdefault(runs[b], self.policy.sequence_acceptance()) for b in rows]
            self.policy.observe_acceptance([kept[b] for b in rows], seqs)
        self.step.commit(ids.tolist(), states, out, kept)
        self.write_context([u.draft for u in runs], taps, prop.positions.tolist(), kept)
        lsm = torch.log_softmax(logits.float(), -1)
        out = []
        for b, toks in enumerate(emitted):
            at = torch.tensor(toks, device=lsm.device)
            lps = lsm[b, torch.arange(len(toks), device=lsm.device), at].tolist()
            out.append(list(zip(toks, lps)))
        return out
