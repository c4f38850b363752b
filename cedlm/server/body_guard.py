"""Checks on a JSON request body before FastAPI parses it (pure ASGI middleware).

`BodyGuard` receives the whole body of a POST / PUT / PATCH request whose content type is JSON (or
absent, which FastAPI parses as JSON too), then:

- bounds the time it takes, by the connection's rule (`http_protocol.py`): the body must arrive
  within `BODY_TIMEOUT_S` seconds plus one second per `MIN_BODY_RATE` bytes received so far (a
  client sending at least that fast is never cut; one that trickles a byte at a time is cut after
  about `BODY_TIMEOUT_S`): 408 (code
  `request_timeout`, `connection: close`) naming the limit. The header timeout
  (`http_protocol.py`) ends once the headers are in, so a slow body held its connection and its
  handler as long as the client liked;
- measures its nesting depth on the raw bytes (`protocol.json_depth.deeper_than`, no recursion):
  deeper than `max_depth` levels is a 400 (code `nesting_too_deep`) naming the limit and the
  top-level field the deep value sits in, before `json.loads` recurses into it. (Python's parser
  reported 100,000 nested brackets only as "There was an error parsing the body".)
- counts its arrays and objects the same way: more than `MAX_CONTAINERS` is a 400 (code
  `too_many_values`) before the parser builds them (220,000 empty messages, 6 MB, took the
  parser 0.2 s of holding the GIL and then a garbage collection over the whole heap, while every
  stream waited; the message-count limit is checked only after parsing).

It then hands the app the body it read, and passes every later `receive` through untouched (a
client's disconnect still reaches the handlers). It sits inside the body-size limit, so a body over
`max_body_bytes` is a 413 before it is all read, and inside the API-key check.
"""
from __future__ import annotations

import asyncio

from starlette.concurrency import run_in_threadpool

from cedlm.server import http_protocol as conn
from cedlm.server.errors import APIError
from cedlm.server.protocol.json_depth import containers_over, deeper_than
from cedlm.server.protocol.params import MAX_DEPTH

_INLINE_BYTES = 256 << 10          # larger bodies are measured in a worker thread (numpy frees the GIL)
MAX_CONTAINERS = 100_000           # JSON arrays and objects in one body (4,096 messages of 16 each: 65,536)


def _json_body(scope) -> bool:
    if scope.get("method") not in conn.BODY_METHODS:
        return False
    for k, v in scope.get("headers", ()):
        if k == b"content-type":
            return b"json" in v.lower()
    return True                    # no content type: FastAPI parses the body as JSON


def too_deep(body: bytes, max_depth: int = MAX_DEPTH) -> APIError | None:
    """The 400 for a body nested deeper than `max_depth` levels, or None."""
    hit = deeper_than(body, max_depth)
    if hit is None:
        return None
    where = f"{hit.key}: " if hit.key else "request body: "
    return APIError(400, f"{where}nested deeper than {max_depth} levels (JSON arrays / objects within each "
                         f"other, at byte {hit.offset})", param=hit.key, code="nesting_too_deep")


def body_error(body: bytes, max_depth: int = MAX_DEPTH, max_containers: int | None = None) -> APIError | None:
    """The 400 for a body nested too deep or holding too many arrays and objects, or None."""
    err = too_deep(body, max_depth)
    if err is not None:
        return err
    limit = MAX_CONTAINERS if max_containers is None else max_containers
    n = containers_over(body, limit)
    if n is None:
        return None
    return APIError(400, f"request body: {n} JSON arrays and objects, more than the limit of {limit}",
                    code="too_many_values")


def too_slow(timeout: float, rate: int) -> APIError:
    return APIError(408, conn.too_slow_message(timeout, rate), code="request_timeout",
                    headers={"connection": "close"})


class BodyGuard:
    """See the module docstring."""

    def __init__(self, app, max_depth: int = MAX_DEPTH, timeout: float | None = None, min_rate: int | None = None):
        self.app, self.max_depth = app, int(max_depth)
        self.timeout = conn.BODY_TIMEOUT_S if timeout is None else float(timeout)
        self.min_rate = conn.MIN_BODY_RATE if min_rate is None else int(min_rate)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not _json_body(scope):
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        first: dict | None = None            # a disconnect before the body's end: handed on as it came
        loop = asyncio.get_running_loop()
        start, seen = loop.time(), 0
        try:
            # one deadline for the whole body, moved on as bytes arrive (no task or timer per chunk:
            # a connection trickling a byte at a time costs the event loop one wake-up per byte)
            async with asyncio.timeout(start + self.timeout) as deadline:
                while True:
                    msg = await receive()
                    if msg["type"] != "http.request":
                        first = msg
                        break
                    chunks.append(msg.get("body", b""))
                    seen += len(chunks[-1])
                    if not msg.get("more_body", False):
                        break
                    deadline.reschedule(start + self.timeout + seen / self.min_rate)
        except TimeoutError:
            return await too_slow(self.timeout, self.min_rate).response()(scope, receive, send)
        body = b"".join(chunks)
        if first is None:
            err = (body_error(body, self.max_depth) if len(body) <= _INLINE_BYTES
                   else await run_in_threadpool(body_error, body, self.max_depth))
            if err is not None:
                return await err.response()(scope, receive, send)
            first = {"type": "http.request", "body": body, "more_body": False}
        replayed = False

        async def _receive():
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()

        await self.app(scope, _receive, send)
