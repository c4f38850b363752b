"""POST /v1/responses: OpenAI's Responses API, served through the chat path.

The request is translated into the chat completion it stands for (``protocol.responses_api.
to_chat``: input items -> messages, instructions -> a system message, reasoning.effort ->
reasoning_effort, function tools, tool_choice, text.format -> response_format, max_output_tokens ->
max_tokens) and run by the chat handler (`chat.py`), so encoding, effort, tools, structured
output, images, limits, request ids and metrics are the chat path's. Its answer becomes:

- a Response object (``object: "response"``): output items ``reasoning`` (thinking mode: the
  reasoning text in ``content``; no summary), ``message`` (one ``output_text`` part, or a
  ``refusal`` part) and one ``function_call`` per tool call; ``status`` "completed", or
  "incomplete" with ``incomplete_details.reason: "max_output_tokens"`` when cut by the limit;
  ``usage`` as input/output tokens with cached and reasoning token details;
- or, with ``stream: true``, the typed events the openai client's ``responses.stream`` assembles
  (``ResponseEvents``): response.created, response.in_progress, then per item
  response.output_item.added, response.content_part.added, response.reasoning_text.delta /
  response.output_text.delta / response.function_call_arguments.delta, the matching .done events
  and response.output_item.done, and last response.completed (or response.incomplete). An engine
  failure mid-stream is an ``error`` event.

Errors: a bad value is a 400 naming the Responses field; a field or feature cedlm does not serve
(stored responses, previous_response_id, built-in tools, ...) is a 501 ``unsupported_feature``
naming it. Nothing is stored: there is no GET /v1/responses/{id}.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from cedlm.server import chat as chat_route
from cedlm.server.errors import APIError, validation_error
from cedlm.server.protocol import ChatCompletionRequest
from cedlm.server.protocol.responses_api import ResponsesRequest, UnsupportedFeature, effort_of, to_chat
from cedlm.server.streaming import sse
from cedlm.server.tracing import engine_request_id

router = APIRouter()

# chat field -> the Responses field a client set (for error messages)
_FIELD = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
          "reasoning_effort": "reasoning.effort"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The validated chat request, or the error naming the Responses field."""
    try:
        data = to_chat(body)
    except UnsupportedFeature as e:
        raise APIError(501, f"{e} (not supported by cedlm's /v1/responses)", param=e.param,
                       code="unsupported_feature") from None
    except ValueError as e:
        raise APIError(400, str(e), param=str(e).split(":", 1)[0].split(".")[0].split("[")[0]) from None
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as e:
        err = validation_error(RequestValidationError(e.errors()))
        for chat_name, name in _FIELD.items():
            if err.message.startswith(chat_name):
                err.message = name + err.message[len(chat_name):]
            if err.param == chat_name:
                err.param = name
        raise err from None


class Envelope:
    """The Response object's fields that do not depend on the output."""

    def __init__(self, rid: str, body: ResponsesRequest, model: str, defaults: dict | None = None):
        fmt = (body.text or {}).get("format") or {"type": "text"}
        self.fields: dict[str, Any] = {
            "id": rid, "object": "response", "created_at": int(time.time()), "model": model,
            "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "metadata": (body.model_extra or {}).get("metadata") or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": {"effort": effort_of(body), "summary": None}, "store": False,
            "temperature": (defaults or {}).get("temperature", 1.0) if body.temperature is None else body.temperature,
            "top_p": (defaults or {}).get("top_p", 1.0) if body.top_p is None else body.top_p, "text": {"format": fmt},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "truncation": "disabled",
            "user": (body.model_extra or {}).get("user"), "background": False}

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 reason: str | None = None) -> dict:
        out = {**self.fields, "status": status, "output": output, "usage": usage}
        if status == "completed":
            out["completed_at"] = int(time.time())
        if reason == "length":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out


def usage_of(u: dict | None) -> dict | None:
    """The chat usage as the Responses usage."""
    if not u:
        return None
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
            "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                                     "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens":
                                      (u.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)}}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(tc: dict, status: str = "completed") -> dict:
    return {"id": _new_id("fc"), "type": "function_call", "call_id": tc["id"], "name": tc["function"]["name"],
            "arguments": tc["function"]["arguments"], "status": status}


def output_items(msg: dict, reason: str | None) -> list[dict]:
    """The output items of a finished chat message."""
    items: list[dict] = []
    status = "incomplete" if reason == "length" else "completed"
    if msg.get("reasoning_content"):
        items.append({"id": _new_id("rs"), "type": "reasoning", "summary": [], "status": status,
                      "content": [{"type": "reasoning_text", "text": msg["reasoning_content"]}]})
    parts = []
    if msg.get("content"):
        parts.append(_text_part(msg["content"]))
    if msg.get("refusal"):
        parts.append({"type": "refusal", "refusal": msg["refusal"]})
    if parts:
        items.append({"id": _new_id("msg"), "type": "message", "role": "assistant", "status": status,
                      "content": parts})
    items += [_call_item(tc) for tc in msg.get("tool_calls") or []]
    return items


class ResponseEvents:
    """Chat chunks in, the Responses stream events out (module docstring). One item is open at a
    time: reasoning, then the message, then each function call."""

    def __init__(self, env: Envelope):
        self.env, self.seq, self.items = env, 0, []
        self.open: dict | None = None          # the item being streamed
        self.text = ""
        self.reason: str | None = None
        self.usage: dict | None = None

    def ev(self, kind: str, **kw) -> str:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq - 1, **kw})

    def start(self) -> str:
        r = self.env.response("in_progress", [])
        return self.ev("response.created", response=r) + self.ev("response.in_progress", response=r)

    def _at(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items)}

    def _close(self) -> str:
        if self.open is None:
            return ""
        it, out = self.open, ""
        it["status"] = "incomplete" if self.reason == "length" and it["type"] != "function_call" else "completed"
        if it["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": self.text}
            it["content"] = [part]
            out += self.ev("response.reasoning_text.done", **self._at(), content_index=0, text=self.text)
            out += self.ev("response.content_part.done", **self._at(), content_index=0, part=part)
        elif it["type"] == "message":
            part = _text_part(self.text)
            it["content"] = [part]
            out += self.ev("response.output_text.done", **self._at(), content_index=0, text=self.text, logprobs=[])
            out += self.ev("response.content_part.done", **self._at(), content_index=0, part=part)
        out += self.ev("response.output_item.done", output_index=len(self.items), item=it)
        self.items.append(it)
        self.open, self.text = None, ""
        return out

    def _open(self, item: dict, part: dict | None) -> str:
        out = self._close()
        self.open = item
        out += self.ev("response.output_item.added", output_index=len(self.items),
                       item={**item, "status": "in_progress"})
        if part is not None:
            out += self.ev("response.content_part.added", **self._at(), content_index=0, part=part)
        return out

    def reasoning(self, delta: str) -> str:
        out = "" if self.open is not None and self.open["type"] == "reasoning" else self._open(
            {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": []},
            {"type": "reasoning_text", "text": ""})
        self.text += delta
        return out + self.ev("response.reasoning_text.delta", **self._at(), content_index=0, delta=delta)

    def content(self, delta: str) -> str:
        out = "" if self.open is not None and self.open["type"] == "message" else self._open(
            {"id": _new_id("msg"), "type": "message", "role": "assistant", "content": []}, _text_part(""))
        self.text += delta
        return out + self.ev("response.output_text.delta", **self._at(), content_index=0, delta=delta, logprobs=[])

    def refusal(self, text: str) -> str:
        item = {"id": _new_id("msg"), "type": "message", "role": "assistant", "content": []}
        part = {"type": "refusal", "refusal": text}
        out = self._open(item, {"type": "refusal", "refusal": ""})
        out += self.ev("response.refusal.delta", **self._at(), content_index=0, delta=text)
        out += self.ev("response.refusal.done", **self._at(), content_index=0, refusal=text)
        out += self.ev("response.content_part.done", **self._at(), content_index=0, part=part)
        item["content"], item["status"] = [part], "completed"
        out += self.ev("response.output_item.done", output_index=len(self.items), item=item)
        self.items.append(item)
        self.open = None
        return out

    def call(self, tc: dict) -> str:
        item = _call_item(tc)
        out = self._open({**item, "arguments": ""}, None)
        args = item["arguments"]
        out += self.ev("response.function_call_arguments.delta", **self._at(), delta=args)
        out += self.ev("response.function_call_arguments.done", **self._at(), arguments=args, name=item["name"])
        self.open = None
        out += self.ev("response.output_item.done", output_index=len(self.items), item=item)
        self.items.append(item)
        return out

    def chunk(self, c: dict) -> str:
        """The events of one chat chunk."""
        if "error" in c:
            e = c["error"]
            return self.ev("error", code=e.get("code"), message=e.get("message"), param=e.get("param"))
        if c.get("usage") is not None and not c.get("choices"):
            self.usage = usage_of(c["usage"])
        out = ""
        for ch in c.get("choices") or []:
            d = ch.get("delta") or {}
            if d.get("reasoning_content"):
                out += self.reasoning(d["reasoning_content"])
            if d.get("content"):
                out += self.content(d["content"])
            for tc in d.get("tool_calls") or []:
                out += self.call(tc)
            if d.get("refusal"):
                out += self.refusal(d["refusal"])
            if ch.get("finish_reason"):
                self.reason = ch["finish_reason"]
        return out

    def finish(self) -> str:
        out = self._close()
        status = "incomplete" if self.reason == "length" else "completed"
        r = self.env.response(status, self.items, self.usage, self.reason)
        return out + self.ev(f"response.{status}", response=r)


async def _events(chat_body: AsyncIterator, events: ResponseEvents) -> AsyncIterator[str]:
    """Re-frame the chat stream's SSE into Responses events."""
    yield events.start()
    async for piece in chat_body:
        text = piece.decode() if isinstance(piece, bytes) else piece
        for block in text.split("\n\n"):
            if not block.startswith("data: "):
                continue
            data = block[len("data: "):]
            if data == "[DONE]":
                yield events.finish()
                return
            out = events.chunk(json.loads(data))
            if out:
                yield out


_DOC = {501: {"description": "A Responses field or feature cedlm does not serve (`param` names it)",
              "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}}


@router.post("/v1/responses", responses=_DOC)
async def responses(body: ResponsesRequest, raw: Request):
    """OpenAI's Responses API (module docstring): a Response object, or its typed SSE events."""
    chat_body = _chat_request(body)
    answer = await chat_route.chat(chat_body, raw)
    headers = {k: v for k, v in answer.headers.items() if k.startswith("x-")}
    if answer.status_code != 200:
        return answer                                  # 499: the client went away
    model = chat_body.model or raw.app.state.server.aliases.served_name
    env = Envelope(engine_request_id(raw, "resp"), body, model, raw.app.state.server.sampling_defaults)
    if isinstance(answer, StreamingResponse):
        events = ResponseEvents(env)
        return StreamingResponse(_events(answer.body_iterator, events), media_type="text/event-stream",
                                 headers=headers)
    c = json.loads(answer.body)
    ch = c["choices"][0]
    reason = ch.get("finish_reason")
    status = "incomplete" if reason == "length" else "completed"
    resp = env.response(status, output_items(ch["message"], reason), usage_of(c.get("usage")), reason)
    return JSONResponse(resp, headers=headers)
