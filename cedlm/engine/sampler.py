"""Token sampling for the inference engine: ``Sampler``, its ``SamplerOutput``, ``make_generator``.

``Sampler`` turns a batch of next-token logits ``[B, V]`` into token ids, one row per request, each
row with its own ``SamplingParams`` (``cedlm.engine.sampling_params``). Processing order per row:
the logits pipeline of ``process_logits`` (only for rows whose params ask for it:
``allowed_token_ids``, ``logit_bias``, ``logits_processors``, then the repetition, frequency and
presence penalties, which need the row's prompt and generated ids, ``histories``), then
temperature, then top-k, then top-p (top-p is taken over the top-k-renormalised distribution, as
in vLLM and HF). A ``top_k`` above the vocabulary size is clamped to it (i.e. keeps every token).
Rows with ``temperature < GREEDY_EPS`` take ``argmax`` of the (processed) logits (ties: lowest id)
and consume no randomness. Rows with nothing to process use the model's logits as they are.

Random rows use the *exponential race* (equivalently the Gumbel-max trick): with
``q_i ~ Exp(1)`` i.i.d., ``argmax_i p_i / q_i`` is distributed as ``Categorical(p)``. Each
row's noise ``q`` (one draw per vocabulary entry) comes from that row's own ``torch.Generator``
when it has one, so a seeded request yields the same tokens from the same logits regardless of
which other requests share the batch or where it sits in it. Rows without a generator share a
single batched draw from torch's global generator for the device.

Logprobs follow vLLM's convention: they are computed from the *raw* model distribution,
``log_softmax(logits)`` of the unmodified logits, not from the temperature-scaled / truncated
distribution the token was drawn from. The sampled token's logprob is returned for every row;
the top-``k`` alternatives only for rows with ``params.logprobs = k > 0``.

Stop handling lives in ``cedlm.engine.stop``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from cedlm.engine.sampling_params import SamplingParams



class ConstraintConflict(ValueError):
    """A request's own constraints (allowed_token_ids, logit_bias, a grammar) leave no token to
    sample: a fault of the request, not of the engine (the server answers 400 and stays ready).
    Its name starts the request's `error` text (`StepOutput.error`)."""


class ConstraintTimeout(RuntimeError):
    """A logits processor's work for the next token (a grammar's token mask) did not arrive within
    its deadline: the request is failed alone, the server answers 400 naming the constraint. Its
    message starts with the constraint's parameter (``"guided_regex: ..."``); its name starts the
    request's `error` text."""


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator for one request: seeded with ``seed`` on ``device``; None (global RNG) without a seed.

    Negative seeds are mapped to their 64-bit two's-complement value.
    """
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


class SamplerOutput(NamedTuple):
    """token_ids [B] int64; logprobs [B] fp32 (raw log_softmax at the sampled token);
    top_logprobs[b] = (ids [k] int64, logprobs [k] fp32) of the k most likely tokens under the raw
    distribution for rows with ``logprobs = k > 0``, else None."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    top_logprobs: list[tuple[torch.Tensor, torch.Tensor] | None]


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k / top-p set; returns a new tensor.

    logits [n, V]; k [n] int64 (values >= V mean off) or None; p [n] float (values >= 1 mean off)
    or None. Ranks come from a stable descending sort, so among equal logits the lower ids rank
    first and top-k keeps exactly k tokens. Top-p is taken over the distribution left by top-k: a
    token is kept when the probability mass ranked strictly above it is < p, i.e. the kept set is
    the smallest prefix whose cumulative probability reaches p (the top token is always kept).
    """
    V = logits.shape[-1]
    srt, idx = logits.sort(dim=-1, descending=True, stable=True)
    if k is not None:
        ranks = torch.arange(V, device=logits.device)
        srt = srt.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    if p is not None:
        probs = srt.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        above = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # exclusive cumsum
        drop = above >= p[:, None]
        drop[:, 0] = False
        srt = srt.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, srt)


def apply_penalties(row: torch.Tensor, params: SamplingParams, prompt_ids, output_ids) -> torch.Tensor:
    """vLLM's penalties on one row [V] (fp32): repetition over the tokens of prompt + output (a
    positive logit divided by the penalty, a negative one multiplied), then frequency (times the
    count in the output) and presence (once per token present in the output) subtracted."""
    V = row.shape[-1]
    dev = row.device
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(V, dtype=torch.bool, device=dev)
        ids = list(prompt_ids) + list(output_ids)
        if ids:
            seen[torch.tensor(ids, dtype=torch.long, device=dev)] = True
        rp = params.repetition_penalty
        row = torch.where(seen, torch.where(row > 0, row / rp, row * rp), row)
    if (params.frequency_penalty or params.presence_penalty) and len(output_ids):
        counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long, device=dev),
                                minlength=V)[:V].to(row.dtype)
        row = row - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(row.dtype)
    return row


def process_logits(logits: torch.Tensor, params: list[SamplingParams], histories=None) -> torch.Tensor:
    """The logits pipeline before temperature / top-k / top-p, for the rows whose params ask for
    it (``SamplingParams.processes_logits``): allowed_token_ids, logit_bias, logits_processors,
    then the penalties. ``histories[b] = (prompt_ids, output_ids)`` of row b (None: empty).
    Returns ``logits`` itself when no row needs processing, else a new fp32 tensor. A row left
    with no finite logit (every token masked) or with a NaN raises ValueError."""
    rows = [b for b, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    out = logits.float().clone()
    V = out.shape[-1]
    for b in rows:
        p = params[b]
        prompt_ids, output_ids = histories[b] if histories is not None and histories[b] is not None else ((), ())
        row = out[b].clone()
        if p.allowed_token_ids is not None:
            keep = torch.zeros(V, dtype=torch.bool, device=row.device)
            keep[torch.tensor(p.allowed_token_ids, dtype=torch.long, device=row.device)] = True
            row = row.masked_fill(~keep, float("-inf"))
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=row.device)
            row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device)
        for fn in p.logits_processors or ():
            got = fn(list(output_ids), row)
            if not isinstance(got, torch.Tensor) or tuple(got.shape) != (V,):
                raise ValueError(f"logits_processors: {fn!r} must return a tensor of shape [{V}], "
                                 f"got {type(got).__name__} {tuple(getattr(got, 'shape', ()))}")
            row = got.to(dtype=torch.float32, device=out.device)
        row = apply_penalties(row, p, prompt_ids, output_ids)
        if torch.isnan(row).any() or (row == float("inf")).any():
            raise ValueError("logits_processors: the processed logits contain NaN or +inf")
        if not torch.isfinite(row).any():
            raise ConstraintConflict("allowed_token_ids / logit_bias / logits_processors: every token is masked "
                                     "(no finite logit left)")
        out[b] = row
    return out


class Sampler:
    """Batched next-token sampler; see the module docstring for the algorithm and conventions."""

    def __call__(self, logits, params, generators=None, histories=None) -> SamplerOutput:
        return self.sample(logits, params, generators, histories)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None] | None = None,
        histories: list[tuple[list[int], list[int]] | None] | None = None,
    ) -> SamplerOutput:
        """Sample one token per row of ``logits`` [B, V].

        ``params[b]`` and ``generators[b]`` (None = global RNG; a generator must live on the logits'
        device, see ``make_generator``) belong to row b. ``generators=None`` means all None.
        ``histories[b] = (prompt_ids, output_ids)`` of row b, for the penalties and the logits
        processors (None: no history).
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        B, V = logits.shape
        if len(params) != B:
            raise ValueError(f"got {len(params)} SamplingParams for {B} rows of logits")
        if generators is None:
            generators = [None] * B
        elif len(generators) != B:
            raise ValueError(f"got {len(generators)} generators for {B} rows of logits")
        dev = logits.device
        for g in generators:
            if g is not None and torch.device(g.device).type != dev.type:
                raise ValueError(f"generator on {g.device} but logits on {dev}; use make_generator(seed, device)")
        if histories is not None and len(histories) != B:
            raise ValueError(f"got {len(histories)} histories for {B} rows of logits")
        logits = logits.float()

        # Raw-distribution logprobs (vLLM convention): lp = logit - logsumexp(logits).
        lse = torch.logsumexp(logits, dim=-1)                                  # [B]
        work = process_logits(logits, params, histories)                      # what is sampled from

        token_ids = torch.empty(B, dtype=torch.long, device=dev)
        greedy = [b for b in range(B) if params[b].greedy]
        rand = [b for b in range(B) if not params[b].greedy]
        if greedy:
            gi = torch.tensor(greedy, device=dev)
            token_ids[gi] = work[gi].argmax(dim=-1)     # first maximum = lowest id on ties
        if rand:
            token_ids[torch.tensor(rand, device=dev)] = self._sample_random(
                work, [params[b] for b in rand], [generators[b] for b in rand], rand
            )

        logprobs = logits.gather(1, token_ids[:, None]).squeeze(1) - lse
        top: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * B
        kmax = max((p.logprobs or 0) for p in params)
        if kmax > 0:
            vals, ids = logits.topk(min(kmax, V), dim=-1)
            vals = vals - lse[:, None]
            for b, p in enumerate(params):
                if p.logprobs:
                    top[b] = (ids[b, : p.logprobs], vals[b, : p.logprobs])
        return SamplerOutput(token_ids, logprobs, top)

    @staticmethod
    def _sample_random(logits, params, generators, rows) -> torch.Tensor:
        dev = logits.device
        V = logits.shape[-1]
        x = logits[torch.tensor(rows, device=dev)]
        temp = torch.tensor([p.temperature for p in params], dtype=x.dtype, device=dev)
        x = x / temp[:, None]
        ks = [min(p.top_k, V) if p.top_k > 0 else V for p in params]   # k > V keeps all V
        ps = [p.top_p for p in params]
        use_k = any(k < V for k in ks)
        use_p = any(p < 1.0 for p in ps)
        if use_k or use_p:
            k = torch.tensor(ks, device=dev) if use_k else None
            p = torch.tensor([v if v < 1.0 else 2.0 for v in ps], dtype=x.dtype, device=dev) if use_p else None
            x = apply_top_k_top_p(x, k, p)
        probs = x.softmax(dim=-1)

        # Exponential race: argmax(probs / q), q ~ Exp(1) per vocabulary entry.
        q = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if len(unseeded) == len(generators):
            q.exponential_()
        else:
            if unseeded:
                ui = torch.tensor(unseeded, device=dev)
                q[ui] = torch.empty(len(unseeded), V, device=dev).exponential_()
            for i, g in enumerate(generators):
                if g is not None:
                    q[i].exponential_(generator=g)
        # exponential_ may return exactly 0; a clamp keeps 0-probability (masked) tokens at 0
        # instead of 0/0 = NaN, which argmax would pick.
        q.clamp_min_(torch.finfo(q.dtype).tiny)
        return (probs / q).argmax(dim=-1)
