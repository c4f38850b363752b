"""What the engine worker (server/worker.py) holds per request: the submission a handler queues
(`Submission`), the per-sequence record the engine thread keeps until the request finishes
(`Track`), the engine ids of a request's samples, and the 400 a refused submission gets."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from cedlm.engine.request import Request
from cedlm.server.events import Failed


@dataclass
class Track:
    """One engine sequence the worker publishes events for."""
    req: Request                          # read only here: its status, for the queue timeout
    q: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    submitted: float
    # admitted with its leader: sample 0 of the group for the other samples; the first prompt's
    # sample 0 for a later prompt of the same HTTP request (it waits behind its own request's
    # share of the slots, not in the queue: no queue timeout)
    leader: "Track | None" = None
    admitted: bool = False
    cached: int = 0
    prompt_logprobs: list | None = None  # scored prompt not yet sent (goes on the next event)


@dataclass
class Submission:
    """A request a handler queued on the worker's command queue (`EngineWorker.submit_samples`)."""
    request_id: str
    prompt_ids: list[int]
    params: Any
    qs: list[asyncio.Queue]              # one per sample (SamplingParams.n / best_of)
    loop: asyncio.AbstractEventLoop
    submitted: float = field(default_factory=time.monotonic)
    images: list | None = None           # prepared images (vision models; Engine.add_samples)
    owner: str | None = None             # the HTTP request of several prompts it belongs to (fair share)


def sample_ids(request_id: str, k: int) -> list[str]:
    """The engine ids of a request's k samples (`Engine.add_samples`)."""
    return [request_id] if k == 1 else [f"{request_id}-{i}" for i in range(k)]


def param_of(message: str) -> str | None:
    """The parameter an engine error message names first ("max_tokens: ..." -> "max_tokens")."""
    head = message.split(":", 1)[0].split(" ", 1)[0].strip()
    return head if head.isidentifier() else None


def refused(message: str, *, rejected: bool) -> Failed:
    """The 400 of a submission the engine refused: `rejected` for the scheduler's RequestRejected
    (a request that can never fit: context_length_exceeded or request_too_large), else a bad value."""
    if not rejected:
        return Failed(400, message, param=param_of(message))
    code = "context_length_exceeded" if "max_model_len" in message else "request_too_large"
    return Failed(400, message, param=param_of(message), code=code)
