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
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from cedlm.engine.sampling_params import SamplingParams
from cedlm.server.errors import APIError
from cedlm.server.images import chat_images_async, expanded_len
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


# --------------------------------------------------------------------------- request -> parameters


@dataclass
class ChatJob:
    """What a chat request runs: its prompt, images, mode and sampling parameters."""
    prompt_ids: list[int]
    n_prompt: int                 # the prompt length the engine sees (image placeholders expanded)
    images: list
    thinking: bool
    effort: int | None
    params: SamplingParams
    forced: bool                  # tool_choice "required" or a named function: the output is the calls
    auto: bool                    # tools with tool_choice "auto": calls parsed from the DSML block
    parallel: bool


async def chat_job(srv: ServerState, body: ChatCompletionRequest) -> ChatJob:
    """Encode the prompt (off the event loop), compile the output constraint, and build the
    sampling parameters; a 400 naming the field for what cannot run."""
    if srv.tok is None:
        raise APIError(400, "messages: this model has no tokenizer; use /v1/completions with "
                            "token ids", param="messages")
    thinking, effort = body.resolve_thinking()
    ids = await srv.tokenize(lambda: encode_messages(srv, body, thinking, effort))
    messages = await srv.tokenize(lambda: [m.model_dump(exclude_none=True) for m in body.messages])
    images = await chat_images_async(getattr(srv, "images", None), messages)     # in the image lane
    prompt_ids = ids
    if images:              # the placeholders become spans: the prompt length the engine will see
        ids = ids + [0] * (expanded_len(len(ids), images) - len(ids))
    srv.check_len(ids, "messages")

    parallel = body.parallel_tool_calls is not False
    forced = body.forced_tools()
    guided = (("tool_choice", "json_schema", forced_schema(body.tools, body.tool_choice, parallel)) if forced
              else body.guided())
    grammar = await srv.grammar(guided)
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = await srv.tokenize(lambda: srv.params(    # builds the grammar matcher: off the loop
        body, ids, body.max_completion_tokens or body.max_tokens, top, grammar=grammar,
        grammar_param=guided[0] if guided else "response_format", gate=srv.think_end_id if thinking else None))
    return ChatJob(prompt_ids, len(ids), images, thinking, effort, params, forced,
                   auto=bool(body.tools) and body.tool_choice in (None, "auto"), parallel=parallel)


# --------------------------------------------------------------------------- the response


class ChoiceStream:
    """One streamed choice: its reasoning / content split and its tool calls (parsed from the
    DSML block, or the forced JSON)."""

    def __init__(self, job: ChatJob, tool_choice):
        self.split = ReasoningSplitter(job.thinking)
        self.dsml = DSMLStream(job.parallel) if job.auto else None
        self.forced = ForcedStream(tool_choice, job.parallel) if job.forced else None
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


class ChatFormatter:
    """The response of one admitted chat request: the JSON response (`response`), or the stream's
    chunks (`first`, `event` for each engine event, `last`)."""

    def __init__(self, srv: ServerState, body: ChatCompletionRequest, job: ChatJob, group: Group, resolved):
        self.srv, self.body, self.job, self.group = srv, body, job, group
        self.rid, self.created, self.model, self.warning = group.rid, int(time.time()), resolved.requested, \
            resolved.warning
        self.continuous = bool(body.stream_options and body.stream_options.continuous)   # usage on every chunk
        self.seqs = [ChoiceStream(job, body.tool_choice) for _ in group.events]

    def usage(self, outs_ids: list[list[int]]) -> Usage:
        n_in, n_out = self.job.n_prompt, sum(len(o) for o in outs_ids)
        return Usage(prompt_tokens=n_in, completion_tokens=n_out, total_tokens=n_in + n_out,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=self.group.cached()),
                     completion_tokens_details=CompletionTokensDetails(
                         reasoning_tokens=sum(reasoning_tokens(self.srv, o, self.job.thinking) for o in outs_ids)))

    def calls_of(self, content: str, reason: str | None) -> tuple[str | None, list[dict], str | None]:
        """(content left, tool calls, refusal) of a finished choice's content. A forced call is
        never content: cut by max_tokens, it comes back with its arguments as far as generated,
        and a refusal saying so (tools.py: ForcedStream.cut, cut_refusal)."""
        if self.job.forced:
            stream = ForcedStream(self.body.tool_choice, self.job.parallel)
            calls = stream.feed(content)
            if reason != "length":
                return None, calls, None
            cut = stream.cut()
            return None, calls + cut, cut_refusal(stream, cut)
        if self.job.auto:
            rest, calls = parse_tool_calls(content)
            return rest, (calls if self.job.parallel else calls[:1]), None
        return content, [], None

    def response(self, outs: list[Output]) -> ChatCompletionResponse:
        thinking, choices = self.job.thinking, []
        for i, out in enumerate(best(outs, self.body.n)):
            reason = out.finish_reason
            reasoning, content = parse_assistant(out.text, thinking=True) if thinking else ("", out.text)
            content, calls, refusal = self.calls_of(content, reason)
            if calls and reason == "stop":
                reason = "tool_calls"
            msg = AssistantMessage(content=content, reasoning_content=reasoning if thinking else None,
                                   tool_calls=with_ids(calls) if calls else None, refusal=refusal)
            lp = (ChoiceLogprobs(content=chat_logprobs(self.srv, out.token_ids, out.logprobs, out.top_logprobs))
                  if self.body.logprobs else None)
            choices.append(ChatChoice(index=i, message=msg, logprobs=lp, finish_reason=reason))
        return ChatCompletionResponse(id=self.rid, created=self.created, model=self.model, choices=choices,
                                      usage=self.usage([o.token_ids for o in outs]), warning=self.warning)

    def chunk(self, k: int, delta: DeltaMessage, finish=None, logprobs=None, **kw) -> str:
        if self.continuous:                      # the usage so far (all choices), as vLLM sends it
            kw["usage"] = self.usage([s.out_ids for s in self.seqs])
        return sse(ChatCompletionChunk(id=self.rid, created=self.created, model=self.model,
                                       choices=[ChatChunkChoice(index=k, delta=delta, logprobs=logprobs,
                                                                finish_reason=finish)], **kw))

    def first(self) -> str:
        return "".join(self.chunk(k, DeltaMessage(role="assistant", content=""),
                                  warning=self.warning if k == 0 else None) for k in range(len(self.seqs)))

    def event(self, k: int, ev: Delta | Finished):
        st = self.seqs[k]
        final = isinstance(ev, Finished)
        lp = None
        if not final:
            st.out_ids.extend(ev.token_ids)
            dr, dc = st.split.feed(ev.text)
            if self.body.logprobs:
                lp = ChoiceLogprobs(content=chat_logprobs(self.srv, ev.token_ids, ev.logprobs, ev.top_logprobs))
        else:
            dr, dc = st.split.finish()
        dc, calls = st.content(dc, final)
        refusal = None
        if final and st.forced is not None and ev.reason == "length":     # the call max_tokens cut
            cut = st.forced.cut()
            calls, refusal = calls + cut, cut_refusal(st.forced, cut)
        if dr or dc or lp is not None:
            yield self.chunk(k, DeltaMessage(reasoning_content=dr or None, content=dc or None), logprobs=lp)
        if calls:
            yield self.chunk(k, DeltaMessage(tool_calls=st.tool_deltas(calls)))
        if refusal:
            yield self.chunk(k, DeltaMessage(refusal=refusal))
        if final:
            reason = "tool_calls" if st.n_calls and ev.reason == "stop" else ev.reason
            yield self.chunk(k, DeltaMessage(), finish=reason)

    def last(self):
        if self.body.stream_options and self.body.stream_options.include_usage:
            yield sse(ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=[],
                                          usage=self.usage([s.out_ids for s in self.seqs])))


# --------------------------------------------------------------------------- the route


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, raw: Request):
    srv: ServerState = raw.app.state.server
    resolved = srv.resolve(body.model)
    job = await chat_job(srv, body)
    group = Group(srv.worker, srv.metrics, raw, "chatcmpl", [(job.prompt_ids, job.params)], images=job.images)
    headers = srv.headers(resolved, {EFFORT_HEADER: str(job.effort) if job.thinking else "none"})
    if not await group.admit():
        return Response(status_code=499)
    out = ChatFormatter(srv, body, job, group, resolved)
    if body.stream:
        return group.stream(out.event, headers, first=out.first(), last=out.last)
    outs = await group.collect(bool(body.top_logprobs))
    if outs is None:
        return Response(status_code=499)
    return JSONResponse(out.response(outs).model_dump(exclude_none=True), headers=headers)
