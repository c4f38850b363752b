"""`LLM`: the offline API. `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from cedlm.engine.engine import Engine, EngineConfig
from cedlm.engine.loader import load
from cedlm.engine.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None = None
    top_logprobs: list | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)


class LLM:
    def __init__(self, model=None, tokenizer=None, *, prefill_mode: str = "bounded",
                 kv_budget_bytes: int = 256 << 20, max_num_seqs: int = 16, block_tokens: int = 64,
                 prefill_chunk: int = 512, replay_mode: str = "bounded", enable_prefix_cache: bool = True,
                 max_model_len: int | None = None, store=None, seed: int = 0,
                 num_threads: int | None = None, engram_mmap: str | None = None):
        if num_threads is not None:
            import torch
            torch.set_num_threads(num_threads)
        self.model, self.tokenizer = load(model, tokenizer, seed)
        if engram_mmap is not None:
            self.model.offload_engram(engram_mmap)
        if isinstance(store, str):
            from cedlm.cache.store import StoreConnectionError, open_store
            try:
                store = open_store(store)
            except StoreConnectionError as e:    # a cache, not a dependency: start without it
                import logging
                logging.getLogger(__name__).warning("%s; starting anyway, every store call is a miss "
                                                    "until it answers", e)
                store = open_store(store, check_connection=False)
        self.engine = Engine(self.model, self.tokenizer, EngineConfig(
            kv_budget_bytes=kv_budget_bytes, max_num_seqs=max_num_seqs, block_tokens=block_tokens,
            prefill_chunk=prefill_chunk, prefill_mode=prefill_mode, replay_mode=replay_mode,
            enable_prefix_cache=enable_prefix_cache, max_model_len=max_model_len), store=store)

    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token-id lists")
            return self.tokenizer.encode(prompt, add_bos=True)
        return [int(t) for t in prompt]

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Strings or token-id lists (one or many) -> one RequestOutput per prompt, in order."""
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        if single:
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} for {len(prompts)} prompts")
        reqs = []
        try:
            for p, sp in zip(prompts, params):
                reqs.append(self.engine.add_request(self.encode(p), sp))
            t0 = time.monotonic()
            while any(not r.finished for r in reqs):
                self.engine.step()
            failed = next((r for r in reqs if r.finish_reason == "error"), None)
            if failed is not None:
                raise RuntimeError(f"request {failed.request_id} failed: {failed.error}")
        except BaseException:
            for r in reqs:                      # nothing leaks: free every KV block we hold
                self.engine.abort(r.request_id)
            raise
        dt = time.monotonic() - t0
        outs = []
        for p, r in zip(prompts, reqs):
            want_lp = r.params.logprobs is not None
            outs.append(RequestOutput(
                r.request_id, p if isinstance(p, str) else None, r.prompt_ids, r.text, r.output_ids,
                r.finish_reason, r.output_logprobs if want_lp else None,
                r.top_logprobs if want_lp and r.params.logprobs else None, r.num_prefix_hit,
                {"elapsed_s": dt, "preemptions": r.num_preemptions}))
        return outs

    # ---------------------------------------------------------------- sessions
    def save_session(self, key: str, prompt) -> int:
        """Prefill `prompt` and store its global KV + token ids under `key` (no window state).
        Returns the bytes stored: 0 when the store could not take it (counted in store_errors)."""
        from cedlm.engine.session import save_session
        if self.engine.store is None:
            raise ValueError("store: LLM(..., store=PATH or redis://...) is needed for sessions")
        st = self.model.new_state()
        self.model.prefill(self.encode(prompt), st, self.engine.cfg.prefill_mode,
                           chunk_size=self.engine.cfg.prefill_chunk)
        return save_session(self.model, self.engine.store, key, st, self.engine.fingerprint)

    def restore_session(self, key: str, mode: str = "exact"):
        """(state, next-token logits) rebuilt from the store by replay, or None on a miss."""
        from cedlm.engine.session import restore_session
        if self.engine.store is None:
            raise ValueError("store: LLM(..., store=PATH or redis://...) is needed for sessions")
        return restore_session(self.model, self.engine.store, key, self.engine.fingerprint, mode)

    def stats(self) -> dict:
        return {**self.engine.counters, **self.engine.kv_stats()}
