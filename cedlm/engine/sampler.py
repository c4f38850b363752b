"""Token sampling and stop handling for the inference engine.

Three pieces:

``SamplingParams``
    Per-request decoding settings, validated on construction (a ``ValueError`` names the field).

``Sampler``
    Turns a batch of next-token logits ``[B, V]`` into token ids, one row per request, each row
    with its own settings. Processing order per row: temperature, then top-k, then top-p (top-p is
    taken over the top-k-renormalised distribution, as in vLLM and HF). Rows with
    ``temperature < GREEDY_EPS`` take ``argmax`` of the raw logits (ties: lowest id) and consume no
    randomness.

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

``StopChecker``
    Per-request stop logic over the incrementally decoded text: stop strings (also across token
    boundaries, holding back a tail that may begin one), stop token ids, EOS and ``max_tokens``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, NamedTuple

import torch

GREEDY_EPS = 1e-5   # temperatures below this are treated as 0 (greedy); avoids overflow in logits / T


# --------------------------------------------------------------------------- parameters


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Decoding settings of one request.

    max_tokens: number of tokens to generate at most (>= 1); reaching it finishes with "length".
    temperature: softmax temperature (>= 0); 0 (below ``GREEDY_EPS``) means greedy decoding.
    top_k: keep the k most likely tokens; 0 or -1 disables it.
    top_p: nucleus sampling, keep the smallest most-likely set with cumulative probability >= top_p
        (0 < top_p <= 1; 1 disables it).
    seed: per-request seed; with a seed the request's tokens do not depend on the rest of the batch.
    stop: stop string(s); the output ends before the first occurrence (normalised to a list).
    stop_token_ids: token ids that end generation (their text is not emitted unless
        ``include_stop_str_in_output``).
    ignore_eos: keep generating past the tokenizer's EOS.
    logprobs: None = off; 0 = logprob of the sampled token; k > 0 = also the top-k alternatives.
    include_stop_str_in_output: keep the matched stop string / stop token text in the output.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        self.temperature = float(self.temperature)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 1, or 0/-1 to disable, got {self.top_k!r}")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        self.top_p = float(self.top_p)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            try:
                self.stop = list(self.stop)
            except TypeError:
                raise ValueError(f"stop must be a string, a list of strings or None, got {self.stop!r}") from None
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings, got {s!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            try:
                self.stop_token_ids = list(self.stop_token_ids)
            except TypeError:
                raise ValueError(
                    f"stop_token_ids must be a list of integers or None, got {self.stop_token_ids!r}"
                ) from None
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must contain non-negative integers, got {t!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(
                f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}"
            )

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0, i.e. below ``GREEDY_EPS``)."""
        return self.temperature < GREEDY_EPS


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator for one request: seeded with ``seed`` on ``device``; None (global RNG) without a seed.

    Negative seeds are mapped to their 64-bit two's-complement value.
    """
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


# --------------------------------------------------------------------------- sampler


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
        ks = [p.top_k if p.top_k > 0 else V for p in params]
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


# --------------------------------------------------------------------------- stop checking


class StopResult(NamedTuple):
    finished: bool
    reason: str | None      # "stop" | "length" | None
    text: str               # newly releasable text (a delta; concatenating all deltas = output)


class StopChecker:
    """Stop logic of one request over its incrementally decoded text.

    Call ``update(token_id, text)`` once per generated token, with ``text`` the full text generated
    so far (including that token; it must extend the previous ``text``), or ``update_delta(token_id,
    delta)`` with only the new text. Each call returns ``StopResult(finished, reason, text)`` where
    ``text`` is the newly releasable output; the concatenation of all returned texts is the final
    output (``self.output``).

    Checks, in order:
      * EOS (``eos_token_id``, unless ``ignore_eos``) and ``stop_token_ids`` -> "stop"; the token's
        own text is dropped unless ``include_stop_str_in_output``.
      * stop strings, found anywhere in the text including across token boundaries -> "stop"; the
        output is cut before the earliest match (after it with ``include_stop_str_in_output``), and
        anything decoded after the match is discarded.
      * ``max_tokens`` tokens generated -> "length" (all text is released).
    While streaming, the longest tail of the text that is a proper prefix of some stop string is
    held back (not needed, hence not done, with ``include_stop_str_in_output``) and released once
    it can no longer begin a stop string. ``stop_reason`` records the matched string or token id.
    """

    def __init__(self, params: SamplingParams, eos_token_id: int | Iterable[int] | None = None):
        self.params = params
        self.stops: list[str] = list(params.stop or [])
        self.stop_ids = set(params.stop_token_ids or [])
        if params.ignore_eos or eos_token_id is None:
            self.eos_ids: set[int] = set()
        elif isinstance(eos_token_id, int):
            self.eos_ids = {eos_token_id}
        else:
            self.eos_ids = set(eos_token_id)
        self._hold = bool(self.stops) and not params.include_stop_str_in_output
        self.num_tokens = 0
        self.finished = False
        self.reason: str | None = None
        self.stop_reason: str | int | None = None
        self._text = ""
        self._emitted = 0

    @property
    def output(self) -> str:
        """Text released so far; the final output text once finished."""
        return self._text[: self._emitted]

    @property
    def held_back(self) -> str:
        return "" if self.finished else self._text[self._emitted:]

    def update_delta(self, token_id: int, delta: str) -> StopResult:
        return self.update(token_id, self._text + delta)

    def update(self, token_id: int, text: str) -> StopResult:
        if self.finished:
            raise RuntimeError("StopChecker.update called after the request finished")
        prev = len(self._text)
        if len(text) < prev:
            raise ValueError("text must extend the previously passed text (pass the full text so far)")
        self._text = text
        self.num_tokens += 1
        token_id = int(token_id)
        keep = self.params.include_stop_str_in_output

        if token_id in self.eos_ids or token_id in self.stop_ids:
            return self._finish("stop", token_id, len(text) if keep else prev)
        if self.stops:
            hit = self._find_stop(prev)
            if hit is not None:
                start, s = hit
                return self._finish("stop", s, start + len(s) if keep else start)
        if self.num_tokens >= self.params.max_tokens:
            return self._finish("length", None, len(text))

        safe = len(text) - self._held_len(text) if self._hold else len(text)
        safe = max(safe, self._emitted)
        out = text[self._emitted : safe]
        self._emitted = safe
        return StopResult(False, None, out)

    def finish(self, reason: str = "length") -> StopResult:
        """End the request for an outside reason (e.g. context limit); releases held-back text."""
        if self.finished:
            return StopResult(True, self.reason, "")
        return self._finish(reason, None, len(self._text))

    # ------------------------------------------------------------------ helpers

    def _finish(self, reason: str, stop_reason, end: int) -> StopResult:
        end = max(end, self._emitted)
        out = self._text[self._emitted : end]
        self._emitted = end
        self.finished, self.reason, self.stop_reason = True, reason, stop_reason
        return StopResult(True, reason, out)

    def _find_stop(self, prev: int) -> tuple[int, str] | None:
        """Earliest stop-string match that ends in the new text (text[prev:]); ties: list order."""
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = self._text.find(s, max(0, prev - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _held_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
