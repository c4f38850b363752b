"""The engine: runs the model over what the scheduler plans, samples, checks stops, and says what
each step did (`StepOutput`, engine/output.py).

Per step: the scheduler reserves KV blocks through the KV cache manager, then the engine runs
one batched decode token for the running sequences (or, with a speculator, a verified draft
block) and one encoder chunk of the scheduler's size for each prefilling sequence it picked (a
per-step token budget, shared fairly), samples, checks stops, reports what ran back to the
scheduler (which owns every token count), and finishes requests (the scheduler frees their
blocks through the manager, which publishes full blocks to the prefix cache and the store).
`step()` returns one `StepOutput` per request it touched. The engine's per-sequence objects are
`SequenceRuntime`s held by request id (engine/runtime.py). Window rings are per sequence and
rebuilt by replay after a prefix hit (never stored).

Prompt scoring (`SamplingParams.prompt_logprobs`): such a request is admitted without prefix-cached
blocks and prefilled in mode `full`, so that every prompt row runs the decoder, chunk by chunk;
a `PromptScorer` turns each chunk's rows into the request's `prompt_logprobs` as they run
(memory linear in the prompt). Several samples of one prompt (`n`,
`best_of`; `add_samples`): the first is prefilled, the others then start from a copy of its state
(`_fork`: full blocks shared, the partial block copied, window rings and the drafter's context cloned).

Logits processors that work off the engine thread (a grammar's token masks, server/constrain.py;
the protocol is in `SamplingParams.logits_processors`): after each token the engine tells them the
history they will see next (`prepare`), so that work runs while the model computes the next
logits; before sampling it waits at most `MASK_WAIT_S` for it. A row whose work has not arrived
is held back (its logits kept in the runtime, the model not run for it again) and sampled at the
first step where it has; every other sequence keeps stepping. The processor ends a request
whose work is past its deadline (`sampler.ConstraintTimeout`, a 400 naming the constraint).
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from cedlm.cache.block_pool import BlockTable, NoFreeBlocks
from cedlm.cache.kv_cache_manager import KVCacheManager, blocks_for_budget
from cedlm.cache.prefix import model_fingerprint
from cedlm.engine.args import EngineConfig
from cedlm.engine.images import expand as expand_images, span_embeds as image_span_embeds
from cedlm.engine.loader import model_device
from cedlm.engine.output import RequestTimes, StepOutput
from cedlm.engine.prompt_scoring import PromptScorer
from cedlm.engine.request import Request, Status
from cedlm.engine.runtime import SequenceRuntime
from cedlm.engine.sampler import Sampler, make_generator
from cedlm.engine.sampling_params import SamplingParams
from cedlm.engine.scheduler import Scheduler, StepResult
from cedlm.engine.speculative import DSparkSpeculator, SpeculativeConfig
from cedlm.engine.stop import StopChecker
from cedlm.engine.warmup import BackgroundCompile
from cedlm.model import CEDModel
from cedlm.model.compiled_step import CompiledDecode, adopt, defer, graph_name, scratch_states
from cedlm.model.state import SequenceState

__all__ = ["Engine", "EngineConfig", "EngineSnapshot", "StepOutput"]

log = logging.getLogger(__name__)

MASK_WAIT_S = 0.05      # the most one step waits for logits processors' work before holding rows back


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


class Engine:
    def __init__(self, model: CEDModel, tokenizer=None, config: EngineConfig | None = None, store=None,
                 speculative: SpeculativeConfig | None = None):
        self.model, self.tokenizer = model.eval(), tokenizer
        # where everything the engine builds lives: the model's device (LLM put it there)
        self.device = model_device(model)
        self.cfg = config or EngineConfig()
        layout = model.kv_layout
        self.block_tokens = layout.round_block_tokens(self.cfg.block_tokens)
        num_blocks = blocks_for_budget(layout, self.cfg.kv_budget_bytes, self.cfg.max_num_seqs,
                                       self.block_tokens)
        self.fingerprint = model_fingerprint(model.cfg.to_dict(), model.state_dict())
        self.kv = KVCacheManager(layout, num_blocks, self.block_tokens, fingerprint=self.fingerprint,
                                 enable_prefix_cache=self.cfg.enable_prefix_cache, store=store,
                                 device=self.device)     # the block pool's bytes beside the model
        self.max_model_len = self.cfg.max_model_len or model.cfg.max_position_embeddings
        self.scheduler = Scheduler(self.kv, num_blocks=num_blocks, block_tokens=self.block_tokens,
                                   max_num_seqs=self.cfg.max_num_seqs,
                                   prefill_chunk=self.cfg.prefill_chunk, max_model_len=self.max_model_len,
                                   max_prefills_while_decoding=self.cfg.max_prefills_while_decoding)
        self.sampler = Sampler()
        # One token per sequence: the compiled static step, or the reference (compiled_step.py).
        self.decoder = CompiledDecode.of(model, self.cfg.decode_step, log=log.info)
        # DSpark speculative decoding (engine/speculative.py): None decodes one token per step;
        # its verify step runs in the decode step's mode
        self.speculator = (DSparkSpeculator(model, speculative, self.decoder, log=log.info)
                           if speculative is not None else None)
        self._background: BackgroundCompile | None = None     # graphs compiling off the serving path
        self._scratch_tables: list = []            # its scratch sequences' blocks (this engine's pool)
        self.requests: dict[str, Request] = {}
        self.runs: dict[str, SequenceRuntime] = {}   # request id -> the engine's objects for it
        self.peak: dict[str, int] = {}           # peak KV bytes in use, by kind
        self._ids = itertools.count()
        self._touched: dict[str, Request] = {}    # requests this step touched, in order
        self._result = StepResult()               # what this step ran, for the scheduler
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "encoder_tokens": 0,
                         "decoder_prefill_tokens": 0, "replay_tokens": 0, "preemptions": 0,
                         "requests_finished": 0, "requests_failed": 0}

    @property
    def pool(self):
        return self.kv.pool

    def warm_up(self, batch_sizes: tuple[int, ...] = (1, 2)) -> dict[str, float]:
        """Compile the decode step's graphs before the first request (`CompiledDecode.warm_up`)
        on scratch sequences in this engine's own block pool, whose blocks are freed after;
        {graph: seconds}. A compile already running in the background (`compile_in_background`)
        is waited for and adopted instead. Nothing to do (or no free block) -> {}."""
        pending = self.decoder.pending
        if pending is not None:
            pending[0].wait()
            self._adopt_compiled()
            return {} if pending[0].failed else dict(pending[0].seconds)
        tables: list[BlockTable] = []
        rows = self._scratch_rows(tables)
        try:
            got = self.decoder.warm_up(batch_sizes, rows)
            if self.speculator is not None:
                got.update({f"verify {g}": sec for g, sec in
                            self.speculator.step.warm_up(batch_sizes, rows).items()})
                got.update({f"draft {g}": sec for g, sec in
                            self.speculator.drafter.warm_up(batch_sizes).items()})
            return got
        except NoFreeBlocks:
            return {}
        finally:
            for t in tables:
                t.free()

    def _scratch_rows(self, tables: list):
        """A rows factory for scratch sequences in this engine's block pool (compiling on them);
        each new table goes into `tables`, which the caller frees."""
        def rows():
            tables.append(BlockTable(self.pool))
            return self.pool.rows(tables[-1])
        return rows

    def compile_in_background(self, batch_sizes: tuple[int, ...] = (1, 2)) -> BackgroundCompile | None:
        """Build the compiled graphs (`warm_up`'s) in a background thread while the engine steps
        on the same step uncompiled; the first step boundary after they are all built adopts
        them (`warmup.py`), in this engine or any other sharing the model's step objects. Call it
        before the engine's first step, from the thread that steps it: the scratch sequences are
        prefilled here, from this engine's block pool, and freed when this engine adopts. None
        when nothing compiles (another mode, or the reference path is required); the running
        one when a compile of these step objects is under way."""
        dec = self.decoder
        pending = dec.pending
        if pending is not None:
            return pending[0]                              # started already (by any engine)
        if not dec.compile or dec.why_not() is not None:
            return None
        tables: list[BlockTable] = []
        rows = self._scratch_rows(tables)
        spec = self.speculator
        with_spec = spec is not None and spec.step.compile and spec.step.usable
        try:
            scratch = {B: scratch_states(self.model, B, rows) for B in batch_sizes}
            scratch_v = {B: scratch_states(self.model, B, rows) for B in batch_sizes} if with_spec else {}
        except NoFreeBlocks:
            for t in tables:
                t.free()
            return None
        pairs = [(dec, defer(dec))]
        if with_spec:
            pairs += [(spec.step, defer(spec.step)), (spec.drafter, defer(spec.drafter))]
            pairs[1][1].decoder = pairs[0][1]     # the verify shadow builds its inputs as compiled
        shadow = [sh for _, sh in pairs]

        def built(sh, what):
            if not sh.compile:                    # the shadow gave up and ran uncompiled
                raise RuntimeError(f"{what}: torch.compile failed (logged above)")
        jobs = [(f"decode graph for batch {graph_name(B, False)}",
                 lambda st=st, b=B: (shadow[0].forward(torch.arange(b), st, paged=True),
                                     built(shadow[0], "decode step")))
                for B, st in scratch.items()]
        if with_spec:
            T = spec.step.T
            jobs += [(f"verify graph for batch {graph_name(B, False)}",
                      lambda st=st, b=B: (shadow[1](torch.arange(b * T).view(b, T) % 7, st),
                                          built(shadow[1], "verify step")))
                     for B, st in scratch_v.items()]
            jobs += [(f"draft graph for batch {graph_name(B, False)}",
                      lambda b=B: (shadow[2].warm_up((b,)), built(shadow[2], "draft step")))
                     for B in batch_sizes]
        key = f"{self.fingerprint[:12]} threads={torch.get_num_threads()}"
        bg = BackgroundCompile(jobs, key=key, log_line=log.info)
        dec.pending = (bg, pairs)                 # on the shared step object: any engine adopts
        self._background, self._scratch_tables = bg, tables
        return bg.start()

    def _adopt_compiled(self) -> None:
        """At a step boundary: once the background compile is done, switch the step objects to
        its graphs (once, by whichever engine steps first) and free this engine's scratch
        blocks."""
        pending = self.decoder.pending
        if pending is not None and pending[0].done:
            self.decoder.pending = None
            adopted = [adopt(step, sh) for step, sh in pending[1]]
            if adopted[0]:
                log.info("decode step: now running the compiled graphs")
        bg = self._background
        if bg is not None and bg.done and self._scratch_tables:
            for t in self._scratch_tables:
                t.free()
            self._scratch_tables = []
            bg.jobs = []                           # the scratch states and shadows go with them

    def compile_status(self) -> dict:
        """Which decode step runs now and what is compiling (for /health and /v1/models)."""
        pending = self.decoder.pending
        bg = pending[0] if pending is not None else self._background
        return {"decode_step": self.decoder.active_mode,
                "compiling": None if bg is None else bg.status()}

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
                    request_id: str | None = None, images=None, owner: str | None = None) -> list[Request]:
        """The `params.num_samples` (best_of, else n) samples of one prompt, one Request each:
        ids `request_id` for a single sample, else `{request_id}-{i}`; all carry `group_id =
        request_id` and `sample_index = i`, and sample i runs under `params.for_sample(i)` (seed +
        i). Only sample 0 is queued; the others wait on it and, when its prefill completes, start
        from a copy of its state (the full prompt blocks shared, the last partial block copied):
        the prompt is prefilled once and every sample's first token is drawn from the same
        logits. A sample that cannot start then (no free sequence slot or block) is queued at the
        front and prefills on its own (prefix-cache hit when the cache is on). Pick the returned
        ones with `request.select_samples(samples, params.n)` once all finished; abort a group by
        aborting every sample's id. `images` (vision models): one per image placeholder in the
        prompt, in order (`cedlm.engine.images.expand`). `owner`: the caller's request these
        samples belong to (several prompts of one server request share one), whose sequences
        run at most `Scheduler.max_seqs_per_owner` at once (None: not capped)."""
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
        reqs = [Request(gid if k == 1 else f"{gid}-{i}", list(ids), params.for_sample(i), group_id=gid,
                        sample_index=i, images=req_images, owner=owner) for i in range(k)]
        for r in reqs:
            self.scheduler.check(r)
        self.scheduler.add(reqs[0])
        eos = None if self.tokenizer is None else self.tokenizer.eos_id
        for r in reqs:
            self.requests[r.request_id] = r
            self.runs[r.request_id] = SequenceRuntime(
                StopChecker(r.params, eos_token_id=eos), make_generator(r.params.seed, self.device),
                self.tokenizer.stream(skip_special=r.params.skip_special_tokens) if self.tokenizer is not None else None)
        self.runs[reqs[0].request_id].forks = reqs[1:]
        self.counters["prompt_tokens"] += len(ids)
        return reqs

    def abort(self, request_id: str) -> None:
        """Stop a request and forget it (its KV freed; finish_reason "abort")."""
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self.scheduler.requeue(self._release_forks(req))
            self.scheduler.abort(req)
            req.finish_reason = "abort"
            self.runs[request_id].finish_time = time.monotonic()
        self.requests.pop(request_id, None)
        self.runs.pop(request_id, None)
        self._touched.pop(request_id, None)

    def _release_forks(self, req: Request) -> list[Request]:
        """Samples waiting on req's prefill that will not get it (they run on their own: the
        caller queues them)."""
        run = self.runs[req.request_id]
        forks, run.forks = [r for r in run.forks if not r.finished], []
        for r in forks:
            r.prompt_logprobs = r.prompt_logprobs or req.prompt_logprobs
        return forks

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ---------------------------------------------------------------- stepping
    def step(self) -> list[StepOutput]:
        """One scheduling step; one StepOutput per request it touched (admitted, ran, finished).
        Requests that finished are forgotten (the caller holds its own reference)."""
        if self.decoder.pending is not None or self._scratch_tables:
            self._adopt_compiled()           # graphs built in the background (by any engine)
        t_step = time.perf_counter()
        out = self.scheduler.schedule()
        self._result = result = StepResult()
        self.counters["preemptions"] += len(out.preempted)
        for r in out.preempted:                   # their KV is gone: recomputed when readmitted
            self.runs[r.request_id].reset()
        self._touched = {r.request_id: r for r in out.admitted}
        if out.decode:
            self._contained(out.decode, lambda: self._decode(out.decode))
        for req, n in out.prefills:               # one encoder chunk each (scheduler.py: fair share)
            self._contained([req], lambda r=req, k=n: self._prefill(r, k))
        self.scheduler.update_from_output(out, result)
        outputs = [self._output(r) for r in self._touched.values()]
        self._touched = {}
        for o in outputs:
            if o.finished:
                self.requests.pop(o.request_id, None)
                self.runs.pop(o.request_id, None)
        kv = self.kv_stats()
        for k in ("main_kv", "index_keys", "window", "compressor_state"):
            self.peak[k] = max(self.peak.get(k, 0), kv[k])
        if self.speculator is not None:           # the step's cost besides decoding, for the policy
            self.speculator.end_step(len(out.decode), time.perf_counter() - t_step, counted=not out.prefills)
        return outputs

    def _touch(self, r: Request) -> SequenceRuntime:
        self._touched.setdefault(r.request_id, r)
        return self.runs[r.request_id]

    def _output(self, r: Request) -> StepOutput:
        """What this step did to r, as plain values; the runtime's step buffers are emptied."""
        run = self.runs[r.request_id]
        plps = None
        if r.prompt_logprobs is not None and not run.prompt_logprobs_sent:
            plps, run.prompt_logprobs_sent = tuple(r.prompt_logprobs), True
        o = StepOutput(
            r.request_id, r.group_id or r.request_id, r.sample_index, tuple(run.new_ids),
            tuple(run.new_logprobs), tuple(run.new_top) if r.params.logprobs else None, run.new_text,
            r.finish_reason, run.stop.stop_reason,
            r.error, plps, len(r.prompt_ids), r.num_cached_tokens, len(r.output_ids), r.num_preemptions,
            RequestTimes(r.arrival, r.first_scheduled_time, run.first_token_time, run.finish_time))
        run.clear_step()
        return o

    def _contained(self, reqs: list[Request], run) -> None:
        """Run one batch; an exception fails the requests of that batch alone (finish_reason
        "error", their KV freed) and the engine goes on with everyone else."""
        try:
            run()
        except Exception as e:                  # noqa: BLE001 - contained to this batch
            log.exception("engine step failed for %s", [r.request_id for r in reqs])
            for r in reqs:
                if not r.finished:
                    self._fail(r, f"{type(e).__name__}: {e}")

    def _fail(self, r: Request, error: str) -> None:
        self._result.requeue.extend(self._release_forks(r))
        self._finish(r, "error", error)
        self.counters["requests_failed"] += 1

    def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
        run = self._touch(r)
        r.finish_reason, r.error, run.finish_time = reason, error, time.monotonic()
        self._result.finish(r)                    # the scheduler frees it at the step's end
        run.reset()

    def _new_state(self, req: Request, run: SequenceRuntime) -> SequenceState:
        st = run.state = self.model.new_state(rows=self.kv.rows(req))
        if req.images:
            st.images = image_span_embeds(self.model, req.images)
        hit = req.num_cached_tokens
        if hit:
            st.adopt_prefix(req.all_ids[:hit])            # entries are in the adopted blocks
            if self.speculator is None:
                self.model.replay(st, self.cfg.replay_mode)   # rebuild the windows
            else:                                         # ... and the drafter's context rows
                self.speculator.replay(run, self.cfg.replay_mode)
            self.counters["replay_tokens"] += min(hit, self.model.replay_tokens(self.cfg.replay_mode))
        return st

    def _prefill(self, req: Request, n: int) -> None:
        """One encoder chunk of n tokens (the scheduler's chunk) of req's prompt; after the last,
        the first token (and the group's other samples start from this prefill)."""
        run = self._touch(req)
        if run.prefill is None:
            self._new_state(req, run)
            todo = req.all_ids[req.num_computed_tokens:]
            # prompt scoring: every prompt row runs the decoder (the scheduler gave it no
            # prefix-cached blocks, so todo is the whole prompt)
            # prompt scoring: the decoder runs chunk by chunk and each chunk's logits are scored
            # as it goes (memory linear in the prompt, prompt_scoring.PromptScorer)
            mode = "full" if req.needs_prompt_logprobs else self.cfg.prefill_mode
            self.counters["decoder_prefill_tokens"] += self.model.decoder_rows(len(todo), mode)
            run.scorer = (PromptScorer(req.prompt_ids, req.params.prompt_logprobs)
                          if req.needs_prompt_logprobs else None)
            run.prefill = self.model.start_prefill(todo, run.state, mode, chunk_size=self.cfg.prefill_chunk,
                                                   on_rows=run.scorer.add if run.scorer else None)
        self.counters["encoder_tokens"] += n
        # the count grows only after the chunk ran: a failure mid-chunk never publishes
        # half-written blocks to the prefix cache.
        done = run.prefill.step(n) if self.speculator is None else self.speculator.prefill_step(run, n)
        self._result.computed.append((req, n))
        if not done:
            return
        if req.needs_prompt_logprobs:
            req.prompt_logprobs, run.scorer = run.scorer.result(), None
        logits = run.prefill.logits[-1:]
        run.prefill = None
        self._result.prefilled.append(req)
        group = [req] + self._start_forks(req)
        if req.params.max_tokens == 0:             # scoring only: nothing is sampled
            for r in group:
                self._finish(r, "length")
                self.counters["requests_finished"] += 1
            return
        # the first token's mask was started when its processor was built (long before): one
        # that is not there yet is held back without a wait while other sequences decode (each
        # prefill's wait would otherwise add MASK_WAIT_S to their step)
        others = any(r.status is Status.RUNNING and all(r is not g for g in group)
                     for r in self.scheduler.active)
        self._accept(group, logits.expand(len(group), -1), 0.0 if others else None)

    # ---------------------------------------------------------------- samples of one prompt
    def _start_forks(self, req: Request) -> list[Request]:
        """Start req's waiting samples from a copy of its just-prefilled state; those that cannot
        start now are queued to prefill on their own."""
        src = self.runs[req.request_id]
        started, rest = [], []
        forks, src.forks = src.forks, []
        for sib in forks:
            if sib.finished:
                continue
            sib.prompt_logprobs = sib.prompt_logprobs or req.prompt_logprobs
            (started if self._fork(req, sib) else rest).append(sib)
        self._result.requeue.extend(rest)
        return started

    def _fork(self, src: Request, dst: Request) -> bool:
        """dst (same token ids as src, nothing computed) takes src's prefilled KV (the scheduler
        shares the full blocks and copies the partial one); its state adopts src's prefix and
        clones the window rings and compressor rows. False (nothing taken) when there is no free
        sequence slot or block."""
        P = src.num_tokens                        # its whole prompt: the prefill just completed
        if not self.scheduler.fork(src, dst, P):
            return False
        st = self.model.new_state(rows=self.kv.rows(dst))
        st.adopt_prefix(self.runs[src.request_id].state.token_ids[:P])
        st.copy_windows_from(self.runs[src.request_id].state)
        run = self._touch(dst)
        run.state = st
        src_draft = self.runs[src.request_id].draft      # the drafter's context rows, the same
        run.draft = None if src_draft is None else src_draft.clone()
        return True

    # ---------------------------------------------------------------- decoding
    def _decode(self, reqs: list[Request]) -> None:
        """One token for each running sequence, or a verified draft block for those that may
        speculate when the speculator's policy says it pays this step (engine/spec_policy.py);
        each kind of step is timed for the policy."""
        held = [r for r in reqs if self.runs[r.request_id].held is not None]
        if held:                                  # sampled from their kept logits, not run again
            reqs = [r for r in reqs if self.runs[r.request_id].held is None]
            self._release_held(held, wait=0.0 if reqs else MASK_WAIT_S)
            if not reqs:
                return
        sp = self.speculator
        spec = [r for r in reqs if sp.speculates(r.params)] if sp is not None else []
        if spec and not sp.decide(len(spec), len(reqs) - len(spec),
                                  [self.runs[r.request_id] for r in spec]):
            spec = []
        plain = [r for r in reqs if not any(r is s for s in spec)]
        if plain:
            t0 = time.perf_counter()
            self._decode_plain(plain)
            if sp is not None:
                sp.observe("plain", len(plain), time.perf_counter() - t0)
        if spec:
            t0 = time.perf_counter()
            self._decode_speculative(spec)
            sp.observe("spec", len(spec), time.perf_counter() - t0)

    def _decode_plain(self, reqs: list[Request]) -> None:
        ids = [r.output_ids[-1] for r in reqs]
        logits = self.decoder(ids, [self._touch(r).state for r in reqs])
        self._result.computed.extend((r, 1) for r in reqs)
        self._accept(reqs, logits)

    def _decode_speculative(self, reqs: list[Request]) -> None:
        """Propose draft blocks, reserve their lookahead slots through the scheduler (none kept
        when the pool cannot: then one plain token each), verify, advance the counts (the
        scheduler releases the slots not kept), emit the kept tokens one by one."""
        runs = [self._touch(r) for r in reqs]
        left = [min(r.params.max_tokens - len(r.output_ids) if r.params.max_tokens is not None else 1 << 30,
                    self.max_model_len - r.num_tokens) for r in reqs]
        prop = self.speculator.propose(reqs, runs, left)
        if not self.scheduler.reserve_lookahead(reqs, prop.num_lookahead):
            prop = prop.without_drafts()
        kept = self.speculator.verify(prop, reqs, runs)
        self._result.computed.extend((r, len(toks)) for r, toks in zip(reqs, kept))
        now = time.monotonic()
        for r, toks in zip(reqs, kept):
            for tok, lp in toks:
                self.speculator.note_emitted()
                if self._emit(r, tok, lp, None, now):
                    break

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list:
        """Sample the batch; if that fails, sample row by row so that only the request whose
        row fails gets the exception (in place of its sample)."""
        # prompt / generated ids, for the penalties and logits processors of the rows using them
        hist = ([(r.prompt_ids, r.output_ids) for r in reqs]
                if any(r.params.processes_logits for r in reqs) else None)
        gens = [self.runs[r.request_id].generator for r in reqs]
        kw = {} if hist is None else {"histories": hist}
        try:
            res = self.sampler.sample(logits, [r.params for r in reqs], gens, **kw)
            return [(res.token_ids[i], res.logprobs[i], res.top_logprobs[i] if res.top_logprobs else None)
                    for i in range(len(reqs))]
        except Exception:                       # noqa: BLE001 - find the request it belongs to
            out = []
            for i, r in enumerate(reqs):
                try:
                    res = self.sampler.sample(logits[i:i + 1], [r.params], [gens[i]],
                                              **({} if hist is None else {"histories": hist[i:i + 1]}))
                    out.append((res.token_ids[0], res.logprobs[0],
                                res.top_logprobs[0] if res.top_logprobs else None))
                except Exception as e:          # noqa: BLE001
                    out.append(e)
            return out

    def _release_held(self, held: list[Request], wait: float) -> None:
        """Sample the held rows whose processors' work has arrived (waiting at most `wait`
        seconds); the others stay held."""
        logits = torch.stack([self.runs[r.request_id].held for r in held])
        for r in held:
            self.runs[r.request_id].held = None
        self._accept(held, logits, wait)

    def _hold_back(self, reqs: list[Request], logits: torch.Tensor, wait: float):
        """The rows ready to sample (and their logits): a row whose logits processors' work has
        not arrived within `wait` seconds (all rows together) keeps its logits in its runtime;
        one whose processor raised (past its deadline) fails alone."""
        deadline = time.monotonic() + wait
        keep = []
        for i, r in enumerate(reqs):
            waits = [fn.wait for fn in r.params.logits_processors or () if hasattr(fn, "wait")]
            try:
                ready = all(w(r.output_ids, max(0.0, deadline - time.monotonic())) for w in waits)
            except Exception as e:              # noqa: BLE001 - that request alone
                log.info("request %s: %s", r.request_id, e)
                self._fail(r, f"{type(e).__name__}: {e}")
                continue
            if ready:
                keep.append(i)
            else:
                self.runs[r.request_id].held = logits[i].detach().clone()
        if len(keep) == len(reqs):
            return reqs, logits
        return [reqs[i] for i in keep], logits[keep]

    def _prepare(self, r: Request) -> None:
        """Tell r's processors the history of its next sample (they start its work now)."""
        for fn in r.params.logits_processors or ():
            prep = getattr(fn, "prepare", None)
            if prep is not None:
                prep(r.output_ids)

    def _accept(self, reqs: list[Request], logits: torch.Tensor, wait: float | None = None) -> None:
        if any(r.params.logits_processors for r in reqs):
            reqs, logits = self._hold_back(reqs, logits, MASK_WAIT_S if wait is None else wait)
            if not reqs:
                return
        samples = self._sample(reqs, logits)
        now = time.monotonic()
        for r, sample in zip(reqs, samples):
            if isinstance(sample, Exception):
                log.error("sampling failed for %s: %r", r.request_id, sample)
                self._fail(r, f"{type(sample).__name__}: {sample}")
                continue
            tok_t, lp, top = sample
            if top is not None:                 # (ids, logprobs) as plain values, built once
                top = (tuple(int(i) for i in top[0].tolist()), tuple(float(v) for v in top[1].tolist()))
            self._emit(r, int(tok_t), float(lp), top, now)

    def _emit(self, r: Request, tok: int, lp: float, top, now: float) -> bool:
        """Append one sampled token to r, check its stops; True when r finished (then
        finished with the scheduler)."""
        run = self._touch(r)
        r.output_ids.append(tok)
        r.cumulative_logprob += lp
        run.new_ids.append(tok)
        run.new_logprobs.append(lp)
        if top is not None:
            run.new_top.append(top)
        run.first_token_time = run.first_token_time or now
        self.counters["generation_tokens"] += 1
        delta = run.detok.push(tok) if run.detok is not None else ""
        st = run.stop.update_delta(tok, delta)
        run.new_text += st.text
        if not st.finished and r.num_tokens >= self.max_model_len:
            st = run.stop.finish("length")
            run.new_text += st.text
        if st.finished:
            self._finish(r, st.reason)
            self.counters["requests_finished"] += 1
            return True
        if r.params.logits_processors:
            self._prepare(r)
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
            c.update(self.speculator.policy.as_dict())
        return c

    def kv_stats(self) -> dict:
        states = [run.state for run in (self.runs.get(r.request_id) for r in self.scheduler.active)
                  if run is not None and run.state is not None]
        used = self.pool.bytes_in_use()
        # the background compile's scratch sequences hold a few blocks of this pool until its
        # graphs are adopted: counted apart, so that "in use" is what requests hold
        scratch = sum(len(t.blocks) for t in self._scratch_tables)
        return {
            "kv_bytes_per_token": float(self.model.kv_layout.bytes_per_token),
            "pool_bytes": self.pool.nbytes,
            "blocks_total": self.pool.num_blocks,
            "blocks_in_use": self.pool.num_used - scratch,
            "blocks_compiling": scratch,
            "main_kv": used["main_kv"],
            "index_keys": used["index_keys"],
            "window": len(states) * self.model.kv_layout.window_bytes_per_sequence,
            "compressor_state": sum(st.pending_bytes() for st in states),
            **self.pool.stats,
            **self.kv.stats,
        }
