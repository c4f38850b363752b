"""`LLM`: the offline API. `LLM(model=...).generate(prompts, SamplingParams(...))`, `LLM.chat(messages)`.

Outputs are plain Python values (ints, floats, strings, lists): no tensors."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

from cedlm.engine.args import EngineArgs
from cedlm.engine.engine import Engine
from cedlm.engine.loader import DEFAULT_MODEL, load, model_device
from cedlm.engine.output import StepOutput
from cedlm.engine.request import Request, TokenLogprob, select_samples
from cedlm.engine.sampling_defaults import read as read_generation_config
from cedlm.engine.sampling_params import SamplingParams
from cedlm.model import CEDModel


@dataclass
class CompletionOutput:
    """One sample of a prompt. logprobs: raw logprob of each generated token (when
    SamplingParams.logprobs is set); top_logprobs: per generated token, (top ids, their logprobs)
    (when logprobs = k > 0); cumulative_logprob: their sum (how best_of ranks samples)."""
    index: int                      # sample index i (it used seed + i)
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    cumulative_logprob: float = 0.0


@dataclass
class RequestOutput:
    """The result for one prompt. The flat fields (text, token_ids, finish_reason, logprobs,
    top_logprobs) are those of outputs[0]; outputs holds all n samples (one unless n > 1).
    prompt_logprobs: with SamplingParams.prompt_logprobs, one entry per prompt token (entry 0
    None, then `TokenLogprob(token_id, logprob, rank, top_ids, top_logprobs)`)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None = None
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)


class _Collected:
    """One sample's StepOutputs added up (LLM.generate)."""

    def __init__(self, index: int):
        self.index, self.token_ids, self.logprobs, self.top, self.text = index, [], [], [], ""
        self.finish_reason = self.stop_reason = self.times = None

    def add(self, o: StepOutput) -> None:
        self.token_ids += o.new_token_ids
        self.logprobs += o.new_logprobs
        self.top += o.new_top_logprobs or ()
        self.text += o.text
        if o.finished:
            self.finish_reason, self.stop_reason, self.times = o.finish_reason, o.stop_reason, o.times

    def output(self, params: SamplingParams) -> CompletionOutput:
        """The finished sample as plain Python values."""
        want_lp = params.logprobs is not None
        top = [(list(i), list(v)) for i, v in self.top] if want_lp and params.logprobs else None
        return CompletionOutput(self.index, self.text, list(self.token_ids), self.finish_reason,
                                self.stop_reason, list(self.logprobs) if want_lp else None, top,
                                float(sum(self.logprobs)))


def _timings(c: _Collected) -> dict:
    """Sample 0's queue time, time to first token, time per output token and end-to-end time."""
    t = c.times
    if t is None:
        return {}
    return {"queue_s": t.queue_s, "ttft_s": t.ttft_s, "e2e_s": t.e2e_s,
            "time_per_output_token_s": t.time_per_output_token(len(c.token_ids))}


def _split_images(prompt):
    """(prompt, images or None) of a generate() prompt (a dict carries multi_modal_data)."""
    if not isinstance(prompt, dict):
        return prompt, None
    if "prompt" not in prompt:
        raise ValueError("prompt: a dict prompt needs 'prompt' (text or token ids)")
    images = (prompt.get("multi_modal_data") or {}).get("image")
    if images is not None and not isinstance(images, (list, tuple)):
        images = [images]
    return prompt["prompt"], list(images) if images else None


class LLM:
    def __init__(self, model=None, tokenizer=None, *, args: EngineArgs | None = None, **options):
        """`model`: a checkpoint directory, a preset name or a CEDModel; the engine options are
        `EngineArgs` fields (engine/args.py: kv_budget_bytes, max_num_seqs, block_tokens,
        prefill_chunk, prefill_mode, replay_mode, enable_prefix_cache, max_model_len,
        speculative="dspark", speculative_threshold, num_draft_tokens, speculative_policy,
        num_threads, engram_mmap, seed, store, device), as keywords or as `args`. `device`
        (default: CUDA when available, else the CPU; a CEDModel instance stays where it is, or is
        moved there in place when a device is given) holds the weights, the KV cache and the
        sampler; the Engram tables stay in host RAM with `engram_mmap`. `self.device` is where it
        runs."""
        if args is not None and options:
            raise ValueError(f"args: pass EngineArgs or keyword options, not both ({sorted(options)})")
        bad = sorted(set(options) - {f.name for f in dataclasses.fields(EngineArgs)})
        if bad:
            raise ValueError(f"{bad[0]}: not an engine option (see cedlm.engine.args.EngineArgs)")
        self.args = a = args or EngineArgs(**options)     # the options first: fail before loading
        if a.num_threads is not None:
            import torch
            torch.set_num_threads(a.num_threads)
        # resolved before loading (EngineArgs checked it already): a bad device fails fast
        dev = None if a.device is None and isinstance(model, CEDModel) else a.resolved_device()
        self.model, self.tokenizer = load(model, tokenizer, a.seed, device=dev, engram_mmap=a.engram_mmap)
        self.device = model_device(self.model)
        # what generate / chat sample with when given no sampling parameters: the model
        # directory's generation_config.json (as `cedlm serve` and vLLM's LLM do); none for a
        # preset or a CEDModel
        directory = DEFAULT_MODEL if model is None else model if isinstance(model, (str, Path)) else None
        self.generation_defaults = read_generation_config(directory) if directory is not None else {}
        store = a.store
        if isinstance(store, str):
            from cedlm.cache.store import StoreConnectionError, open_store
            try:
                store = open_store(store, capacity_bytes=a.store_capacity_bytes)
            except StoreConnectionError as e:    # a cache, not a dependency: start without it
                import logging
                logging.getLogger(__name__).warning("%s; starting anyway, every store call is a miss "
                                                    "until it answers", e)
                store = open_store(store, capacity_bytes=a.store_capacity_bytes, check_connection=False)
        self.engine = Engine(self.model, self.tokenizer, a.engine_config(), store=store,
                             speculative=a.speculative_config())
        # a compiled decode step's graphs are built in the background: the first generate runs
        # the same step uncompiled instead of waiting minutes for the compiler
        self.engine.compile_in_background()

    def default_sampling_params(self) -> SamplingParams:
        """The sampling parameters of a call that gives none: `SamplingParams()` with the model's
        generation_config.json values (temperature, top_p, top_k, repetition_penalty; its min_p is
        a logits processor of `cedlm serve`'s, which this API does not build)."""
        fields = {f.name for f in dataclasses.fields(SamplingParams)}
        return SamplingParams(**{k: v for k, v in self.generation_defaults.items() if k in fields})

    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token-id lists")
            return self.tokenizer.encode(prompt, add_bos=True)
        return [int(t) for t in prompt]

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Strings or token-id lists (one or many) -> one RequestOutput per prompt, in order
        (with n > 1 / best_of, its `outputs` holds the n samples). A prompt with images (vision
        models) is a dict `{"prompt": str | ids, "multi_modal_data": {"image": img | [img, ...]}}`
        with one `<｜deepseek_image｜>` placeholder per image (PIL image, bytes, path or data: URL)."""
        single = isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int))
        if single:
            prompts = [prompts]
        params = sampling_params or self.default_sampling_params()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} for {len(prompts)} prompts")
        groups: list[list[Request]] = []
        got: dict[str, _Collected] = {}
        t0 = time.monotonic()
        try:
            for p, sp in zip(prompts, params):
                p, images = _split_images(p)
                groups.append(self.engine.add_samples(self.encode(p), sp or self.default_sampling_params(),
                                                      images=images))
                got.update((r.request_id, _Collected(r.sample_index)) for r in groups[-1])
            reqs = [r for g in groups for r in g]
            while any(not r.finished for r in reqs):
                for o in self.engine.step():
                    if o.request_id in got:
                        got[o.request_id].add(o)
            failed = next((r for r in reqs if r.finish_reason == "error"), None)
            if failed is not None:
                raise RuntimeError(f"request {failed.request_id} failed: {failed.error}")
        except BaseException:
            for g in groups:                    # nothing leaks: free every KV block we hold
                for r in g:
                    self.engine.abort(r.request_id)
            raise
        dt = time.monotonic() - t0
        outs = []
        for p, sp, g in zip(prompts, params, groups):
            lead = g[0]
            sp = sp or lead.params
            samples = select_samples([got[r.request_id].output(r.params) for r in g], sp.n)
            first = samples[0]
            p = _split_images(p)[0]
            outs.append(RequestOutput(
                lead.group_id, p if isinstance(p, str) else None, list(lead.prompt_ids), first.text,
                first.token_ids, first.finish_reason, first.logprobs, first.top_logprobs,
                lead.num_cached_tokens,
                {"elapsed_s": dt, "preemptions": sum(r.num_preemptions for r in g),
                 **_timings(got[lead.request_id])},
                lead.prompt_logprobs if lead.params.prompt_logprobs is not None else None,
                samples))
        return outs

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             thinking_mode: str = "chat", reasoning_effort: str | int | None = None,
             tools: list[dict] | None = None, drop_thinking: bool = True) -> list[RequestOutput]:
        """One conversation (a list of message dicts) or a list of conversations -> one
        RequestOutput per conversation, as `generate`. Each is rendered with the DeepSeek-V4.1
        chat encoder (`cedlm.text.chat.encode_chat_ids`: only the encoder emits control tokens;
        the prompt ends with the assistant turn's opening, `</think>` in chat mode, `<think>` in
        thinking mode); `prompt` in the output is the rendered string. The text is the raw
        generation (split reasoning and content with `cedlm.text.chat.parse_assistant`)."""
        from cedlm.text.chat import encode_chat, encode_chat_ids
        if self.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer; use generate() with token ids")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages: a list of message dicts, or a list of such lists")
        from cedlm.text.images import message_images
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        ids, texts = [], []
        for conv in convs:
            if not isinstance(conv, (list, tuple)):
                raise ValueError("messages: a list of message dicts, or a list of such lists")
            args = (list(conv), thinking_mode, reasoning_effort, drop_thinking, tools)
            texts.append(encode_chat(*args))
            ids.append(encode_chat_ids(args[0], self.tokenizer, *args[1:]))
            images = message_images(args[0])
            if images:
                ids[-1] = {"prompt": ids[-1], "multi_modal_data": {"image": images}}
        outs = self.generate(ids, sampling_params)
        for o, t in zip(outs, texts):
            o.prompt = t
        return outs

    # ---------------------------------------------------------------- sessions
    def save_session(self, key: str, prompt) -> int:
        """Prefill `prompt` and store its global KV + token ids under `key` (no window state).
        Returns the bytes stored: 0 when the store could not take it (counted in store_errors)."""
        from cedlm.engine.session import save_session
        if self.engine.store is None:
            raise ValueError("store: LLM(..., store=PATH or redis://...) is needed for sessions")
        if isinstance(prompt, dict):
            raise ValueError("save_session: prompts with images are not supported (a session "
                             "stores token ids and replays them; image embeddings are not stored)")
        ids = self.encode(prompt)
        img = getattr(self.model, "image_token_id", None)
        if img is not None and img in ids:
            raise ValueError(f"save_session: the prompt holds image placeholders (token {img}); "
                             f"sessions with images are not supported")
        st = self.model.new_state()
        self.model.prefill(ids, st, self.engine.cfg.prefill_mode,
                           chunk_size=self.engine.cfg.prefill_chunk)
        return save_session(self.model, self.engine.store, key, st, self.engine.fingerprint)

    def restore_session(self, key: str, mode: str = "exact"):
        """(state, next-token logits) rebuilt from the store by replay, or None on a miss."""
        from cedlm.engine.session import restore_session
        if self.engine.store is None:
            raise ValueError("store: LLM(..., store=PATH or redis://...) is needed for sessions")
        return restore_session(self.model, self.engine.store, key, self.engine.fingerprint, mode)

    def stats(self) -> dict:
        return {**self.engine.all_counters(), **self.engine.kv_stats()}
