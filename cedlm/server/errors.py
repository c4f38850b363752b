"""Error responses of the OpenAI-compatible server.

Every error is `{"error": {"message", "type", "param", "code"}}` with an HTTP status:

- 400 invalid body, including validation errors (FastAPI would make them 422) and malformed JSON;
- 401 missing or incorrect API key (with `www-authenticate: Bearer`);
- 404 unknown model (and unknown routes);
- 429 the engine cannot take the request now (with `retry-after`), from the worker's `Failed`;
- 500 engine failure or any unhandled exception.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cedlm.server.protocol import ErrorInfo, ErrorResponse
from cedlm.server.worker import Failed

log = logging.getLogger("cedlm.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    @classmethod
    def from_failed(cls, f: Failed) -> "APIError":
        headers = {"retry-after": str(f.retry_after)} if f.retry_after else None
        return cls(f.status, f.message, type=f.type, param=f.param, code=f.code, headers=headers)

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def unauthorized() -> APIError:
    return APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                    type="invalid_request_error", code="invalid_api_key",
                    headers={"www-authenticate": "Bearer"})


def model_not_found(message: str) -> APIError:
    return APIError(404, message, param="model", code="model_not_found")


def validation_error(exc: RequestValidationError) -> APIError:
    """The first validation error as a 400, naming the offending parameter."""
    errs = exc.errors()
    if not errs:
        return APIError(400, "invalid request body")
    e = errs[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        detail = e.get("ctx", {}).get("error", "")
        return APIError(400, f"invalid JSON body: {e.get('msg', '')}" + (f" ({detail})" if detail else ""),
                        code="invalid_json")
    msg = str(e.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    param = loc[0] if loc else None
    if param is None:
        msg = f"request body: {msg}"
    elif not msg.startswith(f"{param}:"):
        msg = f"{'.'.join(loc)}: {msg}"
    if len(errs) > 1:
        msg += f" (and {len(errs) - 1} more error{'s' if len(errs) > 2 else ''})"
    return APIError(400, msg, param=param, code="invalid_value" if param else "invalid_body")


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app returns an OpenAI-style error body."""

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        typ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=typ,
                        headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _crash(request, exc: Exception):
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()
