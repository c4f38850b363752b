"""The connection's own limits (cedlm/server/http_protocol.py): small bodies read in full before
the app runs, the body deadline answered by the protocol, and the same answers with either parser."""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import pytest
import uvicorn

from cedlm.server import http_protocol as conn
from cedlm.server.body_guard import BodyGuard
from cedlm.server.http_protocol import BUFFERED_BODY_BYTES, buffered, http_protocol, resolve_http
from cedlm.server.tracing import RequestIdMiddleware

pytestmark = pytest.mark.foreground    # times wall-clock latencies: see tests/ahead.py

PARSERS = ["httptools", "h11"]


class Recorder:
    """An ASGI app that counts its calls and answers with the length of the body it read."""

    def __init__(self):
        self.calls = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        self.calls += 1
        body = b""
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        out = b"%d" % len(body)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(out))]})
        await send({"type": "http.response.body", "body": out})


@contextlib.contextmanager
def serve(app, http):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off", http=http_protocol(5.0, http)))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and th.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        th.join(10)


def head(n: int, extra: bytes = b"") -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n%s\r\n" % (n, extra))


def read_response(s: socket.socket, timeout: float = 10.0) -> tuple[bytes, bytes]:
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    top, _, body = data.partition(b"\r\n\r\n")
    n = next((int(ln.split(b":", 1)[1]) for ln in top.split(b"\r\n") if ln.lower().startswith(b"content-length:")),
             None)
    while n is not None and len(body) < n:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return top, body


def test_which_bodies_are_buffered():
    def scope(method="POST", **headers):
        return {"method": method, "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}
    assert buffered(scope(content_length="10"))
    assert buffered(scope("PUT", content_length=str(BUFFERED_BODY_BYTES)))
    assert not buffered(scope(content_length=str(BUFFERED_BODY_BYTES + 1)))     # larger: to the app as it comes
    assert not buffered(scope(content_length="0"))
    assert not buffered(scope(content_length="x"))
    assert not buffered(scope())                                                 # no length: chunked or none
    assert not buffered(scope(content_length="10", transfer_encoding="chunked"))
    assert not buffered(scope(content_length="10", expect="100-Continue"))      # the client waits for a 100
    assert not buffered(scope("GET", content_length="10"))


def test_the_app_runs_once_a_small_body_is_complete():
    app = Recorder()
    with serve(app, "httptools") as port:
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(head(10) + b"01234")
        time.sleep(0.3)
        assert app.calls == 0                       # the body is not complete: the app has not run
        s.sendall(b"56789")
        top, body = read_response(s)
        assert top.startswith(b"HTTP/1.1 200") and body == b"10" and app.calls == 1
        s.sendall(head(3) + b"abc")                 # keep-alive: the next request on the same connection
        top, body = read_response(s)
        assert top.startswith(b"HTTP/1.1 200") and body == b"3"
        s.close()
        big = socket.create_connection(("127.0.0.1", port))   # announced larger: the app reads it as it comes
        big.sendall(head(BUFFERED_BODY_BYTES + 10) + b"x" * 100)
        deadline = time.monotonic() + 5
        while app.calls < 3:
            assert time.monotonic() < deadline, "a large body's app did not start before the body ended"
            time.sleep(0.02)
        big.sendall(b"x" * (BUFFERED_BODY_BYTES - 90))
        top, body = read_response(big)
        assert body == str(BUFFERED_BODY_BYTES + 10).encode()
        big.close()
        gone = socket.create_connection(("127.0.0.1", port))  # a client that leaves mid-body
        gone.sendall(head(100) + b"12")
        gone.close()
        time.sleep(0.2)
        assert app.calls == 3


@pytest.mark.parametrize("http", PARSERS)
def test_a_trickled_body_gets_the_same_408_with_either_parser(monkeypatch, http):
    """The protocol (httptools, buffered) and BodyGuard (h11) give the same answer at the same deadline."""
    monkeypatch.setattr(conn, "BODY_TIMEOUT_S", 1.0)
    app = Recorder()
    with serve(RequestIdMiddleware(BodyGuard(app)), http) as port:     # as the server composes them
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(head(1000))
        t0 = time.monotonic()
        s.settimeout(0.2)
        got = b""
        while time.monotonic() - t0 < 8 and not got:
            try:
                s.sendall(b" ")
                got = s.recv(1, socket.MSG_PEEK)
            except socket.timeout:
                pass
        took = time.monotonic() - t0
        top, body = read_response(s)
        s.close()
        assert top.startswith(b"HTTP/1.1 408"), top
        lines = top.lower().split(b"\r\n")
        assert b"connection: close" in lines and any(ln.startswith(b"x-request-id: ") for ln in lines)
        err = json.loads(body)["error"]
        assert err["code"] == "request_timeout" and err["message"].startswith("request body: not received in time")
        assert "1 s plus 1 s per" in err["message"] and 0.9 < took < 4, took
        assert app.calls == 0


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="http"):
        resolve_http("picohttp")
    assert resolve_http("auto") in PARSERS
    with pytest.raises(ValueError, match="header_timeout"):
        http_protocol(0)
