"""Request ids and the server's own log lines (logger "cedlm.server", configured by `cedlm serve`).

- `RequestIdMiddleware`: every HTTP request gets an id: the client's `x-request-id` (1..128
  printable ASCII characters, no spaces; anything else is a 400 naming the header) or a generated
  one (32 hex digits). It is echoed in the `x-request-id` response header, kept in
  `request.state.request_id`, and is part of the engine request id (`engine_request_id`: the
  response's `id`, e.g. `chatcmpl-<id>`), so every log line about the request carries it.
- `log_finished`: one INFO line per finished request (id, prompt / cached / output tokens, time to
  first token, total time, finish reason), from the worker's `on_finished` hook.
- `ThroughputLog`: while there is traffic, one INFO line every `interval` seconds (10 by default)
  with the prompt and generation throughput since the last line, running / waiting requests, KV
  block usage and the prefix-cache hit rate, as vLLM logs it.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid

from cedlm.engine.output import StepOutput
from cedlm.server.errors import APIError
from cedlm.server.http_protocol import REQUEST_ID_HEADER

__all__ = ["HEADER", "MAX_ID_LEN", "RequestIdMiddleware", "ThroughputLog", "engine_request_id", "log_finished",
           "request_id_of"]

log = logging.getLogger("cedlm.server")

HEADER = REQUEST_ID_HEADER
MAX_ID_LEN = 128
_VALID = re.compile(rf"[\x21-\x7e]{{1,{MAX_ID_LEN}}}")


class RequestIdMiddleware:
    """Pure ASGI middleware (keeps `receive` untouched): the request id (module docstring) into
    `scope["state"]` and the response's `x-request-id` header."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope.get("headers", ()) if k == HEADER.encode()), None)
        if given is not None:
            rid = given.decode("latin-1")
            if not _VALID.fullmatch(rid):
                err = APIError(400, f"{HEADER}: must be 1 to {MAX_ID_LEN} printable ASCII characters without "
                                    f"spaces (got {len(rid)} characters)", param=HEADER, code="invalid_value")
                return await err.response()(scope, receive, send)
        else:
            rid = uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"], state["request_id_given"] = rid, given is not None
        log.debug("request %s: %s %s", rid, scope.get("method", ""), scope.get("path", ""))

        async def _send(msg):
            if msg["type"] == "http.response.start":      # ours replaces a handler's (a 500 names the engine id)
                headers = [(k, v) for k, v in msg.get("headers", []) if k.lower() != HEADER.encode()]
                msg = {**msg, "headers": [*headers, (HEADER.encode(), rid.encode())]}
            await send(msg)
        await self.app(scope, receive, _send)


def request_id_of(request) -> str | None:
    """The request id `RequestIdMiddleware` gave this Starlette request (None without it)."""
    return request.scope.get("state", {}).get("request_id")


def engine_request_id(request, prefix: str) -> str:
    """The engine request id (and the response `id`) of an HTTP request: `{prefix}-{request id}`;
    a client's id gets a random suffix (`-{8 hex}`), since two clients may send the same one.
    Without the middleware: `{prefix}-{32 hex}`."""
    state = request.scope.get("state", {})
    rid = state.get("request_id")
    if rid is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    return f"{prefix}-{rid}-{uuid.uuid4().hex[:8]}" if state.get("request_id_given") else f"{prefix}-{rid}"


def log_finished(o: StepOutput) -> None:
    """The per-request INFO line (`EngineWorker.on_finished`)."""
    t = o.times
    ttft = None if t is None else t.ttft_s
    total = None if t is None else t.e2e_s
    log.info("request %s finished: prompt_tokens=%d cached_tokens=%d output_tokens=%d ttft=%s total=%s "
             "finish_reason=%s", o.request_id, o.num_prompt_tokens, o.num_cached_tokens, o.num_output_tokens,
             "-" if ttft is None else f"{ttft:.3f}s", "-" if total is None else f"{total:.3f}s",
             o.finish_reason)


class ThroughputLog:
    """The periodic throughput line (module docstring), read from the worker's snapshot."""

    def __init__(self, worker, interval: float = 10.0):
        self.worker, self.interval = worker, interval
        self.last: tuple[float, int, int, int, int] | None = None   # time, prompt, generation, queries, hits

    def _read(self) -> tuple[float, int, int, int, int]:
        s = self.worker.snapshot
        c, kv = s.get("counters", {}), s.get("kv", {})
        return (time.monotonic(), int(c.get("prompt_tokens", 0)), int(c.get("generation_tokens", 0)),
                int(kv.get("prefix_queries", 0)), int(kv.get("prefix_hits", 0)))

    def tick(self) -> str | None:
        """Log (and return) the line for the time since the last tick, when there was traffic."""
        now = self._read()
        last, self.last = self.last, now
        s = self.worker.snapshot
        running, waiting = s.get("running", 0), s.get("waiting", 0)
        if last is None:
            return None
        dt = max(now[0] - last[0], 1e-9)
        prompt, gen, queries, hits = (now[i] - last[i] for i in range(1, 5))
        if not (prompt or gen or running or waiting):
            return None                           # idle: no line
        kv = s.get("kv", {})
        total = kv.get("blocks_total", 0) or 0
        usage = 100.0 * (kv.get("blocks_in_use", 0) or 0) / total if total else 0.0
        line = (f"Avg prompt throughput: {prompt / dt:.1f} tokens/s, Avg generation throughput: "
                f"{gen / dt:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
                f"KV cache usage: {usage:.1f}%, Prefix cache hit rate: "
                f"{100.0 * hits / queries if queries else 0.0:.1f}%")
        log.info("%s", line)
        return line

    async def run(self) -> None:
        """Tick every `interval` seconds until cancelled."""
        self.tick()
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.tick()
            except Exception:                     # noqa: BLE001 - the log line must never stop the server
                log.debug("throughput log failed", exc_info=True)
