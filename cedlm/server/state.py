"""What the request handlers share: `ServerState`, stored as `app.state.server`.

It resolves model names, checks prompt lengths, builds `SamplingParams` from a request body and
renders token ids for logprobs. Engine sizes are read once, through `engine.max_model_len` and
`engine.snapshot()`; handlers never touch the engine otherwise (the worker thread owns it).

Tokenization runs in a worker thread (`tokenize`), never on the event loop, and a text that
cannot fit the prompt limit is refused before it is tokenized: a plain token covers at most
`max_token_chars` characters, so a text longer than 4 x that x the limit cannot fit.
"""
from __future__ import annotations

import time
from typing import Callable, TypeVar

from starlette.concurrency import run_in_threadpool

from cedlm.engine.sampling_params import SamplingParams
from cedlm.server.aliases import DEPRECATION_HEADER, AliasTable, ModelNotFound, Resolved
from cedlm.server.errors import APIError, model_not_found
from cedlm.server.metrics import Metrics
from cedlm.server.worker import EngineWorker


T = TypeVar("T")


def finite_logprob(x: float) -> float:
    return max(float(x), -9999.0)          # JSON has no -inf


def _max_token_chars(tok) -> int | None:
    try:
        return max(len(k) for k in tok.hf.get_vocab(with_added_tokens=True))
    except Exception:                          # noqa: BLE001 - no bound then, only the check after
        return None


class ServerState:
    def __init__(self, engine, tokenizer, aliases: AliasTable, worker: EngineWorker, metrics: Metrics,
                 max_prompt_tokens: int | None = None):
        self.tok, self.aliases, self.worker, self.metrics = tokenizer, aliases, worker, metrics
        self.max_model_len = engine.max_model_len
        self.max_prompt_tokens = min(self.max_model_len, max_prompt_tokens or self.max_model_len)
        self.pool_tokens = engine.snapshot().pool_tokens
        self.created = int(time.time())
        self.max_token_chars = _max_token_chars(tokenizer) if tokenizer is not None else None
        if tokenizer is not None and hasattr(tokenizer, "encode_plain"):
            tokenizer.encode_plain("")         # build the plain encoder now, not in a request

    async def tokenize(self, fn: Callable[[], T]) -> T:
        """Run a tokenizing function off the event loop."""
        return await run_in_threadpool(fn)

    def check_chars(self, n_chars: int, param: str) -> None:
        """Refuse, before tokenizing, a text too long to fit the prompt limit in any case."""
        if self.max_token_chars and n_chars > 4 * self.max_token_chars * self.max_prompt_tokens:
            raise APIError(400, f"{param}: the prompt has {n_chars} characters, far more than the prompt "
                                f"limit of {self.max_prompt_tokens} tokens can hold", param=param,
                           code="context_length_exceeded")

    def resolve(self, name) -> Resolved:
        try:
            return self.aliases.resolve(name)
        except ModelNotFound as e:
            raise model_not_found(str(e)) from None

    def check_len(self, ids: list[int], param: str) -> None:
        if len(ids) > self.max_prompt_tokens:
            limit = (f"the context (max_model_len {self.max_model_len})"
                     if self.max_prompt_tokens == self.max_model_len
                     else f"the server's prompt limit (max_prompt_tokens {self.max_prompt_tokens})")
            raise APIError(400, f"{param}: the prompt has {len(ids)} tokens, more than {limit}", param=param,
                           code="context_length_exceeded")

    def params(self, body, n_prompt: int, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if max_tokens is None:
            max_tokens = max(1, min(self.max_model_len, self.pool_tokens) - n_prompt)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=0 if body.top_k is None else body.top_k,
                seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos, logprobs=logprobs,
                include_stop_str_in_output=body.include_stop_str_in_output, cache_salt=body.cache_salt)
        except ValueError as e:
            msg = str(e)
            raise APIError(400, msg, param=msg.split(" ", 1)[0].rstrip(":")) from None

    def headers(self, resolved: Resolved, extra: dict | None = None) -> dict:
        h = dict(extra or {})
        if resolved.deprecated:
            h[DEPRECATION_HEADER] = resolved.header
        return h

    def tok_text(self, i: int) -> str:
        return self.tok.decode([i]) if self.tok is not None else str(i)

    def tok_bytes(self, i: int) -> list[int] | None:
        return list(self.tok.token_bytes(i)) if self.tok is not None else None
