"""The API key, checked before anything of the request is read (pure ASGI middleware).

With `--api-key` (or `CEDLM_API_KEY`), every route except `/health`, `/version` and the chat page
at `/` (and `/metrics` when the operator opts in with `--metrics-public`) needs
`Authorization: Bearer <key>`. The check runs on
the headers alone, before the body is received or parsed: a client without the key cannot make
the server read, parse or validate a body, and `/metrics` is behind the key too. A missing or wrong key is a 401 (`errors.unauthorized`).
"""
from __future__ import annotations

import hmac

from cedlm.server.errors import unauthorized

OPEN_PATHS = frozenset({"/health", "/version", "/"})     # liveness, the version, the chat page


class APIKeyMiddleware:
    """401 for a request without the key, from its headers, before the app sees it."""

    def __init__(self, app, api_key: str, metrics_public: bool = False):
        self.app, self.key = app, api_key.encode()
        self.open = OPEN_PATHS | ({"/metrics"} if metrics_public else set())

    def authorized(self, scope) -> bool:
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                scheme, _, token = v.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in self.open or scope.get("method") == "OPTIONS" \
                or self.authorized(scope):
            return await self.app(scope, receive, send)
        return await unauthorized().response()(scope, receive, send)
