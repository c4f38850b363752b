"""A time limit on receiving a request's headers (uvicorn's h11 protocol plus one timer).

uvicorn closes an idle keep-alive connection after `timeout_keep_alive`, but any byte received
cancels that timer, and nothing limits how long a request's headers may take: a client sending
an unfinished header line a byte at a time could hold its connection for as long as it liked. `header_timeout_protocol(seconds)` is the h11 protocol class with a timer armed
while the connection waits for (the rest of) a request's headers: from the connection's start
and again after each response. When it fires before the headers are complete, the connection is
closed. The body and the response are not limited here (`max_body_bytes`, the handlers).

    uvicorn.run(app, http=header_timeout_protocol(10.0))      # `cedlm serve --header-timeout`
"""
from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_HEADER_TIMEOUT = 10.0
log = logging.getLogger("cedlm.server")


class HeaderTimeoutProtocol(H11Protocol):
    """H11Protocol that closes a connection whose request headers take longer than
    `header_timeout` seconds (a class attribute; see `header_timeout_protocol`)."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:            # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:                # still waiting for complete headers
            if self._header_timer is None:
                self._arm()
        else:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:                # the next request's headers
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.info("closing a connection whose request headers took more than %g s", self.header_timeout)
            self.transport.close()


def header_timeout_protocol(seconds: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class with its header time limit set to `seconds`."""
    if not seconds > 0:
        raise ValueError(f"header_timeout: must be > 0 seconds, got {seconds}")
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout": float(seconds)})
