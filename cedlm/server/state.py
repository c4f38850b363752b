"""What the request handlers share: `ServerState`, stored as `app.state.server`.

It resolves model names, checks prompt lengths, builds `SamplingParams` from a request body and
renders token ids for logprobs. Engine sizes are read once, through `engine.max_model_len` and
`engine.snapshot()`; handlers never touch the engine otherwise (the worker thread owns it).

Tokenization runs in a worker thread (`tokenize`), never on the event loop, and a text that
cannot fit the prompt limit is refused before it is tokenized: a token covers at most
`max_token_chars` characters (its byte-level string has one character per byte of the text, and
a character is at least one byte), so a text longer than that x the limit cannot fit (for the
official vocabulary and a 65,536-token limit, about 2M characters: far below what the 8 MiB body
limit lets in). A long text is encoded in pieces through the tokenizer's batch API
(`Tokenizer.encode_plain`), which releases the GIL, so the event loop runs in between.

`params` maps a request onto `SamplingParams`: n, best_of, the presence / frequency /
repetition penalties, logit_bias, allowed_token_ids and prompt_logprobs go to the engine's own
fields; structured output, `min_tokens` and `min_p` are logits processors (`constrain.py`) on its
`logits_processors` hook. A value the engine build cannot carry is a 400 naming the field, never
silently dropped. A request without `max_tokens` gets the operator's `default_max_tokens`
(`cedlm serve --default-max-tokens`), within the context left; one without `temperature`,
`top_p`, `top_k`, `min_p` or `repetition_penalty` gets the model's `sampling_defaults` (its
generation_config.json: `sampling_defaults.py`), else the neutral value.
"""
from __future__ import annotations

import time
import dataclasses
from typing import Any, Callable, TypeVar


from cedlm.engine.sampling_params import SamplingParams
from cedlm.server import lanes
from cedlm.server.aliases import DEPRECATION_HEADER, AliasTable, ModelNotFound, Resolved
from cedlm.server.compile_queue import ClientGone, CompileBusy
from cedlm.server.constrain import GrammarError, Grammars, MinPProcessor, MinTokensProcessor
from cedlm.server.errors import APIError, model_not_found
from cedlm.server.metrics import Metrics
from cedlm.engine.sampling_defaults import NEUTRAL
from cedlm.server.worker import EngineWorker
from cedlm.text.chat import THINK_END

TOKENIZE_THREADS = 8          # tokenizing threads at once (their own lane; see ServerState.tokenize)
DEFAULT_MAX_TOKENS = 256      # `cedlm serve --default-max-tokens`: returns in seconds on a 2-core CPU


T = TypeVar("T")


def finite_logprob(x: float) -> float:
    return max(float(x), -9999.0)          # JSON has no -inf


def _max_token_chars(tok) -> int | None:
    try:
        return max(len(k) for k in tok.hf.get_vocab(with_added_tokens=True))
    except Exception:                          # noqa: BLE001 - no bound then, only the check after
        return None


def engine_fields() -> set[str]:
    """The fields the engine's SamplingParams has (read per request: the engine grows)."""
    return {f.name for f in dataclasses.fields(SamplingParams)}


class ServerState:
    def __init__(self, engine, tokenizer, aliases: AliasTable, worker: EngineWorker, metrics: Metrics,
                 max_prompt_tokens: int | None = None, default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
                 sampling_defaults: dict | None = None):
        self.tok, self.aliases, self.worker, self.metrics = tokenizer, aliases, worker, metrics
        self.default_max_tokens = default_max_tokens
        self.sampling_defaults = {**NEUTRAL, **(sampling_defaults or {})}
        model_cfg = getattr(getattr(engine, "model", None), "cfg", None)
        self.vocab_size = int(getattr(model_cfg, "vocab_size", 0) or (tokenizer.vocab_size if tokenizer else 0))
        self.grammars = Grammars(tokenizer, self.vocab_size) if tokenizer is not None else None
        self.think_end_id = tokenizer.token_to_id(THINK_END) if tokenizer is not None else None
        self.max_model_len = engine.max_model_len
        self.engine = engine                       # read only for `compile_status` (plain attributes)
        dev = getattr(engine, "device", None)      # where the model runs: on /v1/models' cards
        self.device = None if dev is None else str(dev)
        self.max_prompt_tokens = min(self.max_model_len, max_prompt_tokens or self.max_model_len)
        snap = engine.snapshot()
        self.pool_tokens, self.max_num_seqs = snap.pool_tokens, snap.max_num_seqs
        self.created = int(time.time())
        self._tokenize_lane = None                 # anyio.CapacityLimiter, made in the event loop
        self.max_token_chars = _max_token_chars(tokenizer) if tokenizer is not None else None
        if tokenizer is not None and hasattr(tokenizer, "encode_plain"):
            tokenizer.encode_plain("")         # build the plain encoder now, not in a request

    async def tokenize(self, fn: Callable[[], T]) -> T:
        """Run a tokenizing function (or building a request's matchers) off the event loop, in its
        own lane: at most TOKENIZE_THREADS at once, apart from the thread pool everything else
        shares (constraints compile in their own queue, images in their own thread)."""
        import anyio
        if self._tokenize_lane is None:
            self._tokenize_lane = anyio.CapacityLimiter(TOKENIZE_THREADS)
        return await anyio.to_thread.run_sync(fn, limiter=self._tokenize_lane)

    def check_chars(self, n_chars: int, param: str) -> None:
        """Refuse, before tokenizing, a text too long to fit the prompt limit in any case."""
        if self.max_token_chars and n_chars > self.max_token_chars * self.max_prompt_tokens:
            raise APIError(400, f"{param}: the prompt has {n_chars} characters, far more than the prompt "
                                f"limit of {self.max_prompt_tokens} tokens can hold", param=param,
                           code="context_length_exceeded")

    @property
    def max_samples(self) -> int:
        """The most samples (n / best_of) one request may run: half the engine's sequence slots,
        so that one request never holds every slot (the others keep a fair share)."""
        return max(1, self.max_num_seqs // 2)

    def check_samples(self, body) -> None:
        for name in ("best_of", "n"):
            v = getattr(body, name, None)
            if v is not None and v > self.max_samples:
                raise APIError(400, f"{name}: at most {self.max_samples} samples per request on this server "
                                    f"(half its {self.max_num_seqs} sequence slots), got {v}", param=name)

    def check_capacity(self, n_sequences: int, param: str) -> None:
        """Refuse (400, not 429: a retry cannot succeed) a request of more sequences (prompts x
        samples) than the engine's slots and the waiting queue can ever hold at once."""
        bound = self.worker.max_waiting
        if bound is not None and n_sequences > bound + self.max_num_seqs:
            raise APIError(400, f"{param}: the request needs {n_sequences} sequences (prompts x max(n, best_of)); "
                                f"this server holds at most {bound + self.max_num_seqs} at once (max_num_seqs "
                                f"{self.max_num_seqs} + max_waiting {bound}): split it into smaller requests",
                           param=param, code="request_too_large")

    def resolve(self, name) -> Resolved:
        try:
            return self.aliases.resolve(name)
        except ModelNotFound as e:
            raise model_not_found(str(e)) from None

    def check_len(self, ids: list[int], param: str) -> None:
        if len(ids) > self.max_prompt_tokens:
            limit = (f"the context (max_model_len {self.max_model_len})"
                     if self.max_prompt_tokens == self.max_model_len
                     else f"the server's prompt limit (max_prompt_tokens {self.max_prompt_tokens})")
            raise APIError(400, f"{param}: the prompt has {len(ids)} tokens, more than {limit}", param=param,
                           code="context_length_exceeded")

    async def grammar(self, guided: tuple[str, str, Any] | None) -> str | None:
        """Compile a request's output constraint (param, kind, value) off the event loop, through
        the compile queue (a cache, a bound per client and in all: 429 with retry-after when full;
        dropped when the client leaves; its own threads, not the shared pool), bounds first, in a
        compiler process (`constrain.Grammars`); a bad one is a 400 naming param."""
        if guided is None:
            return None
        param, kind, value = guided
        if self.grammars is None or not self.grammars.available:
            raise APIError(400, f"{param}: structured output needs a tokenizer and the llguidance package",
                           param=param)
        ctx = lanes.current()
        try:
            return await self.grammars.compile_async(param, kind, value, ctx.client, ctx.gone)
        except GrammarError as e:
            raise APIError(400, str(e), param=e.param) from None
        except CompileBusy as e:
            raise APIError(429, str(e), param=param, type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"retry-after": str(e.retry_after)}) from None
        except ClientGone:
            raise APIError(400, f"{param}: the client went away while its constraint waited to compile",
                           param=param, code="client_disconnected") from None

    def sampling(self, body, name: str):
        """The request's value of a sampling field, else the model's default for it."""
        v = getattr(body, name, None)
        return self.sampling_defaults[name] if v is None else v

    def max_tokens_for(self, max_tokens: int | None, n_prompt: int) -> int:
        left = max(1, min(self.max_model_len, self.pool_tokens) - n_prompt)
        if max_tokens is not None:
            return max_tokens
        return min(left, self.default_max_tokens) if self.default_max_tokens else left

    def params(self, body, prompt_ids: list[int], max_tokens: int | None, logprobs: int | None, *,
               grammar: str | None = None, grammar_param: str = "response_format", gate: int | None = None,
               prompt_logprobs: int | None = None) -> SamplingParams:
        """SamplingParams of one prompt (its n / best_of samples run as one engine group; sample
        i gets seed + i). The grammar processor is built here, fresh for each prompt."""
        fields = engine_fields()
        self.check_samples(body)
        temperature = self.sampling(body, "temperature")
        kw: dict[str, Any] = dict(
            max_tokens=self.max_tokens_for(max_tokens, len(prompt_ids)),
            temperature=temperature,
            top_p=self.sampling(body, "top_p"),
            top_k=self.sampling(body, "top_k"),
            seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=body.include_stop_str_in_output, cache_salt=body.cache_salt,
            skip_special_tokens=body.skip_special_tokens)
        native = {"n": (body.n, 1), "best_of": (body.best_of, None),
                  "presence_penalty": (body.presence_penalty, 0.0), "frequency_penalty": (body.frequency_penalty, 0.0),
                  "repetition_penalty": (self.sampling(body, "repetition_penalty"), 1.0),
                  "logit_bias": (body.logit_bias or None, None),
                  "allowed_token_ids": (body.allowed_token_ids, None), "prompt_logprobs": (prompt_logprobs, None)}
        for name, (v, neutral) in native.items():
            if v is None or v == neutral:
                continue
            if name not in fields:
                param = "echo" if name == "prompt_logprobs" and getattr(body, "echo", False) else name
                raise APIError(400, f"{param}: not supported by this engine build (cedlm.engine.SamplingParams "
                                    f"has no {name})", param=param)
            kw[name] = v
        procs: list = []
        hooked: list[str] = []             # the parameters that need the logits_processors hook
        if grammar is not None:
            if body.ignore_eos:
                raise APIError(400, "ignore_eos: cannot be combined with structured output or a forced "
                                    "tool call (the output ends where the grammar does)", param="ignore_eos",
                               code="invalid_combination")
            try:
                procs.append(self.grammars.processor(grammar, grammar_param, gate))
            except GrammarError as e:
                raise APIError(400, str(e), param=e.param) from None
            if body.allowed_token_ids and gate is None:
                self._check_allowed_start(procs[-1], body.allowed_token_ids, grammar_param)
            hooked.append(grammar_param)
        if body.min_tokens:
            eos = [self.tok.eos_id] if self.tok is not None and not body.ignore_eos else []
            procs.append(MinTokensProcessor(body.min_tokens, eos + list(body.stop_token_ids or [])))
            hooked.append("min_tokens")
        min_p = self.sampling(body, "min_p")
        if min_p:
            procs.append(MinPProcessor(min_p, temperature))
            hooked.append("min_p")
        if procs:
            if "logits_processors" not in fields:
                raise APIError(400, f"{hooked[0]}: not supported by this engine build (cedlm.engine.SamplingParams "
                                    f"has no logits_processors hook)", param=hooked[0])
            kw["logits_processors"] = procs
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            msg = str(e)
            raise APIError(400, msg, param=msg.split(" ", 1)[0].rstrip(":")) from None

    def _check_allowed_start(self, proc, allowed: list[int], grammar_param: str) -> None:
        """allowed_token_ids that contradict the grammar from the first token on: a 400 here,
        before anything runs (a later dead end is the engine's ConstraintConflict, also a 400)."""
        import torch
        start = torch.isfinite(proc([], torch.zeros(proc.V, device="cpu")))     # a host-side check
        if not any(0 <= t < proc.V and bool(start[t]) for t in allowed):
            raise APIError(400, f"allowed_token_ids: none of the allowed tokens can begin the output that "
                                f"{grammar_param} requires", param="allowed_token_ids",
                           code="constraint_conflict")

    def headers(self, resolved: Resolved, extra: dict | None = None) -> dict:
        h = dict(extra or {})
        if resolved.deprecated:
            h[DEPRECATION_HEADER] = resolved.header
        return h

    def tok_text(self, i: int) -> str:
        return self.tok.decode([i]) if self.tok is not None else str(i)

    def tok_bytes(self, i: int) -> list[int] | None:
        return list(self.tok.token_bytes(i)) if self.tok is not None else None
