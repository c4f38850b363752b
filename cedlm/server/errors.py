"""Error responses of the OpenAI-compatible server.

Every error is `{"error": {"message", "type", "param", "code"}}` with an HTTP status:

- 400 invalid body, including validation errors (FastAPI would make them 422), malformed JSON and
  JSON nested deeper than the limit (code `nesting_too_deep`; a `RecursionError` anywhere in
  handling a request is answered so too);
- 401 missing or incorrect API key (with `www-authenticate: Bearer`);
- 404 unknown model (and unknown routes);
- 413 request body larger than the server's limit (`--max-body-bytes`);
- 429 the engine cannot take the request now (with `retry-after`), from the worker's `Failed`;
- 500 engine failure or any unhandled exception: a generic message and a request id (also in
  the `x-request-id` header), never the exception's text; the details are logged with that id.
  Every 500 carries `connection: close`: after an unhandled exception uvicorn closes the
  connection once the response is sent, and a keep-alive client told so opens a new one instead
  of finding its pooled connection dropped under its next request;
- 503 the engine has failed (see `/health`) or the server is shutting down.

The OpenAPI schema (`/openapi.json`) documents these (400, not FastAPI's 422).
"""
from __future__ import annotations

import logging
import re
import uuid

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cedlm.server.protocol import ErrorInfo, ErrorResponse
from cedlm.server.protocol.checks import Combination
from cedlm.server.protocol.params import MAX_DEPTH
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
        headers = {"retry-after": str(f.retry_after)} if f.retry_after else {}
        if f.request_id:
            headers["x-request-id"] = f.request_id
        return cls(f.status, f.message, type=f.type, param=f.param, code=f.code, headers=headers)

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        headers = self.headers
        if self.status == 500:          # the server may drop this connection after it: say so
            headers = {**headers, "connection": "close"}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class BodyTooLarge(StarletteHTTPException):
    """Raised while a request body is read past the limit (an HTTPException, so FastAPI's body
    reader passes it through instead of making it a 400)."""
    code = "request_too_large"

    def __init__(self, max_bytes: int):
        super().__init__(413, f"request body too large: the limit is {max_bytes} bytes")


def unauthorized() -> APIError:
    return APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                    type="invalid_request_error", code="invalid_api_key",
                    headers={"www-authenticate": "Bearer"})


def model_not_found(message: str) -> APIError:
    return APIError(404, message, param="model", code="model_not_found")


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def internal_error(request_id: str, what: str = "internal error") -> APIError:
    """The 500 a client sees: generic, with the id under which the details were logged."""
    return APIError(500, f"{what}; the request id is {request_id}", type="server_error",
                    code="internal_error", headers={"x-request-id": request_id})


_PATH_HEAD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?=[\[.:])")
# pydantic's name of a union alternative in an error's location ("str", "literal['a','b']",
# "constrained-int", "function-after[...]", a model's class name): not part of the field's path
_ALTERNATIVE = re.compile(r"^(str|int|float|bool|none|[a-z]+(-[a-z]+)+(\[.*\])?|[a-z-]+\[.*\]|[A-Z][A-Za-z0-9]*)$")


def _path(e: dict, keep_alternatives: bool = False) -> list[str]:
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    return loc[:1] + [x for x in loc[1:] if keep_alternatives or not _ALTERNATIVE.match(x)]


def _first(errs: list[dict]) -> dict:
    """The error to report: the first field's; of a union's alternatives, one whose value had the
    right type (a bound broken, or a shape inside it), else the one reaching deepest."""
    same = [e for e in errs if _path(e)[:1] == _path(errs[0])[:1]]
    typed = [e for e in same if not re.search(r"(_type|_parsing|literal_error|missing)$", e.get("type", ""))]
    return (typed or sorted(same, key=lambda e: -len(_path(e))))[0]


def validation_error(exc: RequestValidationError) -> APIError:
    """The first validation error as a 400, naming the offending parameter."""
    errs = exc.errors()
    if not errs:
        return APIError(400, "invalid request body")
    e = _first(errs)
    errs = [e] + [x for x in errs if x is not e and _path(x) == _path(x, keep_alternatives=True)]
    loc = _path(e)
    if e.get("type") == "json_invalid":
        detail = e.get("ctx", {}).get("error", "")
        return APIError(400, f"invalid JSON body: {e.get('msg', '')}" + (f" ({detail})" if detail else ""),
                        code="invalid_json")
    msg = str(e.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    param = loc[0] if loc else None
    if param is None:
        m = _PATH_HEAD.match(msg)        # a body-level check names its field first ("messages[0]...: ")
        if m:
            param = m.group(1)
        else:
            msg = f"request body: {msg}"
    else:
        named = next((i for i in range(len(loc))          # the check named the field (or its path)
                      if re.match(rf"{re.escape('.'.join(loc[i:]))}[\[.:]", msg)), None)
        msg = ".".join(loc[:named] + [msg]) if named is not None else f"{'.'.join(loc)}: {msg}"
    if len(errs) > 1:
        msg += f" (and {len(errs) - 1} more error{'s' if len(errs) > 2 else ''})"
    code = "invalid_value" if param else "invalid_body"
    if isinstance(e.get("ctx", {}).get("error"), Combination):
        code = "invalid_combination"     # a rule between fields (documented on the operation)
    return APIError(400, msg, param=param, code=code)


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
        detail = str(exc.detail)
        if exc.status_code == 404 and detail == "Not Found":          # no such route: say what is served
            from cedlm.server.unsupported import not_found_message   # (it imports this module)
            detail = not_found_message(request.method, request.url.path)
        return APIError(exc.status_code, detail, type=typ, code=getattr(exc, "code", None),
                        headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(RecursionError)
    async def _too_deep(request, exc: RecursionError):
        # The body's depth is measured before parsing (body_guard.py) and in the JSON texts of
        # string fields (protocol/json_depth.py); this is the boundary for anything those miss.
        log.warning("a request to %s %s recursed too deeply; answered 400", request.method, request.url.path,
                    exc_info=exc)
        return APIError(400, f"request body: nested too deeply to process (JSON arrays / objects may nest "
                             f"at most {MAX_DEPTH} levels)", code="nesting_too_deep").response()

    @app.exception_handler(Exception)
    async def _crash(request, exc: Exception):
        rid = request.scope.get("state", {}).get("request_id") or new_request_id("err")   # server/tracing.py
        log.error("unhandled error in %s %s [request id %s]", request.method, request.url.path, rid,
                  exc_info=exc)
        return internal_error(rid).response()


_ERROR_DOC = {
    400: "Invalid request: malformed JSON, a field of the wrong type or out of range (`param` names it)",
    401: "Missing or incorrect API key (with --api-key; /metrics unless --metrics-public)",
    404: "Unknown model",
    413: "Request body larger than the server's limit",
    429: "The engine cannot take the request now (see the `retry-after` header)",
    500: "Internal error (a generic message with a request id)",
    503: "The engine has failed or the server is shutting down",
}


def fix_openapi(app: FastAPI, refine=None) -> None:
    """Make `/openapi.json` describe what the server answers: the OpenAI error body for 400 (where
    FastAPI documents a 422 the server never sends) and the other error statuses of a route;
    `refine(schema)` then writes in the validators' rules and the run-time bounds
    (server/openapi_rules.py)."""
    from fastapi.openapi.utils import get_openapi

    from cedlm.server.auth import OPEN_PATHS      # (it imports this module)

    def openapi():
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        comps.update(ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
                     .pop("$defs", {}))
        comps["ErrorResponse"] = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        comps.pop("HTTPValidationError", None)
        comps.pop("ValidationError", None)
        body = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        for path, ops in schema.get("paths", {}).items():
            for method, op in ops.items():
                resp = op.setdefault("responses", {})
                had_body = resp.pop("422", None) is not None
                codes = [500] if path in OPEN_PATHS else [401, 500]
                if had_body:
                    codes += [400, 404, 413, 429, 503]
                if path == "/health":
                    continue                      # documented on the route (its own body)
                for c in sorted(codes):
                    resp.setdefault(str(c), {"description": _ERROR_DOC[c], "content": body})
        if refine is not None:
            refine(schema)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
