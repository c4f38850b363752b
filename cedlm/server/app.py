"""The OpenAI-compatible HTTP server: `create_app(llm_or_engine, ...)` -> FastAPI app.

Routes: POST /v1/chat/completions (`chat`), POST /v1/completions (`completions`), POST
/v1/responses (`responses`: the Responses API, run through the chat path), each streaming over SSE
or not; GET /v1/models, GET /v1/models/{id}, POST /tokenize and POST /detokenize (vLLM's
shapes), GET /health, GET /metrics (Prometheus text format), here; GET /version and 404 for
other /v1 routes (`unsupported.py`), the chat page at GET / (`ui/`). Request ids, the per-request
and throughput log lines: `tracing.py`; latency histograms: `latency.py`. Behaviour follows vLLM's
OpenAI server where the OpenAI API is silent.

- Model names go through the explicit alias table (`aliases.py`).
- Errors are OpenAI-shaped (`errors.py`): 400 invalid body, 401 bad/missing API key, 404 unknown
  model, 413 body over `max_body_bytes` (refused from its `content-length` before it is read, or
  as soon as a chunked body passes the limit), 429 (+ `retry-after`) when the engine cannot take
  the request, 500 on an engine failure (generic message + request id; details only in the log),
  503 once the engine has failed.
- `/health`: `{"status": "ready"|"degraded"|"failed", "reason": ...}`, 200 for ready and
  degraded, 503 for failed (`worker.EngineWorker.health`).
- `usage.prompt_tokens_details.cached_tokens` = prompt tokens served by the prefix cache.
- A client that disconnects (while waiting, mid-generation or mid-stream) aborts its request; its
  KV blocks are freed by the engine thread (`streaming.py`).
- The engine is owned by one thread (`worker.EngineWorker`); handlers never touch it.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cedlm.server import chat, completions, responses
from cedlm.server.aliases import AliasTable
from cedlm.server.auth import APIKeyMiddleware
from cedlm.server.lanes import ClientContext
from cedlm.server.body_guard import BodyGuard
from cedlm.server.chat import EFFORT_HEADER, ReasoningSplitter, encode_messages
from cedlm.server.errors import APIError, BodyTooLarge, fix_openapi, install_error_handlers, unauthorized
from cedlm.server.images import options_for as image_options
from cedlm.server.metrics import Metrics
from cedlm.server.openapi_rules import RuntimeBounds
from cedlm.server.openapi_rules import refine as refine_openapi
from cedlm.server.tracing import RequestIdMiddleware, ThroughputLog, log_finished
from cedlm.server.ui import ui_router
from cedlm.server.unsupported import unsupported_router, version_router
from cedlm.server.protocol import (
    DetokenizeRequest, DetokenizeResponse, Health, ModelCard, ModelList, TokenizeRequest, TokenizeResponse,
)
from cedlm.server.state import DEFAULT_MAX_TOKENS, ServerState
from cedlm.server.worker import EngineWorker

__all__ = ["create_app", "api_key_from_env", "ReasoningSplitter", "EFFORT_HEADER", "DEFAULT_MAX_BODY_BYTES",
           "DEFAULT_MAX_TOKENS"]

DEFAULT_MAX_BODY_BYTES = 8 << 20
log = logging.getLogger("cedlm.server")

_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health", "/metrics",
           "/tokenize", "/detokenize", "/version", "/"}

models_router = APIRouter()
ops_router = APIRouter()


def _card(srv: ServerState, name: str) -> ModelCard:
    table = srv.aliases
    st = "current" if name == table.served_name else table.aliases[name]
    return ModelCard(id=name, created=srv.created, root=table.served_name, status=st,
                     replacement=table.served_name if st == "deprecated" else None,
                     max_model_len=srv.max_model_len, device=srv.device, **_step_status(srv.engine))


def _step_status(engine) -> dict:
    """{"decode_step", "compiling"}: which step serves now and what compiles in the background."""
    status = getattr(engine, "compile_status", None)
    return status() if status is not None else {}


@models_router.get("/v1/models")
async def models(request: Request):
    srv: ServerState = request.app.state.server
    cards = [_card(srv, name) for name in srv.aliases.names()]
    return ModelList(data=cards).model_dump(exclude_none=True)


@models_router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    """One model card; an unknown name is 404 `model_not_found` naming it and the valid names."""
    srv: ServerState = request.app.state.server
    srv.resolve(model_id)
    return _card(srv, model_id).model_dump(exclude_none=True)


@models_router.post("/tokenize", response_model=TokenizeResponse, response_model_exclude_none=True)
async def tokenize(body: TokenizeRequest, request: Request):
    """vLLM's /tokenize: a text (a BOS first unless add_special_tokens is false, as
    /v1/completions tokenizes it) or chat messages (the ids /v1/chat/completions would run)."""
    srv: ServerState = request.app.state.server
    srv.resolve(body.model)
    tok = srv.tok
    if tok is None:
        raise APIError(400, "prompt: this model has no tokenizer", param="prompt")
    if body.prompt is not None:
        srv.check_chars(len(body.prompt), "prompt")
        bos = body.add_special_tokens is not False
        ids = await srv.tokenize(lambda: ([tok.bos_id] if bos else []) + tok.encode_plain(body.prompt))
    else:
        if body.add_special_tokens:
            raise APIError(400, "add_special_tokens: the V4.1 chat encoding already starts with BOS; "
                                "leave it unset or false with messages", param="add_special_tokens")
        thinking, effort = body.resolve_thinking()
        ids = await srv.tokenize(lambda: encode_messages(srv, body, thinking, effort))
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=srv.max_model_len,
                            token_strs=[srv.tok_text(i) for i in ids] if body.return_token_strs else None)


@models_router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request):
    srv: ServerState = request.app.state.server
    srv.resolve(body.model)
    if srv.tok is None:
        raise APIError(400, "tokens: this model has no tokenizer", param="tokens")
    bad = [t for t in body.tokens if not 0 <= t < srv.tok.vocab_size]
    if bad:
        raise APIError(400, f"tokens: token id {bad[0]} is outside the vocabulary [0, {srv.tok.vocab_size})",
                       param="tokens")
    ids = list(body.tokens)
    return DetokenizeResponse(prompt=await srv.tokenize(lambda: srv.tok.decode(ids)))


@ops_router.get("/health", response_model=Health, responses={503: {"model": Health,
                "description": "The engine has failed (the process should be restarted)"}})
async def health(request: Request):
    status, reason = request.app.state.worker.health()
    step = _step_status(request.app.state.engine)
    return JSONResponse(Health(status=status, reason=reason, **step).model_dump(),
                        status_code=503 if status == "failed" else 200)


@ops_router.get("/metrics")
async def prom(request: Request):
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


class _HTTPMetrics:
    """Pure ASGI middleware (keeps `receive` untouched, so disconnects still reach handlers)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        seen = {}

        async def _send(msg):
            if msg["type"] == "http.response.start":
                seen["status"] = msg["status"]
            await send(msg)
        try:
            await self.app(scope, receive, _send)
        finally:
            route = scope.get("path", "") if scope.get("path") in _ROUTES else "other"
            self.metrics.http.labels(route, str(seen.get("status", 0))).inc()


class _BodyLimit:
    """Pure ASGI middleware: 413 for a request body over `max_bytes`, from the `content-length`
    header before anything is read, or while a chunked body streams in."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> APIError:
        e = BodyTooLarge(self.max_bytes)
        return APIError(413, e.detail, code=e.code)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    n = int(v)
                except ValueError:
                    n = 0
                if n > self.max_bytes:
                    return await self._too_large().response()(scope, receive, send)
        seen, started = 0, False

        async def _receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return msg

        async def _send(msg):
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)
        try:
            await self.app(scope, _receive, _send)
        except BodyTooLarge:                      # raised where no handler turned it into a response
            if started:
                raise
            await self._too_large().response()(scope, receive, send)


def _bearer_auth(api_key: str | None):
    """A dependency requiring `Authorization: Bearer <api_key>` (a no-op without a key). Async: a
    plain function would run in the shared thread pool, where a burst of other work delays it."""

    async def auth(request: Request) -> None:
        if not api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise unauthorized()

    return auth


def _exit_process(reason: str) -> None:
    """The engine failed for good: ask the server to shut down (SIGTERM to this process), so that a
    supervisor restarts it; `cedlm serve` then exits with status 1."""
    log.critical("the engine has failed (%s): shutting the server down", reason)
    os.kill(os.getpid(), signal.SIGTERM)


def create_app(llm_or_engine, *, served_model_name: str | None = None,
               aliases: AliasTable | dict[str, str] | None = None, api_key: str | None = None,
               max_waiting: int | None = None, queue_timeout: float | None = 30.0,
               retry_after: int = 1, max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES,
               max_prompt_tokens: int | None = None, exit_on_engine_failure: bool = False,
               default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
               worker_options: dict | None = None, allow_remote_images: bool = False,
               metrics_public: bool = False, sampling_defaults: dict | None = None,
               log_interval: float | None = 10.0) -> FastAPI:
    """An app serving an `LLM` or an `Engine`.

    served_model_name: the primary name (default "cedlm"); aliases: an AliasTable, or a dict
    {alias: "current"|"deprecated"} (default {"cedlm": "current"}); api_key: require
    `Authorization: Bearer <key>` on /v1 routes (None: open); max_waiting: bound on requests waiting
    for admission while the engine is full (None: unbounded); queue_timeout: seconds a request may
    wait for admission (None: forever); beyond either -> 429 with `retry-after: retry_after`.
    max_body_bytes: request bodies above it get 413 (None: no limit; default 8 MiB);
    max_prompt_tokens: longer prompts get 400 (None: max_model_len); exit_on_engine_failure (True,
    or a callable given the reason, which shuts the server down itself): when
    the engine fails for good, SIGTERM this process (the CLI sets it); default_max_tokens: the
    max_tokens of a request that omits it (None or 0: the rest of the context); worker_options: more
    `EngineWorker` keywords (max_step_failures, max_restarts, degraded_window, stall_after,
    on_failed); allow_remote_images: fetch http(s) `image_url`s (default off: 400; data: URLs always).
    metrics_public: with an api_key, leave /metrics open (default: behind the key, like every
    route but /health; the key is checked from the headers before a body is read: auth.py).
    sampling_defaults: {field: value} for the sampling fields a request leaves unset
    (`sampling_defaults.read` of a generation_config.json; None: the neutral values).
    log_interval: seconds between the throughput log lines while there is traffic (None: none;
    server/tracing.py).
    """
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    tokenizer = getattr(llm_or_engine, "tokenizer", None) or getattr(engine, "tokenizer", None)
    if isinstance(aliases, AliasTable):
        table = aliases
        if served_model_name is not None and served_model_name != table.served_name:
            raise ValueError("served_model_name: differs from the alias table's served name")
    else:
        table = AliasTable(served_model_name or "cedlm", aliases)
    on_failed = exit_on_engine_failure if callable(exit_on_engine_failure) else _exit_process
    opts = {"on_failed": on_failed if exit_on_engine_failure else None, **(worker_options or {})}
    worker = EngineWorker(engine, max_waiting=max_waiting, queue_timeout=queue_timeout,
                          retry_after=retry_after, **opts)
    metrics = Metrics(worker, table.served_name)
    worker.on_finished += [metrics.latency.observe, log_finished]     # histograms, the per-request line

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        ticker = asyncio.ensure_future(ThroughputLog(worker, log_interval).run()) if log_interval else None
        try:
            yield
        finally:
            if ticker is not None:
                ticker.cancel()
            worker.stop()

    app = FastAPI(title="cedlm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = ServerState(engine, tokenizer, table, worker, metrics,
                                   max_prompt_tokens=max_prompt_tokens,
                                   default_max_tokens=default_max_tokens or None,
                                   sampling_defaults=sampling_defaults)
    app.state.worker, app.state.engine, app.state.aliases, app.state.metrics = worker, engine, table, metrics
    app.state.server.images = image_options(getattr(engine, "model", None), allow_remote_images)   # server/images.py
    app.add_middleware(ClientContext)                 # the client and its disconnect, for queued work (lanes.py)
    app.add_middleware(BodyGuard)                     # body deadline, JSON nesting depth (body_guard.py)
    if max_body_bytes is not None:
        app.add_middleware(_BodyLimit, max_bytes=int(max_body_bytes))
    if api_key:                                       # before the body limit and any parsing
        app.add_middleware(APIKeyMiddleware, api_key=api_key, metrics_public=metrics_public)
    app.add_middleware(_HTTPMetrics, metrics=metrics)
    app.add_middleware(RequestIdMiddleware)           # outermost: every response carries x-request-id
    install_error_handlers(app)
    srv = app.state.server                            # token ids: within the model's and the tokenizer's vocabulary
    vocab = min(srv.vocab_size, srv.tok.vocab_size) if srv.tok is not None else srv.vocab_size
    bounds = RuntimeBounds(vocab_size=vocab, max_model_len=srv.max_model_len, max_samples=srv.max_samples)
    fix_openapi(app, lambda schema: refine_openapi(schema, bounds))   # the validators' rules, these bounds
    auth = [Depends(_bearer_auth(api_key))]
    app.include_router(ops_router)
    app.include_router(models_router, dependencies=auth)
    app.include_router(chat.router, dependencies=auth)
    app.include_router(completions.router, dependencies=auth)
    app.include_router(responses.router, dependencies=auth)     # the Responses API, via the chat path
    app.include_router(version_router)
    app.include_router(ui_router)                     # the chat page at / (server/ui/)
    app.include_router(unsupported_router)            # 404 naming what cedlm serves instead
    return app


def api_key_from_env(cli_value: str | None) -> str | None:
    return cli_value if cli_value else (os.environ.get("CEDLM_API_KEY") or None)
