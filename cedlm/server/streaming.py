"""The engine events of one HTTP request's sequences, as the chat and completions handlers see them.

One HTTP request may run several engine requests: one per sample (``n``, ``best_of``: the
samples of a prompt are one engine group, prefilled once) and per prompt (a list of prompts on
/v1/completions). `Group` submits them and holds them. Each `RequestEvents` is an async iterator
over the events the worker publishes for one sample: `Admitted` (always first unless `Failed`), then `Delta`s, then `Finished`; or a single
`Failed`. Iteration ends after `Finished` / `Failed`, or early when the client disconnects; then
every request of the group is aborted (their KV blocks are freed by the engine thread) and counted
in the disconnect metric.

Both endpoints format the same events for both response kinds: `Group.admit` submits every
sequence and waits until all are admitted (a refusal of any is raised as an `APIError`, so it is
an HTTP error, not a stream, and the others are aborted), `Group.collect` gathers the rest into
one `Output` per sequence for a JSON response, and `Group.stream` streams them as server-sent
events, merged in arrival order, the formatter turning each `(sequence, Delta | Finished)` into
chunks.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Callable, Iterable

from fastapi import Request
from fastapi.responses import StreamingResponse

from cedlm.engine.sampling_params import SamplingParams
from cedlm.server.errors import APIError
from cedlm.server.tracing import engine_request_id
from cedlm.server.worker import Admitted, Delta, Failed, Finished, sample_ids

DONE = "data: [DONE]\n\n"
_DISCONNECTED = object()


def sse(obj) -> str:
    if hasattr(obj, "model_dump"):
        obj = obj.model_dump(exclude_none=True)
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class RequestEvents:
    """The events of one engine request (one sample of a prompt; see the module docstring), read
    from the queue the worker publishes them on; `close()` when done with it."""

    def __init__(self, worker, metrics, rid: str, q: asyncio.Queue):
        self.worker, self.metrics, self.rid, self.q = worker, metrics, rid, q
        self.cached = 0                # prompt tokens served by the prefix cache (from Admitted)
        self.done = False

    def __aiter__(self) -> "RequestEvents":
        return self

    async def __anext__(self) -> Admitted | Delta | Finished | Failed:
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

    def disconnected(self) -> None:
        self.q.put_nowait(_DISCONNECTED)

    def close(self) -> None:
        if not self.done:              # the client went away (or the handler was cancelled)
            self.done = True
            self.metrics.disconnects.inc()
            self.worker.abort(self.rid)


@dataclass
class Output:
    """A finished sequence's output, gathered from its deltas."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list | None = None         # [(ids, logprobs)] per token when asked for
    finish_reason: str | None = None
    prompt_logprobs: list | None = None      # the engine's entries, when asked for

    @property
    def cumulative_logprob(self) -> float:
        return float(sum(self.logprobs))


class Group:
    """The engine requests of one HTTP request (module docstring). `prompts` = [(prompt ids,
    params)]; prompt p runs `params.num_samples` samples as one engine group, under the engine id
    `rid` (one prompt) or `f"{rid}-p{p}"`. `events` lists every sample, prompt by prompt; `first[p]`
    is the index of prompt p's first sample."""

    def __init__(self, worker, metrics, raw: Request, prefix: str,
                 prompts: list[tuple[list[int], SamplingParams]], images: list | None = None):
        self.worker, self.raw, self.metrics = worker, raw, metrics
        self.images = images or None          # prepared images of a one-prompt chat request
        self.rid = engine_request_id(raw, prefix)     # carries the x-request-id (server/tracing.py)
        self.prompts = prompts
        self.events: list[RequestEvents] = []
        self.first: list[int] = []
        self.watcher: asyncio.Task | None = None

    def submit(self) -> None:
        for p, (ids, params) in enumerate(self.prompts):
            gid = self.rid if len(self.prompts) == 1 else f"{self.rid}-p{p}"
            owner = self.rid if len(self.prompts) > 1 else None    # fair share (server/worker.py)
            qs = (self.worker.submit_samples(gid, ids, params, images=self.images) if self.images
                  else self.worker.submit_samples(gid, ids, params, owner=owner))
            self.first.append(len(self.events))
            self.events += [RequestEvents(self.worker, self.metrics, rid, q)
                            for rid, q in zip(sample_ids(gid, len(qs)), qs)]

    def cached(self, p: int = 0) -> int:
        """Prompt tokens of prompt p served by the prefix cache (from its first sample)."""
        return self.events[self.first[p]].cached

    async def _watch(self) -> None:
        while True:
            msg = await self.raw.receive()
            if msg["type"] == "http.disconnect":
                for e in self.events:
                    e.disconnected()
                return

    def watch(self, on: bool) -> None:
        """Watch the ASGI `receive` channel for a disconnect (only while nobody else reads it:
        `stream` stops it, since Starlette's StreamingResponse watches for the disconnect itself)."""
        if on and self.watcher is None:
            self.watcher = asyncio.ensure_future(self._watch())
        elif not on and self.watcher is not None:
            self.watcher.cancel()
            self.watcher = None

    def close(self) -> None:
        self.watch(False)
        for e in self.events:
            e.close()

    async def admit(self) -> bool:
        """Submit every sequence and wait until all are admitted. False: the client went away.
        Raises APIError (400/429...) when any is refused (the others are aborted)."""
        self.submit()
        self.watch(True)
        try:
            for e in self.events:
                ev = await anext(e, None)
                if ev is None:
                    self.close()
                    return False
                if isinstance(ev, Failed):
                    self.close()
                    raise APIError.from_failed(ev)
                assert isinstance(ev, Admitted), ev
        except BaseException:
            self.close()
            raise
        return True

    async def collect(self, want_top: bool) -> list[Output] | None:
        """Every sequence's output once all finish; None when the client went away (all are
        aborted). Raises APIError when the engine failed one (the others are aborted)."""
        async def one(e: RequestEvents) -> Output | None:
            out = Output(top_logprobs=[] if want_top else None)
            async for ev in e:
                if isinstance(ev, Failed):
                    raise APIError.from_failed(ev)
                if isinstance(ev, (Delta, Finished)) and ev.prompt_logprobs is not None:
                    out.prompt_logprobs = ev.prompt_logprobs
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
        tasks = [asyncio.ensure_future(one(e)) for e in self.events]
        try:
            outs = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            self.close()
        return None if any(o is None for o in outs) else list(outs)

    def stream(self, fmt: Callable[[int, Delta | Finished], Iterable[str]], headers: dict,
               first: str | None = None, last: Callable[[], Iterable[str]] | None = None) -> StreamingResponse:
        """Stream the admitted sequences: `first` (if any), `fmt(k, event)` for each Delta and
        Finished of sequence k, in arrival order, then `last()` once all finished, then
        `data: [DONE]`. An engine failure ends the stream with an error event and no [DONE]."""
        self.watch(False)          # from here StreamingResponse watches for the disconnect
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(k: int, e: RequestEvents) -> None:
            try:
                async for ev in e:
                    await merged.put((k, ev))
            finally:
                await merged.put((k, None))

        async def body():
            tasks = [asyncio.ensure_future(pump(k, e)) for k, e in enumerate(self.events)]
            try:
                if first is not None:
                    yield first
                live = len(tasks)
                while live:
                    k, ev = await merged.get()
                    if ev is None:
                        live -= 1
                        continue
                    if isinstance(ev, Failed):
                        yield sse(APIError.from_failed(ev).body())
                        return
                    for s in fmt(k, ev):
                        yield s
                if all(e.done for e in self.events):
                    for s in (last() if last is not None else ()):
                        yield s
                    yield DONE
            finally:
                for t in tasks:
                    t.cancel()
                self.close()

        return StreamingResponse(body(), media_type="text/event-stream", headers=headers)
