"""The engine: scheduler + paged KV pool + prefix cache + persistence around a CEDModel.

Per step: the scheduler reserves blocks, then the engine runs one batched decode token for the
running sequences and one encoder chunk of a prefilling sequence, samples, checks stops, and
frees finished sequences. Global KV lives in the pool (byte formats); window rings are per
sequence and rebuilt by replay after a prefix hit or a restore (never stored).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from cedlm.cache.block_pool import BlockPool, BlockTable, min_block_tokens
from cedlm.cache.prefix import block_hashes, model_fingerprint
from cedlm.cache.store import Record
from cedlm.engine.request import Request, Status
from cedlm.engine.sampler import Sampler, SamplingParams, StopChecker, make_generator
from cedlm.engine.scheduler import Scheduler
from cedlm.model import PREFILL_MODES, CEDModel
from cedlm.model.state import SequenceState
from cedlm.quant import bytes_per_entry


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
        if self.replay_mode not in ("exact", "bounded"):
            raise ValueError(f"replay_mode: {self.replay_mode!r} is not 'exact' or 'bounded'")


class PoolAllocator:
    """The scheduler's allocator over a BlockPool (prefix lookup at admission)."""

    def __init__(self, engine: "Engine"):
        self.engine, self.pool = engine, engine.pool

    def admit(self, req: Request) -> None:
        req.table = BlockTable(self.pool)
        if not self.engine.cfg.enable_prefix_cache:
            return
        bt = self.pool.block_tokens
        ids = req.all_ids
        hashes = self.engine.hashes(ids)[: (len(ids) - 1) // bt]    # leave >= 1 token to run
        blocks = self.pool.lookup(hashes)
        blocks += self.engine.load_blocks(hashes[len(blocks):])
        req.table.adopt(blocks)
        req.num_cached = req.num_prefix_hit = len(blocks) * bt
        req.num_blocks = len(blocks)

    def reserve(self, req: Request, tokens: int) -> bool:
        need = -(-tokens // self.pool.block_tokens) - len(req.table.blocks)
        if need > self.pool.num_free:
            return False
        req.table.ensure(len(req.table.blocks) + max(need, 0))
        req.num_blocks = len(req.table.blocks)
        return True

    def release(self, req: Request) -> None:
        if req.table is not None:
            self.engine.register_blocks(req)
            req.table.free()
        req.table, req.state, req.prefill_iter, req.num_blocks = None, None, None, 0


class Engine:
    def __init__(self, model: CEDModel, tokenizer=None, config: EngineConfig | None = None, store=None):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.cfg = config or EngineConfig()
        mcfg = model.cfg
        m = min_block_tokens(mcfg)
        self.block_tokens = -(-self.cfg.block_tokens // m) * m
        self.window_bytes = mcfg.n_layers * mcfg.sliding_window * bytes_per_entry(mcfg.window_kv_format, mcfg.head_dim)
        probe = BlockPool(mcfg, 1, self.block_tokens)
        reserve = self.cfg.max_num_seqs * self.window_bytes
        num_blocks = (self.cfg.kv_budget_bytes - reserve) // probe.bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_budget_bytes: {self.cfg.kv_budget_bytes} B cannot hold the windows of "
                f"max_num_seqs={self.cfg.max_num_seqs} sequences ({reserve} B) plus one KV block "
                f"({probe.bytes_per_block} B)")
        self.pool = BlockPool(mcfg, num_blocks, self.block_tokens)
        self.max_model_len = self.cfg.max_model_len or mcfg.max_position_embeddings
        self.scheduler = Scheduler(PoolAllocator(self), num_blocks=num_blocks,
                                   block_tokens=self.block_tokens, max_num_seqs=self.cfg.max_num_seqs,
                                   prefill_chunk=self.cfg.prefill_chunk, max_model_len=self.max_model_len)
        self.sampler = Sampler()
        self.store = store
        self.fingerprint = model_fingerprint(mcfg.to_dict(), model.state_dict())
        self.requests: dict[str, Request] = {}
        self.peak: dict[str, int] = {}           # peak KV bytes in use, by kind
        self._ids = itertools.count()
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "encoder_tokens": 0,
                         "decoder_prefill_tokens": 0, "replay_tokens": 0, "preemptions": 0,
                         "store_block_hits": 0, "requests_finished": 0}

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

    # ---------------------------------------------------------------- prefix cache / store
    def hashes(self, ids: list[int]) -> list[bytes]:
        return block_hashes(ids, self.block_tokens, salt=self.fingerprint)

    def register_blocks(self, req: Request) -> None:
        """Publish the sequence's complete blocks to the prefix cache (and the store)."""
        if not self.cfg.enable_prefix_cache or req.table is None:
            return
        n_full = min(req.num_cached // self.block_tokens, len(req.table.blocks))
        hashes = self.hashes(req.all_ids[: n_full * self.block_tokens])
        for b, h in zip(req.table.blocks, hashes):
            self.pool.register(b, h)
            if self.store is not None and h.hex() not in self._stored:
                self.store.put(h.hex(), Record(meta={"fingerprint": self.fingerprint.hex(),
                                                     "block_tokens": self.block_tokens},
                                               arrays={f"{k}.{s}": t[b] for (k, s), t in self.pool.data.items()}))
                self._stored.add(h.hex())

    @property
    def _stored(self) -> set:
        if not hasattr(self, "_stored_keys"):
            self._stored_keys = set(self.store.keys()) if self.store is not None else set()
        return self._stored_keys

    def load_blocks(self, hashes: list[bytes]) -> list[int]:
        """Continue a prefix hit from the store: each hit is copied into a fresh pool block."""
        out = []
        if self.store is None:
            return out
        for h in hashes:
            if self.pool.num_free <= 0:
                break
            rec = self.store.get(h.hex())
            if rec is None or rec.meta.get("fingerprint") != self.fingerprint.hex():
                break
            arrays = rec.tensors() if hasattr(rec, "tensors") else rec.arrays
            want = {f"{k}.{s}": t.shape[1:] for (k, s), t in self.pool.data.items()}
            if set(arrays) != set(want) or any(tuple(arrays[k].shape) != tuple(v) for k, v in want.items()):
                break
            b = self.pool.allocate()
            for (k, s), t in self.pool.data.items():
                t[b] = torch.as_tensor(arrays[f"{k}.{s}"])
            self.pool.register(b, h)
            out.append(b)
            self.counters["store_block_hits"] += 1
        return out

    # ---------------------------------------------------------------- stepping
    def step(self) -> list[Request]:
        """One scheduling step; returns the requests that finished in it."""
        out = self.scheduler.schedule()
        self.counters["preemptions"] += len(out.preempted)
        finished: list[Request] = []
        if out.decode:
            finished += self._decode(out.decode)
        if out.prefill is not None:
            finished += self._prefill(out.prefill, out.prefill_tokens)
        for r in finished:                        # the caller holds its own reference
            self.requests.pop(r.request_id, None)
        kv = self.kv_stats()
        for k in ("main_kv", "index_keys", "window", "compressor_state"):
            self.peak[k] = max(self.peak.get(k, 0), kv[k])
        return finished

    def _new_state(self, req: Request) -> SequenceState:
        st = SequenceState(self.model.cfg, rows=self.pool.rows(req.table))
        hit = req.num_prefix_hit
        if hit:
            for rows in list(st.kv.values()) + list(st.index.values()):
                rows.set_len(hit // self.model.cfg.compress_ratios[rows.key[1]])
            st.num_tokens, st.token_ids = hit, req.all_ids[:hit]
            self.model.replay(st, self.cfg.replay_mode)     # rebuild windows; entries exist
            self.counters["replay_tokens"] += min(hit, self.model.replay_tokens(self.cfg.replay_mode))
        return st

    def _prefill(self, req: Request, n: int) -> list[Request]:
        if req.prefill_iter is None:
            req.state = self._new_state(req)
            todo = req.all_ids[req.num_cached:]
            m = self.model.decoder_rows(len(todo), self.cfg.prefill_mode)
            self.counters["decoder_prefill_tokens"] += m
            req.prefill_iter = self.model.prefill_steps(todo, req.state, self.cfg.prefill_mode,
                                                        chunk_size=self.cfg.prefill_chunk)
        self.counters["encoder_tokens"] += n
        # num_cached grows only after the chunk ran: a failure mid-chunk never publishes
        # half-written blocks to the prefix cache.
        try:
            next(req.prefill_iter)
            req.num_cached += n
            return []
        except StopIteration as done:
            req.num_cached += n
            logits = done.value[-1:]
        req.prefill_iter = None
        req.status = Status.RUNNING
        self.register_blocks(req)
        return self._accept([req], logits)

    def _decode(self, reqs: list[Request]) -> list[Request]:
        ids = [r.output_ids[-1] for r in reqs]
        logits = self.model.decode(ids, [r.state for r in reqs])
        for r in reqs:
            r.num_cached += 1
        return self._accept(reqs, logits)

    def _accept(self, reqs: list[Request], logits: torch.Tensor) -> list[Request]:
        res = self.sampler.sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        finished = []
        now = time.monotonic()
        for i, r in enumerate(reqs):
            tok = int(res.token_ids[i])
            r.output_ids.append(tok)
            r.output_logprobs.append(float(res.logprobs[i]))
            if res.top_logprobs is not None and res.top_logprobs[i] is not None:
                r.top_logprobs.append(res.top_logprobs[i])
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
    def kv_stats(self) -> dict:
        active = [r for r in self.scheduler.active if r.state is not None]
        pend = sum(a.numel() * 4 + b.numel() * 4 for r in active for a, b in r.state.pending.values())
        used = self.pool.bytes_in_use()
        return {
            "kv_bytes_per_token": self.pool.bytes_per_block / self.block_tokens,
            "pool_bytes": self.pool.nbytes,
            "blocks_total": self.pool.num_blocks,
            "blocks_in_use": self.pool.num_used,
            "main_kv": used["main_kv"],
            "index_keys": used["index_keys"],
            "window": len(active) * self.window_bytes,
            "compressor_state": pend,
            **self.pool.stats,
        }
