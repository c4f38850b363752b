"""The OpenAI-compatible HTTP server: `create_app(llm_or_engine, ...)` -> FastAPI app.

Routes: POST /v1/chat/completions, POST /v1/completions (both streaming over SSE or not),
GET /v1/models, GET /health, GET /metrics (Prometheus text format).

Behaviour (vLLM's OpenAI server where the issue is silent):

- Chat uses the DeepSeek-V4.1 encoding (`cedlm.text.chat.encode_chat`). Thinking mode is used when
  reasoning is requested (`reasoning_effort` other than "none", the integer extension
  `cedlm_reasoning_effort`, or `thinking` / `chat_template_kwargs.thinking`); otherwise chat mode.
  OpenAI tiers map to V4.1 integers as in `protocol.EFFORT_TIERS`:
  none -> chat mode, minimal=25, low=50, medium=62, high=75, xhigh=75, max=100; an integer 1..100
  is accepted in `reasoning_effort` or `cedlm_reasoning_effort`. The effort used is echoed in the
  `x-cedlm-reasoning-effort` response header ("none" in chat mode).
- In thinking mode the output is split with `parse_assistant` into `reasoning_content` and
  `content`; `usage.completion_tokens_details.reasoning_tokens` counts the generated tokens up to
  and including the first `</think>` (all of them if it never came). In chat mode everything is
  `content`. `usage.prompt_tokens_details.cached_tokens` = prompt tokens served by the prefix cache.
- Model names go through the explicit alias table (`aliases.py`).
- Errors are `{"error": {"message", "type", "param", "code"}}`: 400 for invalid bodies (including
  validation errors, which FastAPI would make 422), 401 bad/missing API key, 404 unknown model,
  429 (+ `retry-after`) when the engine cannot take the request, 500 on an engine failure.
- A client that disconnects (while waiting, mid-generation or mid-stream) aborts its request; its
  KV blocks are freed by the engine thread.
- The engine is owned by one thread (`worker.EngineWorker`); handlers never touch it.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from cedlm.engine.sampler import SamplingParams
from cedlm.server.aliases import DEPRECATION_HEADER, AliasTable, ModelNotFound, Resolved
from cedlm.server.metrics import Metrics
from cedlm.server.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChoiceLogprobs, CompletionChoice, CompletionLogprobs, CompletionRequest,
    CompletionResponse, CompletionTokensDetails, DeltaMessage, ErrorInfo, ErrorResponse, ModelCard,
    ModelList, PromptTokensDetails, TokenLogprob, TopLogprob, Usage,
)
from cedlm.server.worker import Admitted, Delta, EngineWorker, Failed, Finished
from cedlm.text.chat import EOS, THINK_END, THINK_START, encode_chat, parse_assistant, parse_tool_calls

log = logging.getLogger("cedlm.server")
EFFORT_HEADER = "x-cedlm-reasoning-effort"
_DISCONNECTED = object()
_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}


# --------------------------------------------------------------------------- errors


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


def _validation_error(exc: RequestValidationError) -> APIError:
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


# --------------------------------------------------------------------------- helpers


class ReasoningSplitter:
    """Split streamed output into reasoning / content deltas, consistently with `parse_assistant`.

    Tails that may still become `<think>` (at the start) or `</think>` are held back, so what has
    been streamed is always a prefix of the final split."""

    def __init__(self, thinking: bool):
        self.thinking, self.text, self.sent_r, self.sent_c = thinking, "", 0, 0

    @staticmethod
    def _held(t: str, marker: str) -> int:
        for k in range(min(len(marker) - 1, len(t)), 0, -1):
            if t.endswith(marker[:k]):
                return k
        return 0

    def _split(self, final: bool) -> tuple[str, str]:
        t = self.text
        if not self.thinking:
            return "", t
        if final:
            return parse_assistant(t, thinking=True)
        if t.startswith(THINK_START):
            t = t[len(THINK_START):]
        elif THINK_START.startswith(t):
            return "", ""
        if THINK_END in t:
            r, c = t.split(THINK_END, 1)
            return r, c[: len(c) - self._held(c, EOS)]
        return t[: len(t) - self._held(t, THINK_END)], ""

    def _emit(self, r: str, c: str) -> tuple[str, str]:
        dr = r[self.sent_r:] if len(r) > self.sent_r else ""
        dc = c[self.sent_c:] if len(c) > self.sent_c else ""
        self.sent_r, self.sent_c = max(self.sent_r, len(r)), max(self.sent_c, len(c))
        return dr, dc

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._emit(*self._split(False))

    def finish(self) -> tuple[str, str]:
        return self._emit(*self._split(True))


def _lp(x: float) -> float:
    return max(float(x), -9999.0)          # JSON has no -inf


class _Job:
    """One request's life on the handler side: submit, wait for admission, read events, abort."""

    def __init__(self, server: "_Server", raw: Request, prefix: str, prompt_ids: list[int],
                 params: SamplingParams):
        self.s, self.raw = server, raw
        self.rid = f"{prefix}-{uuid.uuid4().hex}"
        self.prompt_ids, self.params = prompt_ids, params
        self.done = False
        self.q: asyncio.Queue | None = None
        self.watcher: asyncio.Task | None = None
        self.cached = 0

    async def _watch(self) -> None:
        while True:
            msg = await self.raw.receive()
            if msg["type"] == "http.disconnect":
                self.q.put_nowait(_DISCONNECTED)
                return

    def watch(self, on: bool) -> None:
        if on and self.watcher is None:
            self.watcher = asyncio.ensure_future(self._watch())
        elif not on and self.watcher is not None:
            self.watcher.cancel()
            self.watcher = None

    async def next(self):
        ev = await self.q.get()
        if ev is _DISCONNECTED:
            self.close()
            return None
        if isinstance(ev, (Finished, Failed)):
            self.done = True
        return ev

    async def start(self) -> bool:
        """Submit and wait until admitted. False: the client went away. Raises APIError (400/429)."""
        self.q = self.s.worker.submit(self.rid, self.prompt_ids, self.params)
        self.watch(True)
        ev = await self.next()
        if ev is None:
            return False
        if isinstance(ev, Failed):
            self.close()
            raise APIError.from_failed(ev)
        assert isinstance(ev, Admitted), ev
        self.cached = ev.cached_tokens
        return True

    def close(self) -> None:
        self.watch(False)
        if not self.done:              # the client went away (or the handler was cancelled)
            self.done = True
            self.s.metrics.disconnects.inc()
            self.s.worker.abort(self.rid)


class _Server:
    def __init__(self, engine, tokenizer, aliases: AliasTable, worker: EngineWorker, metrics: Metrics):
        self.engine, self.tok, self.aliases, self.worker, self.metrics = engine, tokenizer, aliases, worker, metrics
        self.max_model_len = engine.max_model_len
        self.pool_tokens = engine.scheduler.num_blocks * engine.block_tokens
        self.think_end_id = tokenizer.token_to_id(THINK_END) if tokenizer is not None else None
        self.created = int(time.time())

    # ---------------------------------------------------------------- request building
    def resolve(self, name) -> Resolved:
        try:
            return self.aliases.resolve(name)
        except ModelNotFound as e:
            raise APIError(404, str(e), param="model", code="model_not_found") from None

    def check_len(self, ids: list[int], param: str) -> None:
        if len(ids) > self.max_model_len:
            raise APIError(400, f"{param}: the prompt has {len(ids)} tokens, more than the context "
                                f"(max_model_len {self.max_model_len})", param=param,
                           code="context_length_exceeded")

    def params(self, body, n_prompt: int, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if max_tokens is None:
            max_tokens = max(1, min(self.max_model_len, self.pool_tokens) - n_prompt)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=0 if body.top_k is None else body.top_k,
                seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos, logprobs=logprobs,
                include_stop_str_in_output=body.include_stop_str_in_output)
        except ValueError as e:
            msg = str(e)
            raise APIError(400, msg, param=msg.split(" ", 1)[0]) from None

    def headers(self, resolved: Resolved, extra: dict | None = None) -> dict:
        h = dict(extra or {})
        if resolved.deprecated:
            h[DEPRECATION_HEADER] = resolved.header
        return h

    # ---------------------------------------------------------------- logprobs
    def _tok_text(self, i: int) -> str:
        return self.tok.decode([i]) if self.tok is not None else str(i)

    def _tok_bytes(self, i: int) -> list[int] | None:
        return list(self.tok.token_bytes(i)) if self.tok is not None else None

    def chat_logprobs(self, ids, lps, tops) -> list[TokenLogprob]:
        out = []
        for k, (i, lp) in enumerate(zip(ids, lps)):
            top = []
            if tops is not None and k < len(tops):
                top = [TopLogprob(token=self._tok_text(j), logprob=_lp(v), bytes=self._tok_bytes(j))
                       for j, v in zip(*tops[k])]
            out.append(TokenLogprob(token=self._tok_text(i), logprob=_lp(lp), bytes=self._tok_bytes(i),
                                    top_logprobs=top))
        return out

    def completion_logprobs(self, ids, lps, tops, offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs(top_logprobs=[] if tops is not None else None)
        for k, (i, lp) in enumerate(zip(ids, lps)):
            t = self._tok_text(i)
            out.tokens.append(t)
            out.token_logprobs.append(_lp(lp))
            out.text_offset.append(offset)
            offset += len(t)
            if tops is not None:
                out.top_logprobs.append({self._tok_text(j): _lp(v) for j, v in zip(*tops[k])})
        return out

    def reasoning_tokens(self, ids: list[int], thinking: bool) -> int:
        if not thinking:
            return 0
        if self.think_end_id is not None and self.think_end_id in ids:
            return ids.index(self.think_end_id) + 1
        return len(ids)


def _sse(obj) -> str:
    if hasattr(obj, "model_dump"):
        obj = obj.model_dump(exclude_none=True)
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


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


# --------------------------------------------------------------------------- the app



async def _collect(job, want_top: bool):
    """A non-streaming request's events until it finishes: (text, token ids, logprobs, top
    logprobs or None, finish reason); None when the client went away (the job is aborted)."""
    text_out, out_ids, lps, tops, reason = "", [], [], ([] if want_top else None), None
    try:
        while True:
            ev = await job.next()
            if ev is None:
                return None
            if isinstance(ev, Failed):
                raise APIError.from_failed(ev)
            if isinstance(ev, Delta):
                text_out += ev.text
                out_ids += ev.token_ids
                lps += ev.logprobs
                if tops is not None and ev.top_logprobs:
                    tops += ev.top_logprobs
            elif isinstance(ev, Finished):
                reason = ev.reason
                break
    finally:
        job.close()
    return text_out, out_ids, lps, tops, reason

def create_app(llm_or_engine, *, served_model_name: str | None = None,
               aliases: AliasTable | dict[str, str] | None = None, api_key: str | None = None,
               max_waiting: int | None = None, queue_timeout: float | None = 30.0,
               retry_after: int = 1) -> FastAPI:
    """An app serving an `LLM` or an `Engine`.

    served_model_name: the primary name (default "cedlm"); aliases: an AliasTable, or a dict
    {alias: "current"|"deprecated"} (default {"cedlm": "current"}); api_key: require
    `Authorization: Bearer <key>` on /v1 routes (None: open); max_waiting: bound on requests waiting
    for admission while the engine is full (None: unbounded); queue_timeout: seconds a request may
    wait for admission (None: forever); beyond either -> 429 with `retry-after: retry_after`.
    """
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    tokenizer = getattr(llm_or_engine, "tokenizer", None) or getattr(engine, "tokenizer", None)
    if isinstance(aliases, AliasTable):
        table = aliases
        if served_model_name is not None and served_model_name != table.served_name:
            raise ValueError("served_model_name: differs from the alias table's served name")
    else:
        table = AliasTable(served_model_name or "cedlm", aliases)
    worker = EngineWorker(engine, max_waiting=max_waiting, queue_timeout=queue_timeout,
                          retry_after=retry_after)
    metrics = Metrics(worker, table.served_name)
    srv = _Server(engine, tokenizer, table, worker, metrics)

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="cedlm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server, app.state.worker, app.state.engine, app.state.aliases = srv, worker, engine, table
    app.state.metrics = metrics
    app.add_middleware(_HTTPMetrics, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        typ = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        return APIError(exc.status_code, str(exc.detail), type=typ, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _crash(request, exc: Exception):
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    def auth(request: Request) -> None:
        if not api_key:
            return
        h = request.headers.get("authorization", "")
        scheme, _, token = h.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           type="invalid_request_error", code="invalid_api_key",
                           headers={"www-authenticate": "Bearer"})

    # ---------------------------------------------------------------- plain routes
    @app.get("/health")
    async def health():
        if not worker.alive:
            return JSONResponse({"status": "engine thread not running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prom():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models():
        cards = [ModelCard(id=table.served_name, created=srv.created, root=table.served_name)]
        for name, st in table.aliases.items():
            cards.append(ModelCard(id=name, created=srv.created, root=table.served_name, status=st,
                                   replacement=table.served_name if st == "deprecated" else None))
        return ModelList(data=cards).model_dump(exclude_none=True)

    # ---------------------------------------------------------------- chat
    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat(body: ChatCompletionRequest, raw: Request):
        resolved = srv.resolve(body.model)
        if tokenizer is None:
            raise APIError(400, "messages: this model has no tokenizer; use /v1/completions with "
                                "token ids", param="messages")
        thinking, effort = body.resolve_thinking()
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs=true", param="top_logprobs")
        msgs = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            text = encode_chat(msgs, "thinking" if thinking else "chat",
                               effort if thinking else None, tools=body.tools)
        except (ValueError, KeyError, TypeError) as e:
            raise APIError(400, f"messages: {e}", param="messages") from None
        ids = tokenizer.encode(text)
        srv.check_len(ids, "messages")
        params = srv.params(body, len(ids), body.max_completion_tokens or body.max_tokens,
                            (body.top_logprobs or 0) if body.logprobs else None)
        job = _Job(srv, raw, "chatcmpl", ids, params)
        headers = srv.headers(resolved, {EFFORT_HEADER: str(effort) if thinking else "none"})
        if not await job.start():
            return Response(status_code=499)
        created = int(time.time())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def usage(out_ids: list[int]) -> Usage:
            return Usage(prompt_tokens=len(ids), completion_tokens=len(out_ids),
                         total_tokens=len(ids) + len(out_ids),
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=job.cached),
                         completion_tokens_details=CompletionTokensDetails(
                             reasoning_tokens=srv.reasoning_tokens(out_ids, thinking)))

        if not body.stream:
            got = await _collect(job, bool(body.top_logprobs))
            if got is None:
                return Response(status_code=499)
            text_out, out_ids, lps, tops, reason = got
            reasoning, content = parse_assistant(text_out, thinking=True) if thinking else ("", text_out)
            tool_calls = None
            if body.tools:
                content, calls = parse_tool_calls(content)
                if calls:
                    tool_calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", **c} for c in calls]
                    reason = "tool_calls" if reason == "stop" else reason
            msg = AssistantMessage(content=content, reasoning_content=reasoning if thinking else None,
                                   tool_calls=tool_calls)
            lp = ChoiceLogprobs(content=srv.chat_logprobs(out_ids, lps, tops)) if body.logprobs else None
            resp = ChatCompletionResponse(id=job.rid, created=created, model=resolved.requested,
                                          choices=[ChatChoice(message=msg, logprobs=lp, finish_reason=reason)],
                                          usage=usage(out_ids), warning=resolved.warning)
            return JSONResponse(resp.model_dump(exclude_none=True), headers=headers)

        split = ReasoningSplitter(thinking)

        def chunk(delta: DeltaMessage, finish=None, logprobs=None, **kw) -> str:
            return _sse(ChatCompletionChunk(id=job.rid, created=created, model=resolved.requested,
                                            choices=[ChatChunkChoice(delta=delta, logprobs=logprobs,
                                                                     finish_reason=finish)], **kw))

        async def stream():
            out_ids: list[int] = []
            try:
                yield chunk(DeltaMessage(role="assistant", content=""), warning=resolved.warning)
                while True:
                    ev = await job.next()
                    if ev is None:
                        return
                    if isinstance(ev, Failed):
                        yield _sse(APIError.from_failed(ev).body())
                        return
                    if isinstance(ev, Delta):
                        out_ids.extend(ev.token_ids)
                        dr, dc = split.feed(ev.text)
                        lp = (ChoiceLogprobs(content=srv.chat_logprobs(ev.token_ids, ev.logprobs, ev.top_logprobs))
                              if body.logprobs else None)
                        if dr or dc or lp is not None:
                            yield chunk(DeltaMessage(reasoning_content=dr or None, content=dc or None),
                                        logprobs=lp)
                    elif isinstance(ev, Finished):
                        dr, dc = split.finish()
                        if dr or dc:
                            yield chunk(DeltaMessage(reasoning_content=dr or None, content=dc or None))
                        yield chunk(DeltaMessage(), finish=ev.reason)
                        if include_usage:
                            yield _sse(ChatCompletionChunk(id=job.rid, created=created, model=resolved.requested,
                                                           choices=[], usage=usage(out_ids)))
                        yield "data: [DONE]\n\n"
                        return
            finally:
                job.close()

        job.watch(False)          # from here StreamingResponse watches for the disconnect
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)

    # ---------------------------------------------------------------- completions
    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(body: CompletionRequest, raw: Request):
        resolved = srv.resolve(body.model)
        prompt = body.prompt
        if isinstance(prompt, str):
            if tokenizer is None:
                raise APIError(400, "prompt: this model has no tokenizer; send token ids", param="prompt")
            ids = tokenizer.encode(prompt, add_bos=True)
        else:
            ids = [int(t) for t in prompt]
        srv.check_len(ids, "prompt")
        params = srv.params(body, len(ids), body.max_tokens, body.logprobs)
        job = _Job(srv, raw, "cmpl", ids, params)
        headers = srv.headers(resolved)
        if not await job.start():
            return Response(status_code=499)
        created = int(time.time())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def usage(n_out: int) -> Usage:
            return Usage(prompt_tokens=len(ids), completion_tokens=n_out, total_tokens=len(ids) + n_out,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=job.cached))

        want_top = bool(body.logprobs)
        if not body.stream:
            got = await _collect(job, want_top)
            if got is None:
                return Response(status_code=499)
            text_out, out_ids, lps, tops, reason = got
            lp = srv.completion_logprobs(out_ids, lps, tops, 0) if body.logprobs is not None else None
            resp = CompletionResponse(id=job.rid, created=created, model=resolved.requested,
                                      choices=[CompletionChoice(text=text_out, logprobs=lp, finish_reason=reason)],
                                      usage=usage(len(out_ids)), warning=resolved.warning)
            return JSONResponse(resp.model_dump(exclude_none=True), headers=headers)

        def chunk(text: str, finish=None, logprobs=None, **kw) -> str:
            return _sse(CompletionResponse(id=job.rid, created=created, model=resolved.requested,
                                           choices=[CompletionChoice(text=text, logprobs=logprobs,
                                                                     finish_reason=finish)], **kw))

        async def stream():
            n_out, offset, first = 0, 0, True
            try:
                while True:
                    ev = await job.next()
                    if ev is None:
                        return
                    if isinstance(ev, Failed):
                        yield _sse(APIError.from_failed(ev).body())
                        return
                    if isinstance(ev, Delta):
                        n_out += len(ev.token_ids)
                        lp = (srv.completion_logprobs(ev.token_ids, ev.logprobs, ev.top_logprobs, offset)
                              if body.logprobs is not None else None)
                        offset += len(ev.text)
                        if ev.text or lp is not None or first:
                            yield chunk(ev.text, logprobs=lp, warning=resolved.warning if first else None)
                            first = False
                    elif isinstance(ev, Finished):
                        yield chunk("", finish=ev.reason, warning=resolved.warning if first else None)
                        if include_usage:
                            yield _sse({"id": job.rid, "object": "text_completion", "created": created,
                                        "model": resolved.requested, "choices": [],
                                        "usage": usage(n_out).model_dump(exclude_none=True)})
                        yield "data: [DONE]\n\n"
                        return
            finally:
                job.close()

        job.watch(False)
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)

    return app


def api_key_from_env(cli_value: str | None) -> str | None:
    return cli_value if cli_value else (os.environ.get("CEDLM_API_KEY") or None)
