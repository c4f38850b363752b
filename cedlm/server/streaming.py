"""One request's engine events, as the chat and completions handlers see them.

`RequestEvents` submits a request to the engine worker and is an async iterator over the events
the worker publishes for it: `Admitted` (always first unless `Failed`), then `Delta`s, then
`Finished`; or a single `Failed`. Iteration ends after `Finished` / `Failed`, or early when the
client disconnects; then the request is aborted (its KV blocks are freed by the engine thread) and
counted in the disconnect metric.

Both endpoints use the same iterator for both response kinds and only format its events:
`admit` waits for admission (a refusal is raised as an `APIError`, so it is an HTTP error, not a
stream), `collect` gathers the rest into an `Output` for a JSON response, and `sse_response`
streams it as server-sent events, the formatter turning each `Delta` / `Finished` into chunks.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterable

from fastapi import Request
from fastapi.responses import StreamingResponse

from cedlm.engine.sampling_params import SamplingParams
from cedlm.server.errors import APIError
from cedlm.server.worker import Admitted, Delta, Failed, Finished

DONE = "data: [DONE]\n\n"
_DISCONNECTED = object()


def sse(obj) -> str:
    if hasattr(obj, "model_dump"):
        obj = obj.model_dump(exclude_none=True)
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class RequestEvents:
    """The events of one request (see the module docstring); `close()` when done with it.

    While watching (from the first event on), a task reads the ASGI `receive` channel to notice a
    disconnect. `sse_response` stops it: Starlette's StreamingResponse watches for the disconnect
    itself and cancels the stream, and two readers of `receive` would compete for the message.
    """

    def __init__(self, worker, metrics, raw: Request, prefix: str, prompt_ids: list[int],
                 params: SamplingParams):
        self.worker, self.metrics, self.raw = worker, metrics, raw
        self.rid = f"{prefix}-{uuid.uuid4().hex}"
        self.prompt_ids, self.params = prompt_ids, params
        self.cached = 0                # prompt tokens served by the prefix cache (from Admitted)
        self.done = False
        self.q: asyncio.Queue | None = None
        self.watcher: asyncio.Task | None = None

    def __aiter__(self) -> "RequestEvents":
        return self

    async def __anext__(self) -> Admitted | Delta | Finished | Failed:
        if self.q is None:
            self.q = self.worker.submit(self.rid, self.prompt_ids, self.params)
            self.watch(True)
        if self.done:
            raise StopAsyncIteration
        ev = await self.q.get()
        if ev is _DISCONNECTED:
            self.close()
            raise StopAsyncIteration
        if isinstance(ev, Admitted):
            self.cached = ev.cached_tokens
        elif isinstance(ev, (Finished, Failed)):
            self.done = True
        return ev

    async def _watch(self) -> None:
        while True:
            msg = await self.raw.receive()
            if msg["type"] == "http.disconnect":
                self.q.put_nowait(_DISCONNECTED)
                return

    def watch(self, on: bool) -> None:
        if on and self.watcher is None:
            self.watcher = asyncio.ensure_future(self._watch())
        elif not on and self.watcher is not None:
            self.watcher.cancel()
            self.watcher = None

    async def admit(self) -> bool:
        """Submit and wait until admitted. False: the client went away. Raises APIError (400/429...)."""
        ev = await anext(self, None)
        if ev is None:
            return False
        if isinstance(ev, Failed):
            self.close()
            raise APIError.from_failed(ev)
        assert isinstance(ev, Admitted), ev
        return True

    def close(self) -> None:
        self.watch(False)
        if not self.done and self.q is not None:   # the client went away (or the handler was cancelled)
            self.done = True
            self.metrics.disconnects.inc()
            self.worker.abort(self.rid)


@dataclass
class Output:
    """A finished request's output, gathered from its deltas."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list | None = None         # [(ids, logprobs)] per token when asked for
    finish_reason: str | None = None


async def collect(events: RequestEvents, want_top: bool) -> Output | None:
    """The events of an admitted request until it finishes; None when the client went away (the
    request is aborted). Raises APIError when the engine failed it."""
    out = Output(top_logprobs=[] if want_top else None)
    try:
        async for ev in events:
            if isinstance(ev, Failed):
                raise APIError.from_failed(ev)
            if isinstance(ev, Delta):
                out.text += ev.text
                out.token_ids += ev.token_ids
                out.logprobs += ev.logprobs
                if out.top_logprobs is not None and ev.top_logprobs:
                    out.top_logprobs += ev.top_logprobs
            elif isinstance(ev, Finished):
                out.finish_reason = ev.reason
                return out
        return None
    finally:
        events.close()


def sse_response(events: RequestEvents, fmt: Callable[[Delta | Finished], Iterable[str]],
                 headers: dict, first: str | None = None) -> StreamingResponse:
    """Stream an admitted request: `first` (if any), `fmt(event)` for each Delta and the Finished,
    then `data: [DONE]`. An engine failure ends the stream with an error event and no [DONE]."""
    events.watch(False)          # from here StreamingResponse watches for the disconnect

    async def body():
        try:
            if first is not None:
                yield first
            async for ev in events:
                if isinstance(ev, Failed):
                    yield sse(APIError.from_failed(ev).body())
                    return
                for s in fmt(ev):
                    yield s
                if isinstance(ev, Finished):
                    yield DONE
        finally:
            events.close()

    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)
