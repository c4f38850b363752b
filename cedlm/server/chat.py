"""POST /v1/chat/completions.

Chat uses the DeepSeek-V4.1 encoding (`cedlm.text.chat.encode_chat`). Thinking mode is used when
reasoning is requested (`reasoning_effort` other than "none", the integer extension
`cedlm_reasoning_effort`, or `thinking` / `chat_template_kwargs.thinking`); otherwise chat mode.
OpenAI tiers map to V4.1 integers as in `protocol.EFFORT_TIERS`: none -> chat mode, minimal=25,
low=50, medium=62, high=75, xhigh=75, max=100; an integer 1..100 is accepted in `reasoning_effort`
or `cedlm_reasoning_effort`. The effort used is echoed in the `x-cedlm-reasoning-effort` response
header ("none" in chat mode).

In thinking mode the output is split with `parse_assistant` into `reasoning_content` and `content`
(streamed consistently by `ReasoningSplitter`); `usage.completion_tokens_details.reasoning_tokens`
counts the generated tokens up to and including the first `</think>` (all of them if it never
came). In chat mode everything is `content`. With `tools`, tool calls are parsed from the content
of a non-streaming response (finish reason "tool_calls").

Only the chat encoder emits control tokens: message text (content, reasoning, tool calls, tool
schemas and results) is tokenized as plain text (`cedlm.text.chat.encode_chat_ids`), so typing
`<｜User｜>` or `</think>` in a message cannot forge a turn. Raw control tokens are only accepted
as token ids on `/v1/completions`. Encoding runs off the event loop.
"""
from __future__ import annotations

import logging
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from cedlm.server.errors import APIError
from cedlm.server.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChoiceLogprobs, CompletionTokensDetails, DeltaMessage, PromptTokensDetails,
    TokenLogprob, TopLogprob, Usage,
)
from cedlm.server.state import ServerState, finite_logprob
from cedlm.server.streaming import RequestEvents, collect, sse, sse_response
from cedlm.server.worker import Delta, Finished
from cedlm.text.chat import (
    EOS, THINK_END, THINK_START, encode_chat_parts, parse_assistant, parse_tool_calls, tokenize_parts,
)

log = logging.getLogger("cedlm.server")

EFFORT_HEADER = "x-cedlm-reasoning-effort"

router = APIRouter()


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


def chat_logprobs(srv: ServerState, ids, lps, tops) -> list[TokenLogprob]:
    out = []
    for k, (i, lp) in enumerate(zip(ids, lps)):
        top = []
        if tops is not None and k < len(tops):
            top = [TopLogprob(token=srv.tok_text(j), logprob=finite_logprob(v), bytes=srv.tok_bytes(j))
                   for j, v in zip(*tops[k])]
        out.append(TokenLogprob(token=srv.tok_text(i), logprob=finite_logprob(lp), bytes=srv.tok_bytes(i),
                                top_logprobs=top))
    return out


def reasoning_tokens(srv: ServerState, ids: list[int], thinking: bool) -> int:
    if not thinking:
        return 0
    think_end_id = srv.tok.token_to_id(THINK_END)
    if think_end_id is not None and think_end_id in ids:
        return ids.index(think_end_id) + 1
    return len(ids)


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, raw: Request):
    srv: ServerState = raw.app.state.server
    resolved = srv.resolve(body.model)
    if srv.tok is None:
        raise APIError(400, "messages: this model has no tokenizer; use /v1/completions with "
                            "token ids", param="messages")
    thinking, effort = body.resolve_thinking()
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs=true", param="top_logprobs")
    msgs = [m.model_dump(exclude_none=True) for m in body.messages]

    def encode() -> list[int]:
        try:
            parts = encode_chat_parts(msgs, "thinking" if thinking else "chat",
                                      effort if thinking else None, tools=body.tools)
        except ValueError as e:
            raise APIError(400, f"messages: {e}", param="messages") from None
        except Exception as e:                 # noqa: BLE001 - a message shape the checks missed
            eid = f"err-{uuid.uuid4().hex[:16]}"
            log.warning("chat encoding failed [%s]", eid, exc_info=e)
            raise APIError(400, f"messages: a message could not be encoded; check its shape "
                                f"(error id {eid})", param="messages") from None
        srv.check_chars(sum(len(t) for t, _ in parts), "messages")
        try:
            return tokenize_parts(parts, srv.tok)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None

    ids = await srv.tokenize(encode)
    srv.check_len(ids, "messages")
    params = srv.params(body, len(ids), body.max_completion_tokens or body.max_tokens,
                        (body.top_logprobs or 0) if body.logprobs else None)
    events = RequestEvents(srv.worker, srv.metrics, raw, "chatcmpl", ids, params)
    headers = srv.headers(resolved, {EFFORT_HEADER: str(effort) if thinking else "none"})
    if not await events.admit():
        return Response(status_code=499)
    rid, created = events.rid, int(time.time())

    def usage(out_ids: list[int]) -> Usage:
        return Usage(prompt_tokens=len(ids), completion_tokens=len(out_ids),
                     total_tokens=len(ids) + len(out_ids),
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=events.cached),
                     completion_tokens_details=CompletionTokensDetails(
                         reasoning_tokens=reasoning_tokens(srv, out_ids, thinking)))

    if not body.stream:
        out = await collect(events, bool(body.top_logprobs))
        if out is None:
            return Response(status_code=499)
        reason = out.finish_reason
        reasoning, content = parse_assistant(out.text, thinking=True) if thinking else ("", out.text)
        tool_calls = None
        if body.tools:
            content, calls = parse_tool_calls(content)
            if calls:
                tool_calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", **c} for c in calls]
                reason = "tool_calls" if reason == "stop" else reason
        msg = AssistantMessage(content=content, reasoning_content=reasoning if thinking else None,
                               tool_calls=tool_calls)
        lp = (ChoiceLogprobs(content=chat_logprobs(srv, out.token_ids, out.logprobs, out.top_logprobs))
              if body.logprobs else None)
        resp = ChatCompletionResponse(id=rid, created=created, model=resolved.requested,
                                      choices=[ChatChoice(message=msg, logprobs=lp, finish_reason=reason)],
                                      usage=usage(out.token_ids), warning=resolved.warning)
        return JSONResponse(resp.model_dump(exclude_none=True), headers=headers)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    split = ReasoningSplitter(thinking)
    out_ids: list[int] = []

    def chunk(delta: DeltaMessage, finish=None, logprobs=None, **kw) -> str:
        return sse(ChatCompletionChunk(id=rid, created=created, model=resolved.requested,
                                       choices=[ChatChunkChoice(delta=delta, logprobs=logprobs,
                                                                finish_reason=finish)], **kw))

    def fmt(ev: Delta | Finished):
        if isinstance(ev, Delta):
            out_ids.extend(ev.token_ids)
            dr, dc = split.feed(ev.text)
            lp = (ChoiceLogprobs(content=chat_logprobs(srv, ev.token_ids, ev.logprobs, ev.top_logprobs))
                  if body.logprobs else None)
            if dr or dc or lp is not None:
                yield chunk(DeltaMessage(reasoning_content=dr or None, content=dc or None), logprobs=lp)
        else:
            dr, dc = split.finish()
            if dr or dc:
                yield chunk(DeltaMessage(reasoning_content=dr or None, content=dc or None))
            yield chunk(DeltaMessage(), finish=ev.reason)
            if include_usage:
                yield sse(ChatCompletionChunk(id=rid, created=created, model=resolved.requested,
                                              choices=[], usage=usage(out_ids)))

    first = chunk(DeltaMessage(role="assistant", content=""), warning=resolved.warning)
    return sse_response(events, fmt, headers, first=first)
