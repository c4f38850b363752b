"""Per-request decoding settings: ``SamplingParams``, validated on construction.

A bad value raises ``ValueError`` whose message names the field. ``cedlm.engine.sampler`` draws
tokens under these settings and ``cedlm.engine.stop`` applies their stop conditions.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

GREEDY_EPS = 1e-5   # temperatures below this are treated as 0 (greedy); avoids overflow in logits / T
TOP_K_MAX = 2**31 - 1   # largest accepted top_k; values above the vocabulary size are clamped when sampling
LOGIT_BIAS_MAX = 100.0  # |bias| bound, as OpenAI and vLLM
PENALTY_MAX = 2.0       # |presence_penalty|, |frequency_penalty| bound, as OpenAI and vLLM
# Largest accepted temperature: far above any useful value (OpenAI accepts up to 2) and far below
# where float32 overflows (3.4e38 becomes inf, and a masked logit -inf / inf is NaN: every
# constraint was bypassed and token 0 picked).
TEMPERATURE_MAX = 1e4
REPETITION_PENALTY_RANGE = (0.01, 100.0)

# (output_ids, logits [vocab] fp32) -> logits [vocab]: see ``SamplingParams.logits_processors``.
LogitsProcessor = Callable[[list, "torch.Tensor"], "torch.Tensor"]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Decoding settings of one request.

    max_tokens: number of tokens to generate at most (>= 1; 0 only with ``prompt_logprobs``);
        reaching it finishes with "length".
    temperature: softmax temperature in [0, ``TEMPERATURE_MAX``]; 0 (below ``GREEDY_EPS``) means
        greedy decoding.
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
    skip_special_tokens: leave special tokens (BOS, EOS, the turn and task markers; not
        ``<think>`` / ``</think>``: ``cedlm.text.special_tokens.KEEP_ON_SKIP``) out of the text, as
        vLLM's option of that name (the token ids and logprobs still carry them). Off by default
        here (the engine's text is the exact decode); the HTTP server defaults it to on, as vLLM.
    cache_salt: prefix-cache isolation (as vLLM's ``cache_salt``): requests share cached prefix
        blocks only when their salts are equal (None shares with other unsalted requests).

    prompt_logprobs: None = off; k >= 0 = score the prompt (vLLM semantics): for every prompt
        position after the first, the logprob of the actual prompt token, its rank and the top-k
        alternatives (raw ``log_softmax`` of the model's logits, as ``logprobs``); position 0 is
        None. Computed in the request's own prefill pass, which then runs the decoder over every
        prompt row (prefill mode ``full`` for this request whatever the engine's ``prefill_mode``:
        ``exact`` / ``bounded`` run it over the trailing rows only, which would leave the other
        rows unscored or approximate), and which does not start from prefix-cached blocks (a hit
        would skip the rows it covers); its full blocks are still published for later requests.
        With prompt_logprobs set, ``max_tokens`` may be 0: scoring only, no token is sampled and
        the request finishes with "length".
    n: number of samples returned for the prompt (>= 1). Sample i uses ``seed + i`` when a seed
        is given. The prompt is prefilled once; the other samples start from a copy of its
        state (shared prefix blocks), see ``Engine.add_samples``.
    best_of: None (= n) or the number of samples drawn (>= n); the n with the highest cumulative
        logprob (sum of the raw logprobs of the sampled tokens) are returned.
    presence_penalty: in [-2, 2]; subtracted from the logit of every token that occurs in the
        generated tokens (vLLM / OpenAI semantics). 0 disables it.
    frequency_penalty: in [-2, 2]; subtracted from each token's logit once per occurrence in the
        generated tokens. 0 disables it.
    repetition_penalty: in [0.01, 100]; for every token occurring in the prompt or the generated
        tokens, a positive logit is divided by it and a negative one multiplied by it (HF / vLLM
        semantics). 1 disables it.
    logit_bias: {token id: bias}, bias in [-100, 100], added to the logits before sampling
        (-100 in effect bans a token, +100 forces it). String keys of digits (JSON objects) are
        converted to ints. Ids are checked against the vocabulary when the request is added.
    allowed_token_ids: only these token ids can be sampled (every other logit is set to -inf).
    logits_processors: a list of callables ``fn(output_ids: list[int], logits: Tensor[vocab]) ->
        Tensor[vocab]``, applied in order before sampling, for every generated token (the hook
        for grammar-constrained decoding). ``output_ids`` is a copy of the tokens generated so
        far by this sample; ``logits`` is a float32 copy of the row (after ``allowed_token_ids``
        and ``logit_bias``, before the penalties, temperature, top-k and top-p) that the callable
        may modify in place and return, or return a new tensor of the same shape; ``-inf`` bans a
        token. A callable that raises fails only its own request (finish reason "error"). With
        n > 1 one callable object serves every sample (each call passes that sample's own
        output_ids): keep per-sequence state keyed on output_ids, not on call order.
        A callable whose work is slow may do it off the engine thread: with a method
        ``prepare(output_ids)`` the engine tells it, right after each token (and it may start
        for ``[]`` itself), which history it will be called with next, so it can start that work
        while the model runs; with ``wait(output_ids, timeout) -> bool`` the engine asks, before
        sampling, whether the call would block: a row whose work has not arrived within the
        step's short wait (``engine.MASK_WAIT_S``) is held back, its logits kept, and sampled at
        a later step when ``wait`` says so, while every other sequence keeps stepping; ``wait``
        raises (``sampler.ConstraintTimeout``) to end a request whose work is past its deadline.

    Order of the logits pipeline (per row): allowed_token_ids, logit_bias, logits_processors,
    repetition / frequency / presence penalty, then temperature, top-k, top-p. Greedy rows take
    the argmax after the same pipeline. Reported logprobs (``logprobs``, ``prompt_logprobs``) are
    always those of the raw model distribution.
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
    skip_special_tokens: bool = False
    cache_salt: str | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    logits_processors: list[LogitsProcessor] | None = None

    def __post_init__(self) -> None:
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs must be None or an integer >= 0, got {self.prompt_logprobs!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 0 or (
                self.max_tokens == 0 and self.prompt_logprobs is None):
            raise ValueError(f"max_tokens must be an integer >= 1 (0 only with prompt_logprobs, "
                             f"to score the prompt), got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or \
                not 0 <= self.temperature <= TEMPERATURE_MAX:
            raise ValueError(f"temperature must be a number in [0, {TEMPERATURE_MAX:g}], got {self.temperature!r}")
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
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(
                f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}"
            )

        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string or None, got {self.cache_salt!r}")
        self._check_samples()
        self._check_penalties()
        self._check_logits_hooks()

    def _check_samples(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise ValueError(f"best_of must be None or an integer >= n ({self.n}), got {self.best_of!r}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v) or abs(v) > PENALTY_MAX:
                raise ValueError(f"{name} must be a number in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}], got {v!r}")
            setattr(self, name, float(v))
        v = self.repetition_penalty
        # Bounded: logits are divided (or multiplied) by it, and a subnormal penalty turns a
        # finite logit into inf.
        if not _is_real(v) or not math.isfinite(v) or not REPETITION_PENALTY_RANGE[0] <= v <= REPETITION_PENALTY_RANGE[1]:
            raise ValueError(f"repetition_penalty must be a number in [{REPETITION_PENALTY_RANGE[0]:g}, "
                             f"{REPETITION_PENALTY_RANGE[1]:g}] (1 disables it), got {v!r}")
        self.repetition_penalty = float(v)

    def _check_logits_hooks(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict {{token id: bias}} or None, got {self.logit_bias!r}")
            bias: dict[int, float] = {}
            for k, v in self.logit_bias.items():
                tok = int(k) if isinstance(k, str) and k.strip().isdigit() else k
                if not _is_int(tok) or tok < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {k!r}")
                if not _is_real(v) or not math.isfinite(v) or abs(v) > LOGIT_BIAS_MAX:
                    raise ValueError(f"logit_bias values must be numbers in [-{LOGIT_BIAS_MAX:g}, "
                                     f"{LOGIT_BIAS_MAX:g}], got {v!r} for token {tok}")
                bias[tok] = float(v)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            if isinstance(self.allowed_token_ids, (str, bytes, dict)):
                raise ValueError(f"allowed_token_ids must be a list of token ids or None, "
                                 f"got {self.allowed_token_ids!r}")
            try:
                ids = list(self.allowed_token_ids)
            except TypeError:
                raise ValueError(f"allowed_token_ids must be a list of token ids or None, "
                                 f"got {self.allowed_token_ids!r}") from None
            if not ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")
            for t in ids:
                if not _is_int(t) or t < 0:
                    raise ValueError(f"allowed_token_ids must contain token ids (integers >= 0), got {t!r}")
            self.allowed_token_ids = ids
        if self.logits_processors is not None:
            if callable(self.logits_processors):
                self.logits_processors = [self.logits_processors]
            try:
                fns = list(self.logits_processors)
            except TypeError:
                raise ValueError(f"logits_processors must be a list of callables or None, "
                                 f"got {self.logits_processors!r}") from None
            for fn in fns:
                if not callable(fn):
                    raise ValueError(f"logits_processors must contain callables, got {fn!r}")
            self.logits_processors = fns or None

    # ---------------------------------------------------------------- derived
    @property
    def num_samples(self) -> int:
        """Samples drawn for the prompt: best_of when set, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def processes_logits(self) -> bool:
        """True when the sampler must change the logits before sampling (bias, allowed ids,
        processors or penalties); False keeps the raw logits untouched."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.logits_processors
                    or self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def for_sample(self, i: int) -> "SamplingParams":
        """The settings of sample i of an n / best_of request: one sample (n=1, best_of=None),
        seed + i when a seed is given (the same object for a plain single-sample request)."""
        if self.num_samples == 1 and i == 0:
            return self
        seed = None if self.seed is None else self.seed + i
        return dataclasses.replace(self, n=1, best_of=None, seed=seed)

    def token_ids_in_vocab(self, vocab_size: int) -> None:
        """Raise ValueError (naming the field) when logit_bias / allowed_token_ids hold an id
        outside [0, vocab_size)."""
        for name, ids in (("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0, i.e. below ``GREEDY_EPS``)."""
        return self.temperature < GREEDY_EPS
