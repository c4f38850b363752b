"""Token sampling for the inference engine: ``Sampler``, its ``SamplerOutput``, ``make_generator``.

``Sampler`` turns a batch of next-token logits ``[B, V]`` into token ids, one row per request, each
row with its own ``SamplingParams`` (``cedlm.engine.sampling_params``). Processing order per row:
temperature, then top-k, then top-p (top-p is taken over the top-k-renormalised distribution, as in
vLLM and HF). A ``top_k`` above the vocabulary size is clamped to it (i.e. keeps every token). Rows
with ``temperature < GREEDY_EPS`` take ``argmax`` of the raw logits (ties: lowest id) and consume
no randomness.

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


class Sampler:
    """Batched next-token sampler; see the module docstring for the algorithm and conventions."""

    def __call__(self, logits, params, generators=None) -> SamplerOutput:
        return self.sample(logits, params, generators)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None] | None = None,
    ) -> SamplerOutput:
        """Sample one token per row of ``logits`` [B, V].

        ``params[b]`` and ``generators[b]`` (None = global RNG; a generator must live on the logits'
        device, see ``make_generator``) belong to row b. ``generators=None`` means all None.
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
        logits = logits.float()

        # Raw-distribution logprobs (vLLM convention): lp = logit - logsumexp(logits).
        lse = torch.logsumexp(logits, dim=-1)                                  # [B]

        token_ids = torch.empty(B, dtype=torch.long, device=dev)
        greedy = [b for b in range(B) if params[b].greedy]
        rand = [b for b in range(B) if not params[b].greedy]
        if greedy:
            gi = torch.tensor(greedy, device=dev)
            token_ids[gi] = logits[gi].argmax(dim=-1)   # first maximum = lowest id on ties
        if rand:
            token_ids[torch.tensor(rand, device=dev)] = self._sample_random(
                logits, [params[b] for b in rand], [generators[b] for b in rand], rand
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
