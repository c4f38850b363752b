"""`cedlm serve` from its first second: the port is bound before the model loads, and the app that
listens on it answers while the model loads.

    sock = bind(host, port)                   # a busy port is one error line, before any work
    app = StartingApp(build)                  # build(): the real FastAPI app (loads the model)
    uvicorn.Server(config).run(sockets=[sock])

While `build` runs (in a thread), GET /health answers 503 `{"status": "loading"}` (as llama-server
does) and every other route 503 in the OpenAI error shape with a `retry-after`; then the real app
takes every request and its lifespan (the engine thread) starts. If `build` fails, the error is
logged and printed as one line and the server stops (`failed`: the CLI's exit status).
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from typing import Callable

log = logging.getLogger("cedlm.server")


class BindError(OSError):
    pass


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (what uvicorn would bind), or BindError with one line
    naming the address and why."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise BindError(f"host: cannot resolve {host!r} ({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise BindError(f"port: cannot listen on {host}:{port} ({e.strerror or e})") from None
    sock.set_inheritable(True)
    return sock


class StartingApp:
    """An ASGI app that is the real one once `build()` has returned it (see the module doc)."""

    def __init__(self, build: Callable[[], object], on_failed: Callable[[str], None] | None = None):
        self.build = build
        self.on_failed = on_failed
        self.app = None
        self.failed: str | None = None
        self.started = time.monotonic()
        self._lifespan = None
        self._task: asyncio.Task | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._serve_lifespan(receive, send)
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return
        waited = time.monotonic() - self.started
        if scope.get("path") == "/health":
            status, reason = ("failed", self.failed) if self.failed else (
                "loading", f"loading the model ({waited:.0f} s so far)")
            body = {"status": status, "reason": reason}
        else:
            body = {"error": {"message": self.failed and f"the model failed to load: {self.failed}"
                              or f"the model is loading ({waited:.0f} s so far); retry shortly",
                              "type": "service_unavailable", "param": None, "code": 503}}
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    async def _serve_lifespan(self, receive, send):
        await receive()                                           # lifespan.startup
        self._task = asyncio.ensure_future(self._load())
        await send({"type": "lifespan.startup.complete"})
        await receive()                                           # lifespan.shutdown
        if self._lifespan is not None:
            try:
                await self._lifespan.__aexit__(None, None, None)
            except Exception:                                     # shutting down anyway
                log.exception("shutting the engine down")
        await send({"type": "lifespan.shutdown.complete"})

    async def _load(self):
        # in a daemon thread of its own (not the loop's executor, which the shutdown would wait
        # for): Ctrl-C while the model loads stops the server at once
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle(fn, value):
            try:
                loop.call_soon_threadsafe(lambda: done.done() or fn(value))
            except RuntimeError:                            # the server stopped meanwhile
                pass

        def load():
            try:
                app = self.build()
            except BaseException as e:                      # noqa: BLE001 - handed to the loop
                settle(done.set_exception, e)
            else:
                settle(done.set_result, app)
        threading.Thread(target=load, name="cedlm-load", daemon=True).start()
        try:
            app = await done
            ctx = app.router.lifespan_context(app)
            await ctx.__aenter__()
        except Exception as e:                 # the CLI's own error line, then the server stops
            self.failed = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            if not isinstance(e, (FileNotFoundError, ValueError)):
                log.exception("the model failed to load")
            if self.on_failed is not None:
                self.on_failed(self.failed)
            return
        self._lifespan, self.app = ctx, app
        log.info("ready: the model loaded in %.1f s", time.monotonic() - self.started)
