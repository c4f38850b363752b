"""Who sent the request being handled, and a way to notice that it went away (pure ASGI middleware).

`ClientContext` stores, for each HTTP request, its client (the peer address) and its `receive`
channel in a context variable, so that work queued on the request's behalf (constraint
compilation, `compile_queue`) can be shared out per client and dropped when the client leaves,
without the handlers passing the request around. `gone()` returns once the client has
disconnected: call it only after the body was read (then the next ASGI message is the
disconnect).
"""
from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Awaitable, Callable


@dataclass(frozen=True)
class RequestContext:
    client: str
    receive: Callable[[], Awaitable[dict]] | None

    async def gone(self) -> None:
        """Returns when the client has disconnected (never, without a receive channel)."""
        if self.receive is None:
            import asyncio
            await asyncio.Event().wait()
        while True:
            msg = await self.receive()
            if msg.get("type") == "http.disconnect":
                return


_current: ContextVar[RequestContext] = ContextVar("cedlm_request", default=RequestContext("", None))


def current() -> RequestContext:
    return _current.get()


def client_of(scope: dict[str, Any]) -> str:
    peer = scope.get("client")
    return str(peer[0]) if peer else ""


class ClientContext:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        token = _current.set(RequestContext(client_of(scope), receive))
        try:
            return await self.app(scope, receive, send)
        finally:
            _current.reset(token)
