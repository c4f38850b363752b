"""Per-request decoding settings: ``SamplingParams``, validated on construction.

A bad value raises ``ValueError`` whose message names the field. ``cedlm.engine.sampler`` draws
tokens under these settings and ``cedlm.engine.stop`` applies their stop conditions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GREEDY_EPS = 1e-5   # temperatures below this are treated as 0 (greedy); avoids overflow in logits / T
TOP_K_MAX = 2**31 - 1   # largest accepted top_k; values above the vocabulary size are clamped when sampling


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Decoding settings of one request.

    max_tokens: number of tokens to generate at most (>= 1); reaching it finishes with "length".
    temperature: softmax temperature (>= 0); 0 (below ``GREEDY_EPS``) means greedy decoding.
    top_k: keep the k most likely tokens (1 <= k <= 2**31 - 1; a k above the vocabulary size keeps
        every token); 0 or -1 disables it.
    top_p: nucleus sampling, keep the smallest most-likely set with cumulative probability >= top_p
        (0 < top_p <= 1; 1 disables it).
    seed: per-request seed; with a seed the request's tokens do not depend on the rest of the batch.
    stop: stop string(s); the output ends before the first occurrence (normalised to a list).
    stop_token_ids: token ids that end generation (their text is not emitted unless
        ``include_stop_str_in_output``).
    ignore_eos: keep generating past the tokenizer's EOS.
    logprobs: None = off; 0 = logprob of the sampled token; k > 0 = also the top-k alternatives.
    include_stop_str_in_output: keep the matched stop string / stop token text in the output.
    cache_salt: prefix-cache isolation (as vLLM's ``cache_salt``): requests share cached prefix
        blocks only when their salts are equal (None shares with other unsalted requests).
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
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        self.temperature = float(self.temperature)
        if not _is_int(self.top_k) or not (-1 <= self.top_k <= TOP_K_MAX):
            raise ValueError(
                f"top_k: must be an integer in [-1, {TOP_K_MAX}] (0 or -1 disables it), got {self.top_k!r}"
            )
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

        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string or None, got {self.cache_salt!r}")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0, i.e. below ``GREEDY_EPS``)."""
        return self.temperature < GREEDY_EPS
