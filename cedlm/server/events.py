"""The events the engine worker publishes on a request's asyncio.Queue (server/worker.py):

    Admitted(cached_tokens)        the scheduler took it (KV reserved); always first, unless Failed
    Delta(text, token_ids, ...)    what one engine step produced for it
    Finished(reason, ...)          last event
    Failed(status, message, ...)   instead of any of the above (400 rejected, 429 full, 500)

The scored prompt (`prompt_logprobs`) rides on the first Delta, or on the Finished when no token
was sampled. All values are plain Python numbers and strings."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Admitted:
    cached_tokens: int


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[tuple[list[int], list[float]]] | None
    prompt_logprobs: list | None = None     # once, on the first event after the prompt was scored


@dataclass
class Finished:
    reason: str
    num_prompt: int
    num_output: int
    cached_tokens: int
    prompt_logprobs: list | None = None     # when no Delta carried them


@dataclass
class Failed:
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = "invalid_request_error"
    retry_after: int | None = None
    request_id: str | None = None        # set on a 500: the id its details were logged under
