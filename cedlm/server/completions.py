"""POST /v1/completions: a text prompt (tokenized with a BOS) or a list of token ids, continued as
plain text. Logprobs are OpenAI's legacy shape (tokens, token_logprobs, top_logprobs as
{token: logprob}, text_offset).

A text prompt is plain text: special-token strings in it (`<｜User｜>`, `</think>`, ...) are
tokenized as text, never as control tokens. The raw path is explicit: a prompt given as a list of
token ids is used as is, control tokens included (that is how to send a pre-rendered chat prompt:
`cedlm.text.chat.encode_chat_ids` or the tokenizer on the client side)."""
from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from cedlm.server.errors import APIError
from cedlm.server.protocol import (
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, PromptTokensDetails, Usage,
)
from cedlm.server.state import ServerState, finite_logprob
from cedlm.server.streaming import RequestEvents, collect, sse, sse_response
from cedlm.server.worker import Delta, Finished

router = APIRouter()


def completion_logprobs(srv: ServerState, ids, lps, tops, offset: int) -> CompletionLogprobs:
    """Logprobs of `ids`, whose text starts at character `offset` of the completion."""
    out = CompletionLogprobs(top_logprobs=[] if tops is not None else None)
    for k, (i, lp) in enumerate(zip(ids, lps)):
        t = srv.tok_text(i)
        out.tokens.append(t)
        out.token_logprobs.append(finite_logprob(lp))
        out.text_offset.append(offset)
        offset += len(t)
        if tops is not None:
            out.top_logprobs.append({srv.tok_text(j): finite_logprob(v) for j, v in zip(*tops[k])})
    return out


@router.post("/v1/completions")
async def completions(body: CompletionRequest, raw: Request):
    srv: ServerState = raw.app.state.server
    resolved = srv.resolve(body.model)
    prompt = body.prompt
    if isinstance(prompt, str):
        if srv.tok is None:
            raise APIError(400, "prompt: this model has no tokenizer; send token ids", param="prompt")
        srv.check_chars(len(prompt), "prompt")
        tok = srv.tok
        ids = await srv.tokenize(lambda: [tok.bos_id] + tok.encode_plain(prompt))
    else:
        ids = [int(t) for t in prompt]
    srv.check_len(ids, "prompt")
    params = srv.params(body, len(ids), body.max_tokens, body.logprobs)
    events = RequestEvents(srv.worker, srv.metrics, raw, "cmpl", ids, params)
    headers = srv.headers(resolved)
    if not await events.admit():
        return Response(status_code=499)
    rid, created = events.rid, int(time.time())

    def usage(n_out: int) -> Usage:
        return Usage(prompt_tokens=len(ids), completion_tokens=n_out, total_tokens=len(ids) + n_out,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=events.cached))

    if not body.stream:
        out = await collect(events, bool(body.logprobs))
        if out is None:
            return Response(status_code=499)
        lp = (completion_logprobs(srv, out.token_ids, out.logprobs, out.top_logprobs, 0)
              if body.logprobs is not None else None)
        resp = CompletionResponse(id=rid, created=created, model=resolved.requested,
                                  choices=[CompletionChoice(text=out.text, logprobs=lp,
                                                            finish_reason=out.finish_reason)],
                                  usage=usage(len(out.token_ids)), warning=resolved.warning)
        return JSONResponse(resp.model_dump(exclude_none=True), headers=headers)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    n_out, offset, first = 0, 0, True

    def chunk(text: str, finish=None, logprobs=None, **kw) -> str:
        return sse(CompletionResponse(id=rid, created=created, model=resolved.requested,
                                      choices=[CompletionChoice(text=text, logprobs=logprobs,
                                                                finish_reason=finish)], **kw))

    def fmt(ev: Delta | Finished):
        nonlocal n_out, offset, first
        if isinstance(ev, Delta):
            n_out += len(ev.token_ids)
            lp = (completion_logprobs(srv, ev.token_ids, ev.logprobs, ev.top_logprobs, offset)
                  if body.logprobs is not None else None)
            offset += len(ev.text)
            if ev.text or lp is not None or first:
                yield chunk(ev.text, logprobs=lp, warning=resolved.warning if first else None)
                first = False
        else:
            yield chunk("", finish=ev.reason, warning=resolved.warning if first else None)
            if include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": created,
                           "model": resolved.requested, "choices": [],
                           "usage": usage(n_out).model_dump(exclude_none=True)})

    return sse_response(events, fmt, headers)
