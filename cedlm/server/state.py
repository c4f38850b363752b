"""What the request handlers share: `ServerState`, stored as `app.state.server`.

It resolves model names, checks prompt lengths, builds `SamplingParams` from a request body and
renders token ids for logprobs. Engine sizes are read once, through `engine.max_model_len` and
`engine.snapshot()`; handlers never touch the engine otherwise (the worker thread owns it).
"""
from __future__ import annotations

import time

from cedlm.engine.sampling_params import SamplingParams
from cedlm.server.aliases import DEPRECATION_HEADER, AliasTable, ModelNotFound, Resolved
from cedlm.server.errors import APIError, model_not_found
from cedlm.server.metrics import Metrics
from cedlm.server.worker import EngineWorker


def finite_logprob(x: float) -> float:
    return max(float(x), -9999.0)          # JSON has no -inf


class ServerState:
    def __init__(self, engine, tokenizer, aliases: AliasTable, worker: EngineWorker, metrics: Metrics):
        self.tok, self.aliases, self.worker, self.metrics = tokenizer, aliases, worker, metrics
        self.max_model_len = engine.max_model_len
        self.pool_tokens = engine.snapshot().pool_tokens
        self.created = int(time.time())

    def resolve(self, name) -> Resolved:
        try:
            return self.aliases.resolve(name)
        except ModelNotFound as e:
            raise model_not_found(str(e)) from None

    def check_len(self, ids: list[int], param: str) -> None:
        if len(ids) > self.max_model_len:
            raise APIError(400, f"{param}: the prompt has {len(ids)} tokens, more than the context "
                                f"(max_model_len {self.max_model_len})", param=param,
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
                include_stop_str_in_output=body.include_stop_str_in_output)
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
