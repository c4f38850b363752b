"""The connection's own limits: uvicorn's HTTP protocol with a header deadline, and small bodies
read in full before the app runs.

`http_protocol(header_timeout, http)` is uvicorn's protocol class for the chosen parser
(`httptools`, uvicorn's C parser, or `h11`, pure Python; "auto": httptools, a dependency of
cedlm, when it is installed, as uvicorn picks) with:

- **A header deadline.** uvicorn closes an idle keep-alive connection after `timeout_keep_alive`,
  but any byte received cancels that timer, and nothing limits how long a request's headers may
  take: a client sending an unfinished header line a byte at a time could hold its connection for
  as long as it liked. A timer runs while the connection waits for (the rest of) a request's
  headers, from the connection's start and again after each response; when it fires first, the
  connection is closed.
- **Small bodies buffered before the app runs** (httptools): a POST / PUT / PATCH announcing a
  `content-length` of at most `BUFFERED_BODY_BYTES` (uvicorn's own read-ahead, 64 KiB: every chat
  request of ordinary size) starts its ASGI task only once its body is complete, as a proxy that
  buffers request bodies does. Until then the connection is only its parser and a buffer: a
  client trickling its body a byte at a time costs one parser call per byte, not a wake-up of the
  app's middleware chain, and holds a few objects rather than the app's coroutines, closures and
  scope (thousands of such connections made every full garbage collection walk them, holding the
  GIL while every stream waited). The body deadline (`BODY_TIMEOUT_S` plus one second per `MIN_BODY_RATE`
  bytes received, the same rule `body_guard.py` applies to the bodies the app reads) not met, the
  body is answered here with the same 408 (`request_timeout`, `connection: close`, an `x-request-id`). Bodies announced
  larger, chunked bodies, `Expect: 100-continue` and every other method go to the app as they
  arrive (the body-size limit refuses an oversized one from its header; `BodyGuard` times it).

    uvicorn.run(app, http=http_protocol(10.0))      # `cedlm serve --header-timeout --http`
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import uuid


DEFAULT_HEADER_TIMEOUT = 10.0
BODY_TIMEOUT_S = 10.0              # seconds a body may take, plus one per MIN_BODY_RATE bytes received
MIN_BODY_RATE = 64 << 10           # bytes per second
REQUEST_ID_HEADER = "x-request-id"  # every response carries one (server/tracing.py)
HTTP_CHOICES = ("auto", "httptools", "h11")
BUFFERED_BODY_BYTES = 64 << 10          # uvicorn's HIGH_WATER_LIMIT: reading never pauses below it
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})   # the methods whose bodies the app reads
log = logging.getLogger("cedlm.server")


class _HeaderTimer:
    """The header deadline, shared by both parsers' protocols; `_awaiting_headers()` is the parser's."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    _header_timer: asyncio.TimerHandle | None = None

    def _awaiting_headers(self) -> bool:
        raise NotImplementedError

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        if self._awaiting_headers() and not self.transport.is_closing():
            log.info("closing a connection whose request headers took more than %g s", self.header_timeout)
            self.transport.close()


def _h11_protocol() -> type:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class H11Limits(_HeaderTimer, H11Protocol):
        def _awaiting_headers(self) -> bool:
            return self.conn.their_state is h11.IDLE

        def connection_made(self, transport) -> None:            # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._awaiting_headers():
                if self._header_timer is None:
                    self._arm()
            else:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._awaiting_headers():                       # the next request's headers
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return H11Limits


def buffered(scope: dict) -> bool:
    """Whether a request's body is read in full before its app task starts (module docstring)."""
    if scope.get("method") not in BODY_METHODS:
        return False
    n = None
    for k, v in scope.get("headers", ()):
        if k == b"transfer-encoding" or (k == b"expect" and v.lower() == b"100-continue"):
            return False
        if k == b"content-length":
            try:
                n = int(v)
            except ValueError:
                return False
    return n is not None and 0 < n <= BUFFERED_BODY_BYTES


def too_slow_message(timeout: float, rate: int) -> str:
    return f"request body: not received in time (a body may take {timeout:g} s plus 1 s per {rate} bytes)"


def timeout_response(default_headers) -> bytes:
    """The 408 a body that did not arrive in time gets, as bytes on the wire: the OpenAI error
    shape BodyGuard answers with (`body_guard.too_slow`), built here so that the protocol needs
    nothing of the app (`cedlm serve` answers /health before the app and torch are imported)."""
    body = json.dumps({"error": {"message": too_slow_message(BODY_TIMEOUT_S, MIN_BODY_RATE),
                                 "type": "invalid_request_error", "param": None,
                                 "code": "request_timeout"}}, separators=(",", ":")).encode()
    head = [b"HTTP/1.1 408 Request Timeout\r\n"]
    for name, value in [*default_headers, (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()), (b"connection", b"close"),
                        (REQUEST_ID_HEADER.encode(), uuid.uuid4().hex.encode())]:
        head += [name, b": ", value, b"\r\n"]
    return b"".join(head) + b"\r\n" + body


def _httptools_protocol() -> type:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsLimits(_HeaderTimer, HttpToolsProtocol):
        _in_headers = True          # from the connection's start and after each response
        _waiting = None             # (cycle, app, started): a buffered request whose body is coming
        _body_timer: asyncio.TimerHandle | None = None

        def _awaiting_headers(self) -> bool:
            return self._in_headers

        def connection_made(self, transport) -> None:            # type: ignore[override]
            super().connection_made(transport)
            self._in_headers = True
            self._arm()

        def on_headers_complete(self) -> None:
            self._in_headers = False
            self._disarm()
            super().on_headers_complete()

        def _start_asgi_task(self, cycle, app) -> None:
            if self._waiting is None and cycle.more_body and buffered(cycle.scope):
                self._waiting = (cycle, app, self.loop.time())
                self._body_timer = self.loop.call_later(BODY_TIMEOUT_S, self._body_expired)
                return
            super()._start_asgi_task(cycle, app)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            waiting = self._waiting
            if waiting is not None and waiting[0] is self.cycle:
                self._end_wait()
                super()._start_asgi_task(waiting[0], waiting[1])

        def _end_wait(self) -> None:
            self._waiting = None
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _body_expired(self) -> None:
            self._body_timer = None
            if self._waiting is None or self.transport.is_closing():
                return
            cycle, _, started = self._waiting
            due = started + BODY_TIMEOUT_S + len(cycle.body) / MIN_BODY_RATE
            if self.loop.time() < due:                       # bytes came meanwhile: the deadline moved
                self._body_timer = self.loop.call_at(due, self._body_expired)
                return
            self._waiting = None
            log.info("408: a request body (%d of its bytes received) took more than the body deadline",
                     len(cycle.body))
            self.transport.write(timeout_response(self.server_state.default_headers))
            self.transport.close()

        def on_response_complete(self) -> None:
            pipelined = bool(self.pipeline)          # the next request's headers are in already
            super().on_response_complete()
            if not pipelined and not self.transport.is_closing():
                self._in_headers = True
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            self._end_wait()                         # a request never started: nothing to tell
            super().connection_lost(exc)
            # the request cycle points back here (its response callback): let go of it, so that a
            # closed connection is freed when its last task ends, not by the garbage collector
            self.cycle = self.flow = None
            self.pipeline.clear()

    return HttpToolsLimits


def resolve_http(http: str = "auto") -> str:
    """The parser `http` names: "auto" is httptools when installed, else h11."""
    if http not in HTTP_CHOICES:
        raise ValueError(f"http: {http!r} is not one of {', '.join(HTTP_CHOICES)}")
    installed = importlib.util.find_spec("httptools") is not None
    if http == "auto":
        return "httptools" if installed else "h11"
    if http == "httptools" and not installed:
        raise ValueError("http: httptools is not installed (pip install httptools)")
    return http


def http_protocol(header_timeout: float = DEFAULT_HEADER_TIMEOUT, http: str = "auto") -> type:
    """uvicorn's protocol class for parser `http` with the limits above, the header deadline set to
    `header_timeout` seconds."""
    if not header_timeout > 0:
        raise ValueError(f"header_timeout: must be > 0 seconds, got {header_timeout}")
    base = _httptools_protocol() if resolve_http(http) == "httptools" else _h11_protocol()
    return type(base.__name__, (base,), {"header_timeout": float(header_timeout)})
