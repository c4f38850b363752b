"""POST /v1/chat/completions.

Chat uses the DeepSeek-V4.1 encoding (`cedlm.text.chat.encode_chat`). Thinking mode is used when
reasoning is requested (`reasoning_effort` other than "none", the integer extension
`cedlm_reasoning_effort`, DeepSeek's `thinking: {"type": "enabled"}`, or `thinking` /
`chat_template_kwargs.thinking`); otherwise chat mode (the default, as in vLLM; DeepSeek's own
API defaults to thinking). Effort tiers map to V4.1 integers as in `protocol.EFFORT_TIERS`
(DeepSeek's API names and mapping: none -> chat mode, minimal / low = 50, medium / high / xhigh
= 75, max / ultra = 100); an integer 1..100 is accepted in `reasoning_effort` or
`cedlm_reasoning_effort`. `thinking: {"type": "disabled"}` wins over an effort. The effort used is
echoed in the `x-cedlm-reasoning-effort` response header ("none" in chat mode).

In thinking mode the output is split with `parse_assistant` into `reasoning_content` and `content`
(streamed consistently by `ReasoningSplitter`); `usage.completion_tokens_details.reasoning_tokens`
counts the generated tokens up to and including the first `</think>` (all of them if it never
came). In chat mode everything is `content`.

Tools (`tools.py`): with tool_choice "auto" (the default when tools are given) tool calls are
parsed from the V4.1 `<｜DSML｜ calls>` block, streaming (`DSMLStream`: each call is sent as a
`tool_calls` delta once its invoke closes) or not; "required" or a named function constrains the
output to JSON naming the call(s) (the finish reason is then "tool_calls"; a call cut by max_tokens
is returned with its partial arguments and finish reason "length", as vLLM, plus a refusal saying
it was cut; never as content);
"none" parses nothing.
`response_format` (json_object, json_schema) and vLLM's structured outputs constrain the content
(`constrain.py`; in thinking mode, from the first `</think>` on).

`n` choices (and `best_of`: that many sampled, the n with the highest cumulative logprob
returned) run as separate engine requests sharing the prompt's prefix-cache blocks.

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
from cedlm.server.images import chat_images, expanded_len, run_image_work
from cedlm.server.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChoiceLogprobs, CompletionTokensDetails, DeltaMessage, PromptTokensDetails,
    TokenLogprob, TopLogprob, Usage,
)
from cedlm.server.state import ServerState, finite_logprob
from cedlm.server.streaming import Group, Output, sse
from cedlm.server.tools import DSMLStream, ForcedStream, cut_refusal, forced_schema, with_ids
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


def encode_messages(srv: ServerState, body, thinking: bool, effort: int | None) -> list[int]:
    """The V4.1 prompt ids of a chat request (or a /tokenize request with messages); runs in a
    worker thread. A message the encoder refuses is a 400 naming `messages`."""
    msgs = [m.model_dump(exclude_none=True) for m in body.messages]
    try:
        parts = encode_chat_parts(msgs, "thinking" if thinking else "chat", effort if thinking else None,
                                  drop_thinking=body.drop_thinking, tools=body.tools)
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


def best(outs: list[Output], n: int) -> list[Output]:
    """The n outputs a request returns (as `cedlm.engine.request.select_samples`): all, in sample
    order, when n were drawn; else (best_of) the n with the highest cumulative logprob."""
    if len(outs) <= n:
        return outs
    return sorted(outs, key=lambda o: -o.cumulative_logprob)[:n]


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, raw: Request):
    srv: ServerState = raw.app.state.server
    resolved = srv.resolve(body.model)
    if srv.tok is None:
        raise APIError(400, "messages: this model has no tokenizer; use /v1/completions with "
                            "token ids", param="messages")
    thinking, effort = body.resolve_thinking()
    ids = await srv.tokenize(lambda: encode_messages(srv, body, thinking, effort))
    images = await run_image_work(getattr(srv, "images", None), lambda: chat_images(getattr(srv, "images", None),
                                                    [m.model_dump(exclude_none=True) for m in body.messages]))
    prompt_ids = ids
    if images:              # the placeholders become spans: the prompt length the engine will see
        ids = ids + [0] * (expanded_len(len(ids), images) - len(ids))
    srv.check_len(ids, "messages")

    parallel = body.parallel_tool_calls is not False
    forced = body.forced_tools()
    auto = bool(body.tools) and body.tool_choice in (None, "auto")
    if forced:
        gparam = "tool_choice"
        grammar = await srv.grammar((gparam, "json_schema", forced_schema(body.tools, body.tool_choice, parallel)))
    else:
        guided = body.guided()
        gparam = guided[0] if guided else "response_format"
        grammar = await srv.grammar(guided)
    gate = srv.think_end_id if thinking else None
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = await srv.tokenize(lambda: srv.params(    # builds the grammar matcher: off the loop
        body, ids, body.max_completion_tokens or body.max_tokens, top, grammar=grammar, grammar_param=gparam,
        gate=gate))
    group = Group(srv.worker, srv.metrics, raw, "chatcmpl", [(prompt_ids, params)], images=images)
    headers = srv.headers(resolved, {EFFORT_HEADER: str(effort) if thinking else "none"})
    if not await group.admit():
        return Response(status_code=499)
    rid, created = group.rid, int(time.time())

    def usage(outs_ids: list[list[int]]) -> Usage:
        n_out = sum(len(o) for o in outs_ids)
        return Usage(prompt_tokens=len(ids), completion_tokens=n_out, total_tokens=len(ids) + n_out,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=group.cached()),
                     completion_tokens_details=CompletionTokensDetails(
                         reasoning_tokens=sum(reasoning_tokens(srv, o, thinking) for o in outs_ids)))

    def calls_of(content: str, reason: str | None) -> tuple[str | None, list[dict], str | None]:
        """(content left, tool calls, refusal) of a finished choice's content. A forced call is
        never content: cut by max_tokens, it comes back with its arguments as far as generated,
        and a refusal saying so (tools.py: ForcedStream.cut, cut_refusal)."""
        if forced:
            stream = ForcedStream(body.tool_choice, parallel)
            calls = stream.feed(content)
            if reason != "length":
                return None, calls, None
            cut = stream.cut()
            return None, calls + cut, cut_refusal(stream, cut)
        if auto:
            rest, calls = parse_tool_calls(content)
            return rest, (calls if parallel else calls[:1]), None
        return content, [], None

    if not body.stream:
        outs = await group.collect(bool(body.top_logprobs))
        if outs is None:
            return Response(status_code=499)
        choices = []
        for i, out in enumerate(best(outs, body.n)):
            reason = out.finish_reason
            reasoning, content = parse_assistant(out.text, thinking=True) if thinking else ("", out.text)
            content, calls, refusal = calls_of(content, reason)
            if calls and reason == "stop":
                reason = "tool_calls"
            msg = AssistantMessage(content=content, reasoning_content=reasoning if thinking else None,
                                   tool_calls=with_ids(calls) if calls else None, refusal=refusal)
            lp = (ChoiceLogprobs(content=chat_logprobs(srv, out.token_ids, out.logprobs, out.top_logprobs))
                  if body.logprobs else None)
            choices.append(ChatChoice(index=i, message=msg, logprobs=lp, finish_reason=reason))
        resp = ChatCompletionResponse(id=rid, created=created, model=resolved.requested, choices=choices,
                                      usage=usage([o.token_ids for o in outs]), warning=resolved.warning)
        return JSONResponse(resp.model_dump(exclude_none=True), headers=headers)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous = bool(body.stream_options and body.stream_options.continuous)   # usage on every chunk

    class Choice:
        def __init__(self):
            self.split = ReasoningSplitter(thinking)
            self.dsml = DSMLStream(parallel) if auto else None
            self.forced = ForcedStream(body.tool_choice, parallel) if forced else None
            self.out_ids, self.n_calls = [], 0

        def content(self, dc: str, final: bool) -> tuple[str, list[dict]]:
            if self.forced is not None:          # the JSON is the calls, not content
                return "", self.forced.feed(dc)
            if self.dsml is not None:
                return self.dsml.feed(dc, final=final)
            return dc, []

        def tool_deltas(self, calls: list[dict]) -> list[dict]:
            out = []
            for c in with_ids(calls):
                out.append({"index": self.n_calls, **c})
                self.n_calls += 1
            return out

    seqs = [Choice() for _ in group.events]

    def chunk(k: int, delta: DeltaMessage, finish=None, logprobs=None, **kw) -> str:
        if continuous:                          # the usage so far (all choices), as vLLM sends it
            kw["usage"] = usage([s.out_ids for s in seqs])
        return sse(ChatCompletionChunk(id=rid, created=created, model=resolved.requested,
                                       choices=[ChatChunkChoice(index=k, delta=delta, logprobs=logprobs,
                                                                finish_reason=finish)], **kw))

    def fmt(k: int, ev: Delta | Finished):
        st = seqs[k]
        final = isinstance(ev, Finished)
        lp = None
        if not final:
            st.out_ids.extend(ev.token_ids)
            dr, dc = st.split.feed(ev.text)
            if body.logprobs:
                lp = ChoiceLogprobs(content=chat_logprobs(srv, ev.token_ids, ev.logprobs, ev.top_logprobs))
        else:
            dr, dc = st.split.finish()
        dc, calls = st.content(dc, final)
        refusal = None
        if final and st.forced is not None and ev.reason == "length":     # the call max_tokens cut
            cut = st.forced.cut()
            calls, refusal = calls + cut, cut_refusal(st.forced, cut)
        if dr or dc or lp is not None:
            yield chunk(k, DeltaMessage(reasoning_content=dr or None, content=dc or None), logprobs=lp)
        if calls:
            yield chunk(k, DeltaMessage(tool_calls=st.tool_deltas(calls)))
        if refusal:
            yield chunk(k, DeltaMessage(refusal=refusal))
        if final:
            reason = "tool_calls" if st.n_calls and ev.reason == "stop" else ev.reason
            yield chunk(k, DeltaMessage(), finish=reason)

    def last():
        if include_usage:
            yield sse(ChatCompletionChunk(id=rid, created=created, model=resolved.requested, choices=[],
                                          usage=usage([s.out_ids for s in seqs])))

    first = "".join(chunk(k, DeltaMessage(role="assistant", content=""),
                          warning=resolved.warning if k == 0 else None) for k in range(len(group.events)))
    return group.stream(fmt, headers, first=first, last=last)
