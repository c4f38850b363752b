"""The engine: runs the model over what the scheduler plans, samples, and checks stops.

Per step: the scheduler reserves KV blocks through the KV cache manager, then the engine runs
one batched decode token for the running sequences and one encoder chunk for each prefilling
sequence the scheduler picked (a per-step token budget, shared fairly), samples, checks stops,
and finishes requests (the scheduler frees their blocks through the manager, which publishes
full blocks to the prefix cache and the store). Window rings are per sequence and rebuilt by
replay after a prefix hit (never stored).

Prompt scoring (`SamplingParams.prompt_logprobs`): such a request is admitted without prefix-cached
blocks and prefilled in mode `full`, so that every prompt row runs the decoder; `prompt_logprobs`
turns those rows into the request's `prompt_logprobs`. Several samples of one prompt (`n`,
`best_of`; `add_samples`): the first is prefilled, the others then start from a copy of its state
(`_fork`: full blocks shared, the partial block copied, window rings cloned).
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from cedlm.cache.kv_cache_manager import KVCacheManager, blocks_for_budget
from cedlm.cache.prefix import model_fingerprint
from cedlm.engine.images import expand as expand_images, span_embeds as image_span_embeds
from cedlm.engine.request import Request, Status, TokenLogprob
from cedlm.engine.sampler import Sampler, make_generator
from cedlm.engine.sampling_params import SamplingParams
from cedlm.engine.stop import StopChecker
from cedlm.engine.scheduler import Scheduler
from cedlm.engine.speculative import DSparkSpeculator, SpeculativeConfig
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
    def __init__(self, model: CEDModel, tokenizer=None, config: EngineConfig | None = None, store=None,
                 speculative: SpeculativeConfig | None = None):
        self.model, self.tokenizer = model.eval(), tokenizer
        # DSpark speculative decoding (engine/speculative.py): None decodes one token per step.
        self.speculator = DSparkSpeculator(model, speculative) if speculative is not None else None
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
                    request_id: str | None = None, images=None) -> Request:
        """One request of one sample; a request for several (n / best_of > 1) goes through
        `add_samples`."""
        params = params or SamplingParams()
        if params.num_samples > 1:
            raise ValueError(f"n: a request for {params.num_samples} samples (n / best_of) has one "
                             f"Request per sample: use Engine.add_samples")
        return self.add_samples(prompt_ids, params, request_id, images)[0]

    def add_samples(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, images=None) -> list[Request]:
        """The `params.num_samples` (best_of, else n) samples of one prompt, one Request each:
        ids `request_id` for a single sample, else `{request_id}-{i}`; all carry `group_id =
        request_id` and `sample_index = i`, and sample i runs under `params.for_sample(i)` (seed +
        i). Only sample 0 is queued; the others wait in its `forks` and, when its prefill
        completes, start from a copy of its state (the full prompt blocks shared, the last partial
        block copied): the prompt is prefilled once and every sample's first token is drawn from
        the same logits. A sample that cannot start then (no free sequence slot or block) is
        queued at the front and prefills on its own (prefix-cache hit when the cache is on). Pick
        the returned ones with `request.select_samples(samples, params.n)` once all finished;
        abort a group by aborting every sample's id. `images` (vision models): one per image
        placeholder in the prompt, in order (`cedlm.engine.images.expand`)."""
        params = params or SamplingParams()
        req_images = []
        if images:
            prompt_ids, req_images = expand_images(self.model, prompt_ids, images)
        V = self.model.cfg.vocab_size
        bad = [t for t in prompt_ids if not 0 <= int(t) < V]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {V})")
        params.token_ids_in_vocab(V)
        ids = [int(t) for t in prompt_ids]
        gid = request_id or f"req-{next(self._ids)}"
        k = params.num_samples
        reqs = [self._make_request(gid if k == 1 else f"{gid}-{i}", ids, params.for_sample(i), gid, i)
                for i in range(k)]
        for r in reqs:
            r.images = req_images
            self.scheduler.check(r)
        self.scheduler.add(reqs[0])
        reqs[0].forks = reqs[1:]
        for r in reqs:
            self.requests[r.request_id] = r
        self.counters["prompt_tokens"] += len(ids)
        return reqs

    def _make_request(self, rid: str, ids: list[int], params: SamplingParams, gid: str, i: int) -> Request:
        req = Request(rid, list(ids), params, group_id=gid, sample_index=i)
        eos = None if self.tokenizer is None else self.tokenizer.eos_id
        req.stop = StopChecker(params, eos_token_id=eos)
        req.generator = make_generator(params.seed)
        req.detok = self.tokenizer.stream() if self.tokenizer is not None else None
        return req

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self._release_forks(req)
            self.scheduler.abort(req)
            req.finish_reason = "abort"
            req.finish_time = time.monotonic()
        self.requests.pop(request_id, None)

    def _release_forks(self, req: Request) -> None:
        """Samples waiting on req's prefill that will not get it: they run on their own."""
        forks, req.forks = [r for r in req.forks if not r.finished], []
        for r in forks:
            r.prompt_logprobs = r.prompt_logprobs or req.prompt_logprobs
        self.scheduler.requeue(forks)

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
        for req, n in out.prefills:               # one encoder chunk each (scheduler.py: fair share)
            finished += self._contained([req], lambda r=req, k=n: self._prefill(r, k))
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
                self._release_forks(r)
                self.scheduler.finish(r)
                self.counters["requests_failed"] += 1
                failed.append(r)
            return failed

    def _new_state(self, req: Request) -> SequenceState:
        st = self.model.new_state(rows=self.kv.rows(req))
        if req.images:
            st.images = image_span_embeds(self.model, req.images)
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
            # prompt scoring: every prompt row runs the decoder (the scheduler gave it no
            # prefix-cached blocks, so todo is the whole prompt)
            mode = "full" if req.needs_prompt_logprobs else self.cfg.prefill_mode
            self.counters["decoder_prefill_tokens"] += self.model.decoder_rows(len(todo), mode)
            req.prefill = self.model.start_prefill(todo, req.state, mode, chunk_size=self.cfg.prefill_chunk)
        self.counters["encoder_tokens"] += n
        # num_cached grows only after the chunk ran: a failure mid-chunk never publishes
        # half-written blocks to the prefix cache.
        done = req.prefill.step() if self.speculator is None else self.speculator.prefill_step(req)
        req.num_cached += n
        if not done:
            return []
        if req.needs_prompt_logprobs:
            req.prompt_logprobs = prompt_logprobs(req.prefill.logits, req.prompt_ids,
                                                  req.params.prompt_logprobs)
        logits = req.prefill.logits[-1:]
        req.prefill = None
        req.status = Status.RUNNING
        self.kv.cache_full_blocks(req)
        group = [req] + self._start_forks(req)
        if req.params.max_tokens == 0:             # scoring only: nothing is sampled
            return self._finish_unsampled(group)
        return self._accept(group, logits.expand(len(group), -1))

    def _finish_unsampled(self, reqs: list[Request]) -> list[Request]:
        now = time.monotonic()
        for r in reqs:
            r.finish_reason, r.finish_time = "length", now
            self.scheduler.finish(r)
            self.counters["requests_finished"] += 1
        return reqs

    # ---------------------------------------------------------------- samples of one prompt
    def _start_forks(self, req: Request) -> list[Request]:
        """Start req's waiting samples from a copy of its just-prefilled state; those that cannot
        start now are queued to prefill on their own."""
        started, rest = [], []
        forks, req.forks = req.forks, []
        for sib in forks:
            if sib.finished:
                continue
            sib.prompt_logprobs = sib.prompt_logprobs or req.prompt_logprobs
            (started if self._fork(req, sib) else rest).append(sib)
        self.scheduler.requeue(rest)
        return started

    def _fork(self, src: Request, dst: Request) -> bool:
        """dst (same token ids as src, nothing computed) takes src's prefilled KV: src's full
        blocks are shared (ref counted, read-only from here on: later rows go to later blocks),
        the partial last block is copied, the window rings and compressor rows are cloned.
        False (nothing taken) when there is no free sequence slot or block."""
        P = src.num_cached
        if not self.scheduler.has_free_slot or not self.kv.fork(src, dst, P):
            return False
        dst.num_cached, dst.num_prefix_hit = P, 0
        st = self.model.new_state(rows=self.kv.rows(dst))
        st.adopt_prefix(src.state.token_ids[:P])
        st.copy_windows_from(src.state)
        dst.state = st
        self.scheduler.start_running(dst)
        return True

    def _decode(self, reqs: list[Request]) -> list[Request]:
        if self.speculator is not None:
            return self.speculator.step(self, reqs)
        return self._decode_plain(reqs)

    def _decode_plain(self, reqs: list[Request]) -> list[Request]:
        ids = [r.output_ids[-1] for r in reqs]
        logits = self.model.decode(ids, [r.state for r in reqs])
        for r in reqs:
            r.num_cached += 1
        return self._accept(reqs, logits)

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list:
        """Sample the batch; if that fails, sample row by row so that only the request whose
        row fails gets the exception (in place of its sample)."""
        # prompt / generated ids, for the penalties and logits processors of the rows using them
        hist = ([(r.prompt_ids, r.output_ids) for r in reqs]
                if any(r.params.processes_logits for r in reqs) else None)
        kw = {} if hist is None else {"histories": hist}
        try:
            res = self.sampler.sample(logits, [r.params for r in reqs], [r.generator for r in reqs], **kw)
            return [(res.token_ids[i], res.logprobs[i], res.top_logprobs[i] if res.top_logprobs else None)
                    for i in range(len(reqs))]
        except Exception:                       # noqa: BLE001 - find the request it belongs to
            out = []
            for i, r in enumerate(reqs):
                try:
                    res = self.sampler.sample(logits[i:i + 1], [r.params], [r.generator],
                                              **({} if hist is None else {"histories": hist[i:i + 1]}))
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
            if self._emit(r, int(tok_t), float(lp), top, now):
                finished.append(r)
        return finished

    def _emit(self, r: Request, tok: int, lp: float, top, now: float) -> bool:
        """Append one sampled token to r, check its stops; True when r finished (then
        finished with the scheduler)."""
        r.output_ids.append(tok)
        r.output_logprobs.append(lp)
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
            return True
        return False

    # ---------------------------------------------------------------- stats
    def snapshot(self) -> EngineSnapshot:
        s = self.scheduler
        return EngineSnapshot(num_running=len(s.active), num_waiting=len(s.waiting),
                              max_num_seqs=s.max_num_seqs, pool_tokens=s.num_blocks * s.block_tokens,
                              kv=self.kv_stats(), peak=dict(self.peak), counters=self.all_counters())

    def all_counters(self) -> dict:
        """The engine's counters, with the speculative ones (`spec_*`) when it speculates."""
        c = dict(self.counters)
        if self.speculator is not None:
            c.update(self.speculator.stats.as_dict())
        return c

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


@torch.no_grad()
def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], k: int) -> list[TokenLogprob | None]:
    """Scored prompt from the prefill logits of every prompt row ([P, vocab]; row j predicts
    token j + 1): entry 0 None, entry j the raw logprob, rank and top-k of prompt_ids[j]."""
    P = len(prompt_ids)
    if logits.shape[0] != P:
        raise RuntimeError(f"prompt_logprobs: {logits.shape[0]} scored rows for a {P}-token prompt")
    out: list[TokenLogprob | None] = [None]
    if P < 2:
        return out
    lp = torch.log_softmax(logits[:-1].float(), dim=-1)                       # [P-1, V]
    tgt = torch.tensor(prompt_ids[1:], dtype=torch.long, device=lp.device)
    act = lp.gather(1, tgt[:, None])                                           # [P-1, 1]
    ranks = ((lp > act).sum(-1) + 1).tolist()
    k = min(k, lp.shape[-1])
    tv, ti = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    tv, ti, act = tv.tolist(), ti.tolist(), act[:, 0].tolist()
    for j in range(P - 1):
        out.append(TokenLogprob(prompt_ids[j + 1], act[j], ranks[j], ti[j], tv[j]))
    return out
