"""The engine: runs the model over what the scheduler plans, samples, and checks stops.

Per step: the scheduler reserves KV blocks through the KV cache manager, then the engine runs
one batched decode token for the running sequences and one encoder chunk of a prefilling
sequence, samples, checks stops, and finishes requests (the scheduler frees their blocks through
the manager, which publishes full blocks to the prefix cache and the store). Window rings are
per sequence and rebuilt by replay after a prefix hit (never stored).
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from cedlm.cache.kv_cache_manager import KVCacheManager, blocks_for_budget
from cedlm.cache.prefix import model_fingerprint
from cedlm.engine.request import Request, Status
from cedlm.engine.sampler import Sampler, make_generator
from cedlm.engine.sampling_params import SamplingParams
from cedlm.engine.stop import StopChecker
from cedlm.engine.scheduler import Scheduler
from cedlm.model import PREFILL_MODES, CEDModel
from cedlm.model.replay import REPLAY_MODES
from cedlm.model.state import SequenceState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSnapshot:
    """A read-only picture of the engine between steps: what the server and metrics read."""
    num_running: int
    num_waiting: int
    max_num_seqs: int
    pool_tokens: int                      # positions the whole block pool can hold
    kv: dict                              # kv_stats()
    peak: dict                            # peak KV bytes in use, by kind
    counters: dict


@dataclass
class EngineConfig:
    kv_budget_bytes: int = 256 << 20      # pool + per-sequence windows
    max_num_seqs: int = 16
    block_tokens: int = 64
    prefill_chunk: int = 512
    prefill_mode: str = "bounded"         # full | exact | bounded
    replay_mode: str = "bounded"          # window rebuild after a prefix hit / restore
    enable_prefix_cache: bool = True
    max_model_len: int | None = None

    def __post_init__(self):
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode: {self.prefill_mode!r} is not one of {PREFILL_MODES}")
        if self.replay_mode not in REPLAY_MODES:
            raise ValueError(f"replay_mode: {self.replay_mode!r} is not one of {REPLAY_MODES}")


class Engine:
    def __init__(self, model: CEDModel, tokenizer=None, config: EngineConfig | None = None, store=None):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.cfg = config or EngineConfig()
        layout = model.kv_layout
        self.block_tokens = layout.round_block_tokens(self.cfg.block_tokens)
        num_blocks = blocks_for_budget(layout, self.cfg.kv_budget_bytes, self.cfg.max_num_seqs,
                                       self.block_tokens)
        self.fingerprint = model_fingerprint(model.cfg.to_dict(), model.state_dict())
        self.kv = KVCacheManager(layout, num_blocks, self.block_tokens, fingerprint=self.fingerprint,
                                 enable_prefix_cache=self.cfg.enable_prefix_cache, store=store)
        self.max_model_len = self.cfg.max_model_len or model.cfg.max_position_embeddings
        self.scheduler = Scheduler(self.kv, num_blocks=num_blocks, block_tokens=self.block_tokens,
                                   max_num_seqs=self.cfg.max_num_seqs,
                                   prefill_chunk=self.cfg.prefill_chunk, max_model_len=self.max_model_len)
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self.peak: dict[str, int] = {}           # peak KV bytes in use, by kind
        self._ids = itertools.count()
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "encoder_tokens": 0,
                         "decoder_prefill_tokens": 0, "replay_tokens": 0, "preemptions": 0,
                         "requests_finished": 0, "requests_failed": 0}

    @property
    def pool(self):
        return self.kv.pool

    @property
    def store(self):
        return self.kv.store

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Request:
        params = params or SamplingParams()
        V = self.model.cfg.vocab_size
        bad = [t for t in prompt_ids if not 0 <= int(t) < V]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {V})")
        req = Request(request_id or f"req-{next(self._ids)}", [int(t) for t in prompt_ids], params)
        eos = None if self.tokenizer is None else self.tokenizer.eos_id
        req.stop = StopChecker(params, eos_token_id=eos)
        req.generator = make_generator(params.seed)
        req.detok = self.tokenizer.stream() if self.tokenizer is not None else None
        self.scheduler.add(req)
        self.requests[req.request_id] = req
        self.counters["prompt_tokens"] += len(prompt_ids)
        return req

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self.scheduler.abort(req)
            req.finish_reason = "abort"
            req.finish_time = time.monotonic()
        self.requests.pop(request_id, None)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ---------------------------------------------------------------- stepping
    def step(self) -> list[Request]:
        """One scheduling step; returns the requests that finished in it."""
        out = self.scheduler.schedule()
        self.counters["preemptions"] += len(out.preempted)
        finished: list[Request] = []
        if out.decode:
            finished += self._contained(out.decode, lambda: self._decode(out.decode))
        if out.prefill is not None:
            finished += self._contained([out.prefill],
                                        lambda: self._prefill(out.prefill, out.prefill_tokens))
        for r in finished:                        # the caller holds its own reference
            self.requests.pop(r.request_id, None)
        kv = self.kv_stats()
        for k in ("main_kv", "index_keys", "window", "compressor_state"):
            self.peak[k] = max(self.peak.get(k, 0), kv[k])
        return finished

    def _contained(self, reqs: list[Request], run) -> list[Request]:
        """Run one batch; an exception fails the requests of that batch alone (finish_reason
        "error", their KV freed) and the engine goes on with everyone else."""
        try:
            return run()
        except Exception as e:                  # noqa: BLE001 - contained to this batch
            log.exception("engine step failed for %s", [r.request_id for r in reqs])
            now = time.monotonic()
            failed = []
            for r in reqs:
                if r.finished:
                    continue
                r.finish_reason, r.error, r.finish_time = "error", f"{type(e).__name__}: {e}", now
                self.scheduler.finish(r)
                self.counters["requests_failed"] += 1
                failed.append(r)
            return failed

    def _new_state(self, req: Request) -> SequenceState:
        st = self.model.new_state(rows=self.kv.rows(req))
        hit = req.num_prefix_hit
        if hit:
            st.adopt_prefix(req.all_ids[:hit])            # entries are in the adopted blocks
            self.model.replay(st, self.cfg.replay_mode)   # rebuild the windows
            self.counters["replay_tokens"] += min(hit, self.model.replay_tokens(self.cfg.replay_mode))
        return st

    def _prefill(self, req: Request, n: int) -> list[Request]:
        if req.prefill is None:
            req.state = self._new_state(req)
            todo = req.all_ids[req.num_cached:]
            self.counters["decoder_prefill_tokens"] += self.model.decoder_rows(len(todo), self.cfg.prefill_mode)
            req.prefill = self.model.start_prefill(todo, req.state, self.cfg.prefill_mode,
                                                   chunk_size=self.cfg.prefill_chunk)
        self.counters["encoder_tokens"] += n
        # num_cached grows only after the chunk ran: a failure mid-chunk never publishes
        # half-written blocks to the prefix cache.
        done = req.prefill.step()
        req.num_cached += n
        if not done:
            return []
        logits = req.prefill.logits[-1:]
        req.prefill = None
        req.status = Status.RUNNING
        self.kv.cache_full_blocks(req)
        return self._accept([req], logits)

    def _decode(self, reqs: list[Request]) -> list[Request]:
        ids = [r.output_ids[-1] for r in reqs]
        logits = self.model.decode(ids, [r.state for r in reqs])
        for r in reqs:
            r.num_cached += 1
        return self._accept(reqs, logits)

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list:
        """Sample the batch; if that fails, sample row by row so that only the request whose
        row fails gets the exception (in place of its sample)."""
        try:
            res = self.sampler.sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
            return [(res.token_ids[i], res.logprobs[i], res.top_logprobs[i] if res.top_logprobs else None)
                    for i in range(len(reqs))]
        except Exception:                       # noqa: BLE001 - find the request it belongs to
            out = []
            for i, r in enumerate(reqs):
                try:
                    res = self.sampler.sample(logits[i:i + 1], [r.params], [r.generator])
                    out.append((res.token_ids[0], res.logprobs[0],
                                res.top_logprobs[0] if res.top_logprobs else None))
                except Exception as e:          # noqa: BLE001
                    out.append(e)
            return out

    def _accept(self, reqs: list[Request], logits: torch.Tensor) -> list[Request]:
        samples = self._sample(reqs, logits)
        finished = []
        now = time.monotonic()
        for r, sample in zip(reqs, samples):
            if isinstance(sample, Exception):
                log.error("sampling failed for %s: %r", r.request_id, sample)
                r.finish_reason, r.error, r.finish_time = "error", f"{type(sample).__name__}: {sample}", now
                self.scheduler.finish(r)
                self.counters["requests_failed"] += 1
                finished.append(r)
                continue
            tok_t, lp, top = sample
            tok = int(tok_t)
            r.output_ids.append(tok)
            r.output_logprobs.append(float(lp))
            if top is not None:
                r.top_logprobs.append(top)
            r.first_token_time = r.first_token_time or now
            self.counters["generation_tokens"] += 1
            delta = r.detok.push(tok) if r.detok is not None else ""
            st = r.stop.update_delta(tok, delta)
            r.text += st.text
            if not st.finished and r.num_tokens >= self.max_model_len:
                st = r.stop.finish("length")
                r.text += st.text
            if st.finished:
                r.finish_reason = st.reason
                r.finish_time = now
                self.scheduler.finish(r)
                self.counters["requests_finished"] += 1
                finished.append(r)
        return finished

    # ---------------------------------------------------------------- stats
    def snapshot(self) -> EngineSnapshot:
        s = self.scheduler
        return EngineSnapshot(num_running=len(s.active), num_waiting=len(s.waiting),
                              max_num_seqs=s.max_num_seqs, pool_tokens=s.num_blocks * s.block_tokens,
                              kv=self.kv_stats(), peak=dict(self.peak), counters=dict(self.counters))

    def kv_stats(self) -> dict:
        active = [r for r in self.scheduler.active if r.state is not None]
        used = self.pool.bytes_in_use()
        return {
            "kv_bytes_per_token": float(self.model.kv_layout.bytes_per_token),
            "pool_bytes": self.pool.nbytes,
            "blocks_total": self.pool.num_blocks,
            "blocks_in_use": self.pool.num_used,
            "main_kv": used["main_kv"],
            "index_keys": used["index_keys"],
            "window": len(active) * self.model.kv_layout.window_bytes_per_sequence,
            "compressor_state": sum(r.state.pending_bytes() for r in active),
            **self.pool.stats,
            **self.kv.stats,
        }
