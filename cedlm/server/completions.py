"""POST /v1/completions: prompts continued as plain text, and prompt scoring.

`prompt` is a text, a list of token ids, or a list of either (one choice group per prompt, in
order; choice `index` = prompt index x n + sample). A text prompt is tokenized with a BOS first
(`add_special_tokens=false`: without it); a token-id prompt is used as is, control tokens included
(that is how to send a pre-rendered chat prompt: `cedlm.text.chat.encode_chat_ids` or the
tokenizer on the client side). Special-token strings in a text prompt (`<｜User｜>`, `</think>`,
...) are tokenized as text, never as control tokens.

Logprobs are OpenAI's legacy shape (tokens, token_logprobs, top_logprobs as {token: logprob},
text_offset). Prompt scoring, as lm-evaluation-harness's `local-completions` backend uses it:
`echo=true` puts the prompt before the completion, in the text and in the logprobs (the prompt's
first token has no logprob: `None` in token_logprobs and top_logprobs; each prompt position's
top_logprobs holds the top `logprobs` tokens plus the prompt's own token, as in vLLM);
`max_tokens=0` scores without generating. vLLM's `prompt_logprobs=k` returns the choice's
`prompt_logprobs` (`[None, {token id: {logprob, rank, decoded_token}}, ...]`). The engine computes
prompt logprobs in the prefill pass (`SamplingParams.prompt_logprobs`).

`n` and `best_of` as in OpenAI (best_of sequences sampled, the n with the highest cumulative
logprob returned; not with streaming). `return_tokens_as_token_ids` (vLLM) writes tokens as
`token_id:N`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cedlm.engine.request import TokenLogprob
from cedlm.engine.sampling_params import SamplingParams
from cedlm.server.chat import best
from cedlm.server.errors import APIError, new_request_id
from cedlm.server.protocol import (
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, PromptLogprob,
    PromptTokensDetails, Usage,
)
from cedlm.server.state import ServerState, finite_logprob
from cedlm.server.streaming import DONE, Group, Output, sse
from cedlm.server.worker import Delta, Finished

router = APIRouter()


# --------------------------------------------------------------------------- prompt logprobs


def prompt_entry(e: TokenLogprob | None) -> tuple[float | None, list[tuple[int, float]], int | None]:
    """(logprob, top alternatives best first, rank) of one engine prompt-logprob entry (the
    engine's `TokenLogprob`: plain values), or (None, [], None) for the first position."""
    if e is None:
        return None, [], None
    return e.logprob, list(zip(e.top_ids, e.top_logprobs)), e.rank


def scored_prompt(out: Output, ids: list[int]) -> list[tuple[float | None, list[tuple[int, float]], int | None]]:
    entries = list(out.prompt_logprobs or [])
    entries += [None] * (len(ids) - len(entries))
    got = [prompt_entry(e) for e in entries]
    if got:
        got[0] = (None, [], None)              # the first token has no context
    return got


# --------------------------------------------------------------------------- formatting


def _tok(srv: ServerState, i: int, as_ids: bool) -> str:
    return f"token_id:{i}" if as_ids else srv.tok_text(i)


def completion_logprobs(srv: ServerState, ids, lps, tops, offset: int, as_ids: bool = False,
                        into: CompletionLogprobs | None = None) -> CompletionLogprobs:
    """Logprobs of generated `ids`, whose text starts at character `offset` of the choice's text."""
    out = into or CompletionLogprobs(top_logprobs=[] if tops is not None else None)
    for k, (i, lp) in enumerate(zip(ids, lps)):
        t = srv.tok_text(i)
        out.tokens.append(_tok(srv, i, as_ids))
        out.token_logprobs.append(finite_logprob(lp))
        out.text_offset.append(offset)
        offset += len(t)
        if out.top_logprobs is not None:
            top = tops[k] if tops is not None and k < len(tops) else ([], [])
            out.top_logprobs.append({_tok(srv, j, as_ids): finite_logprob(v) for j, v in zip(*top)})
    return out


def echo_logprobs(srv: ServerState, ids: list[int], scored, k: int, as_ids: bool) -> tuple[CompletionLogprobs, int]:
    """The prompt part of an echoed choice's logprobs, and the text offset after it."""
    out = CompletionLogprobs(top_logprobs=[] if k > 0 else None)
    offset = 0
    for pos, (i, (lp, top, _)) in enumerate(zip(ids, scored)):
        out.tokens.append(_tok(srv, i, as_ids))
        out.token_logprobs.append(None if pos == 0 or lp is None else finite_logprob(lp))
        out.text_offset.append(offset)
        offset += len(srv.tok_text(i))
        if out.top_logprobs is not None:
            if pos == 0:
                out.top_logprobs.append(None)
                continue
            d = {_tok(srv, j, as_ids): finite_logprob(v) for j, v in top[:k]}
            if lp is not None:
                d.setdefault(_tok(srv, i, as_ids), finite_logprob(lp))
            out.top_logprobs.append(d)
    return out, offset


def vllm_prompt_logprobs(srv: ServerState, ids: list[int], scored, k: int) -> list:
    """vLLM's `prompt_logprobs`: [None, {str(id): {logprob, rank, decoded_token}}, ...]."""
    res: list = []
    for pos, (i, (lp, top, rank)) in enumerate(zip(ids, scored)):
        if pos == 0:
            res.append(None)
            continue
        d = {}
        if lp is not None:
            if rank is None:
                rank = next((r + 1 for r, (j, _) in enumerate(top) if j == i), None)
            d[str(i)] = PromptLogprob(logprob=finite_logprob(lp), rank=rank, decoded_token=srv.tok_text(i))
        for r, (j, v) in enumerate(top[:k]):
            d.setdefault(str(j), PromptLogprob(logprob=finite_logprob(v), rank=r + 1, decoded_token=srv.tok_text(j)))
        res.append(d)
    return res


# --------------------------------------------------------------------------- request -> parameters


@dataclass
class CompletionJob:
    """What a completions request runs: its prompts' ids and the engine requests (`runs`: one
    (prompt ids, sampling parameters) per prompt; None when echo alone answers it)."""
    ids_list: list[list[int]]
    echo_texts: list[str] | None     # the prompts as echoed text (with echo)
    score_k: int | None              # top alternatives scored per prompt position (None: no scoring)
    want: int                        # samples drawn per prompt: max(n, best_of)
    runs: list[tuple[list[int], SamplingParams]] | None


async def completion_job(srv: ServerState, body: CompletionRequest) -> CompletionJob:
    """Tokenize the prompts (off the event loop), compile the output constraint, and build the
    sampling parameters; a 400 naming the field for what cannot run."""
    prompts = body.prompts()
    texts = [p for p in prompts if isinstance(p, str)]
    if texts:
        if srv.tok is None:
            raise APIError(400, "prompt: this model has no tokenizer; send token ids", param="prompt")
        for t in texts:
            srv.check_chars(len(t), "prompt")
    tok, bos = srv.tok, body.add_special_tokens

    def tokenize_all() -> list[list[int]]:
        return [(([tok.bos_id] if bos else []) + tok.encode_plain(p)) if isinstance(p, str) else [int(t) for t in p]
                for p in prompts]

    ids_list = await srv.tokenize(tokenize_all) if texts else tokenize_all()
    for ids in ids_list:
        if not ids:           # (only an empty text, without the BOS: a rule between the two fields)
            raise APIError(400, "prompt: empty prompt (no tokens; an empty text needs add_special_tokens)",
                           param="prompt", code="invalid_combination")
        srv.check_len(ids, "prompt")
        bad = next((t for t in ids if not 0 <= t < srv.vocab_size), None)     # before echo decodes them
        if bad is not None:
            raise APIError(400, f"prompt: token id {bad} is outside the vocabulary [0, {srv.vocab_size})",
                           param="prompt")
    echo_texts = [p if isinstance(p, str) else (tok.decode(ids) if tok is not None else "")
                  for p, ids in zip(prompts, ids_list)] if body.echo else None

    score_k = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        score_k = max(score_k or 0, body.logprobs)
    want = max(body.n, body.best_of or 1)
    srv.check_capacity(len(prompts) * want, "prompt" if len(prompts) > 1 else "n")
    job = CompletionJob(ids_list, echo_texts, score_k, want, runs=None)
    if body.max_tokens == 0 and score_k is None:          # echo alone: nothing to run
        return job
    guided = body.guided()
    grammar = await srv.grammar(guided) if guided is not None else None
    job.runs = await srv.tokenize(lambda: [     # builds the grammar matchers: off the loop
        (ids, srv.params(body, ids, body.max_tokens, body.logprobs, grammar=grammar,
                         grammar_param=guided[0] if guided else "response_format", prompt_logprobs=score_k))
        for ids in ids_list])
    return job


# --------------------------------------------------------------------------- the response


class CompletionFormatter:
    """The response of one admitted completions request: the JSON response (`response`), or the
    stream's chunks (`event` for each engine event, `last`)."""

    def __init__(self, srv: ServerState, body: CompletionRequest, job: CompletionJob, group: Group, resolved,
                 created: int):
        self.srv, self.body, self.job, self.group = srv, body, job, group
        self.rid, self.created, self.model, self.warning = group.rid, created, resolved.requested, resolved.warning
        self.as_ids = body.return_tokens_as_token_ids
        self.continuous = bool(body.stream_options and body.stream_options.continuous)   # usage on every chunk
        n = len(group.events)
        self.n_out, self.offset, self.started, self.warned = [0] * n, [0] * n, [False] * n, False

    def usage(self, n_out: int) -> Usage:
        n_prompt = sum(len(ids) for ids in self.job.ids_list)
        cached = sum(self.group.cached(p) for p in range(len(self.job.ids_list)))
        return Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def prompt_part(self, p: int, out: Output) -> tuple[str, CompletionLogprobs | None, int, list | None]:
        """(echo text, echo logprobs, text offset after it, vLLM prompt_logprobs) of a choice."""
        body, ids = self.body, self.job.ids_list[p]
        scored = scored_prompt(out, ids) if self.job.score_k is not None else None
        plp = vllm_prompt_logprobs(self.srv, ids, scored, body.prompt_logprobs) \
            if body.prompt_logprobs is not None else None
        if not body.echo:
            return "", None, 0, plp
        lp = None
        if body.logprobs is not None:
            lp, _ = echo_logprobs(self.srv, ids, scored, body.logprobs, self.as_ids)
        return self.job.echo_texts[p], lp, len(self.job.echo_texts[p]), plp

    def response(self, outs: list[Output]) -> CompletionResponse:
        body, want, n, choices = self.body, self.job.want, self.body.n, []
        for p in range(len(self.job.ids_list)):
            for j, out in enumerate(best(outs[p * want:(p + 1) * want], n)):
                pre, lp, offset, plp = self.prompt_part(p, out)
                if body.logprobs is not None:
                    lp = completion_logprobs(self.srv, out.token_ids, out.logprobs, out.top_logprobs, offset,
                                             self.as_ids, into=lp)
                choices.append(CompletionChoice(index=p * n + j, text=pre + out.text, logprobs=lp,
                                                finish_reason=out.finish_reason, prompt_logprobs=plp))
        return CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=choices,
                                  usage=self.usage(sum(len(o.token_ids) for o in outs)), warning=self.warning)

    def chunk(self, k: int, text: str, finish=None, logprobs=None, plp=None) -> str:
        w = None
        if not self.warned:
            w, self.warned = self.warning, True
        return sse(CompletionResponse(id=self.rid, created=self.created, model=self.model, warning=w,
                                      choices=[CompletionChoice(index=k, text=text, logprobs=logprobs,
                                                                finish_reason=finish, prompt_logprobs=plp)],
                                      usage=self.usage(sum(self.n_out)) if self.continuous else None))

    def event(self, k: int, ev: Delta | Finished):
        body = self.body
        if not self.started[k]:
            self.started[k] = True
            if body.echo or body.prompt_logprobs is not None:
                pre, lp, self.offset[k], plp = self.prompt_part(k // self.job.want,
                                                                Output(prompt_logprobs=ev.prompt_logprobs))
                yield self.chunk(k, pre, logprobs=lp, plp=plp)
        if isinstance(ev, Delta):
            self.n_out[k] += len(ev.token_ids)
            lp = (completion_logprobs(self.srv, ev.token_ids, ev.logprobs, ev.top_logprobs, self.offset[k],
                                      self.as_ids) if body.logprobs is not None else None)
            self.offset[k] += len(ev.text)
            if ev.text or lp is not None:
                yield self.chunk(k, ev.text, logprobs=lp)
        else:
            yield self.chunk(k, "", finish=ev.reason)

    def last(self):
        if self.body.stream_options and self.body.stream_options.include_usage:
            yield sse({"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                       "choices": [], "usage": self.usage(sum(self.n_out)).model_dump(exclude_none=True)})


# --------------------------------------------------------------------------- the route


@router.post("/v1/completions")
async def completions(body: CompletionRequest, raw: Request):
    srv: ServerState = raw.app.state.server
    resolved = srv.resolve(body.model)
    job = await completion_job(srv, body)
    headers = srv.headers(resolved)
    created = int(time.time())
    if job.runs is None:
        return _echo_only(body, resolved, headers, created, job)
    group = Group(srv.worker, srv.metrics, raw, "cmpl", job.runs)
    if not await group.admit():
        return Response(status_code=499)
    out = CompletionFormatter(srv, body, job, group, resolved, created)
    if body.stream:
        return group.stream(out.event, headers, last=out.last)
    outs = await group.collect(bool(body.logprobs))
    if outs is None:
        return Response(status_code=499)
    return JSONResponse(out.response(outs).model_dump(exclude_none=True), headers=headers)


def _echo_only(body, resolved, headers, created, job: CompletionJob):
    """echo=true, max_tokens=0, no logprobs: the prompts themselves, without running the engine."""
    rid = new_request_id("cmpl")
    ids_list, echo_texts = job.ids_list, job.echo_texts
    n_prompt = sum(len(ids) for ids in ids_list)
    choices = [CompletionChoice(index=p * body.n + j, text=echo_texts[p], finish_reason="length")
               for p in range(len(ids_list)) for j in range(body.n)]
    usage = Usage(prompt_tokens=n_prompt, completion_tokens=0, total_tokens=n_prompt,
                  prompt_tokens_details=PromptTokensDetails(cached_tokens=0))
    resp = CompletionResponse(id=rid, created=created, model=resolved.requested, choices=choices, usage=usage,
                              warning=resolved.warning)
    if not body.stream:
        return JSONResponse(resp.model_dump(exclude_none=True), headers=headers)

    def body_iter():
        continuous = bool(body.stream_options and body.stream_options.continuous)
        for c in choices:
            yield sse(CompletionResponse(id=rid, created=created, model=resolved.requested, choices=[c],
                                         warning=resolved.warning if c.index == 0 else None,
                                         usage=usage if continuous else None))
        if body.stream_options and body.stream_options.include_usage:
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": resolved.requested,
                       "choices": [], "usage": usage.model_dump(exclude_none=True)})
        yield DONE
    return StreamingResponse(body_iter(), media_type="text/event-stream", headers=headers)

