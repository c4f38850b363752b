"""Continuous batching over integers: admission by KV budget, fair chunked prefill, preemption.

Each engine step runs (a) one decode token for every running sequence and (b) encoder chunks of
prefilling sequences, each chunk `min(prefill_chunk, tokens left)` tokens (the chunk size goes
into the engine's `PrefillRun.step(n)`). The step's token budget, `max_batched_tokens`
(default `prefill_chunk + max_num_seqs`), goes to the decodes first (one token each); prefill
chunks share the rest, at least one chunk per step whatever the decodes took:

- admission goes on while prefills are in progress: every step, waiting requests are admitted
  in arrival order while a sequence slot is free and the pool can hold the whole sequence so
  far (prompt, plus the outputs of a preempted one). Reserving all of it at admission means a
  prefill chunk never waits on memory, so several prefills in flight can never deadlock on
  each other's partial reservations; a head of the queue that does not fit stops admission
  (first come, first served: a large request is never passed over for ever).
- fair share: the sequences of one owner (`Request.owner`, the server's HTTP request: its
  prompts x n samples) run at most `max_seqs_per_owner` at a time (default half the slots);
  its other sequences wait, passed over by admission (and by `fork`) while the owner holds its
  share, so one request of many prompts never holds every slot and a small request arriving
  behind it is admitted at once. Requests without an owner are not capped.
- prefill beside decoding: while sequences decode, at most `max_prefills_while_decoding`
  prefill chunks run in a step (default 1): each prefill is a call of its own, so six prompts
  arriving at once would otherwise hold every running stream for six prefills in one step. With
  nothing decoding, every prefilling sequence gets its chunk (within the token budget): there is
  no stream to hold up, so an idle engine prefills a burst at full speed.
- chunks go shortest-remaining-first (ties: admission order), so a short prompt admitted behind
  a long one is prefilled in the next step or two instead of after all of it; a request passed
  over `max_prefill_wait` steps in a row goes first (the longest-waiting first), so a long
  prompt still gets a chunk at least every `max_prefill_wait + 1` steps and nothing starves.
  A chunk that does not fit the budget left is skipped for this step; smaller ones may still.
  A sequence skipped for the per-step bound counts as passed over too, so under the bound the
  prefilling sequences take turns: with k of them prefilling, none is passed over more than
  `max_prefill_wait + k - 1` steps in a row.

Blocks are reserved BEFORE the model runs, through the KV cache manager's integer verbs, so the
model's cache appends never fail mid-forward:

    kv.get_computed_blocks(req)       -> prefix lookup at admission: tokens covered
                                         (skipped for a prompt to be scored: prompt_logprobs)
    kv.allocate_slots(req, tokens)    -> bool: req holds blocks for `tokens` positions
    kv.trim(req, tokens)              -> release blocks past `tokens` positions
    kv.free(req)                      -> frees everything req holds

The scheduler owns every token count of a request (`num_computed_tokens`, `num_cached_tokens`,
`status`, `num_preemptions`, `first_scheduled_time`). An engine step talks to it with two verbs,
as vLLM's `EngineCore.step` does: `schedule()` plans the step, `update_from_output(out, result)`
takes what ran (a `StepResult`: positions computed, prefills completed, requests finished,
samples to queue) and moves the counts (`advance`, `prefill_done`, `finish`). Two calls happen
inside a step, where the engine needs an answer before it can go on: `reserve_lookahead`
(speculative decoding reserves the slots of its drafts, all or none for a batch, before
verifying; `advance` releases the ones not kept) and `fork` (a sample starts from its prompt's
just-computed prefill). Preemption and finish release everything.

When a running sequence cannot grow, the most recently admitted other sequence is preempted
(its KV freed; it waits again at the front and is later recomputed from its token ids). A
request that can never fit (prompt + max_tokens beyond the whole pool, or beyond max_model_len)
is rejected at `add` with an error that names the limit.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from cedlm.engine.request import Request, Status


class RequestRejected(ValueError):
    """A request that can never be served under the configured limits."""


@dataclass
class SchedulerOutput:
    decode: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)   # (request, chunk tokens)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)              # newly admitted this step

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefills

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefills)

    @property
    def num_batched_tokens(self) -> int:
        return len(self.decode) + self.prefill_tokens


@dataclass
class StepResult:
    """What the engine ran in one step, reported back through `Scheduler.update_from_output`."""
    computed: list[tuple[Request, int]] = field(default_factory=list)  # (request, positions computed)
    prefilled: list[Request] = field(default_factory=list)     # prompt now in the cache: decodes next
    finished: list[Request] = field(default_factory=list)      # done (the engine set finish_reason)
    requeue: list[Request] = field(default_factory=list)       # samples to prefill on their own

    def finish(self, req: Request) -> None:
        if not any(r is req for r in self.finished):
            self.finished.append(req)


class Scheduler:
    def __init__(self, kv, *, num_blocks: int, block_tokens: int, max_num_seqs: int,
                 prefill_chunk: int, max_model_len: int, max_batched_tokens: int | None = None,
                 max_prefill_wait: int = 2, max_seqs_per_owner: int | None = None,
                 max_prefills_while_decoding: int | None = 1):
        if max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs: must be positive, got {max_num_seqs}")
        if prefill_chunk <= 0:
            raise ValueError(f"prefill_chunk: must be positive, got {prefill_chunk}")
        if max_batched_tokens is not None and max_batched_tokens <= 0:
            raise ValueError(f"max_batched_tokens: must be positive, got {max_batched_tokens}")
        if max_prefill_wait < 0:
            raise ValueError(f"max_prefill_wait: must be >= 0, got {max_prefill_wait}")
        if max_prefills_while_decoding is not None and max_prefills_while_decoding <= 0:
            raise ValueError(f"max_prefills_while_decoding: must be positive, got {max_prefills_while_decoding}")
        if max_seqs_per_owner is not None and max_seqs_per_owner <= 0:
            raise ValueError(f"max_seqs_per_owner: must be positive, got {max_seqs_per_owner}")
        self.kv = kv
        self.num_blocks, self.block_tokens = num_blocks, block_tokens
        self.max_num_seqs, self.prefill_chunk, self.max_model_len = max_num_seqs, prefill_chunk, max_model_len
        self.max_batched_tokens = max_batched_tokens or prefill_chunk + max_num_seqs
        self.max_prefill_wait = max_prefill_wait
        self.max_seqs_per_owner = max_seqs_per_owner or max(1, max_num_seqs // 2)
        self.max_prefills_while_decoding = max_prefills_while_decoding   # None: no bound
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []          # admitted (prefilling or running), admission order
        self._passed_over: dict[int, int] = {}   # id(prefilling request) -> steps passed over in a row

    # ---------------------------------------------------------------- queue
    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def add(self, req: Request) -> None:
        self.check(req)
        self.waiting.append(req)

    def check(self, req: Request) -> None:
        """Raise RequestRejected (naming the limit) for a request that can never be served."""
        total = len(req.prompt_ids) + req.params.max_tokens
        if not req.prompt_ids:
            raise RequestRejected("prompt: empty prompt")
        if len(req.prompt_ids) > self.max_model_len:
            raise RequestRejected(f"prompt: {len(req.prompt_ids)} tokens exceed max_model_len "
                                  f"{self.max_model_len}")
        if total > self.max_model_len:
            raise RequestRejected(f"max_tokens: prompt ({len(req.prompt_ids)}) + max_tokens "
                                  f"({req.params.max_tokens}) = {total} exceeds max_model_len "
                                  f"{self.max_model_len}")
        if self.blocks_for(total) > self.num_blocks:
            raise RequestRejected(
                f"kv_budget: the request needs {self.blocks_for(total)} KV blocks of "
                f"{self.block_tokens} tokens, the whole pool has {self.num_blocks}")

    def requeue(self, reqs: list[Request]) -> None:
        """Put requests at the front of the waiting queue, in order (samples of a prompt that
        could not start from its prefill: they run on their own, via the prefix cache)."""
        for r in reversed(reqs):
            r.status = Status.WAITING
            self.waiting.appendleft(r)

    @property
    def has_free_slot(self) -> bool:
        return len(self.active) < self.max_num_seqs

    def _active_of(self, owner: str) -> int:
        return sum(r.owner == owner for r in self.active)

    def over_share(self, req: Request) -> bool:
        """True when req's owner already runs its share (`max_seqs_per_owner`) of the slots."""
        return req.owner is not None and self._active_of(req.owner) >= self.max_seqs_per_owner

    def start_running(self, req: Request, num_computed_tokens: int) -> None:
        """Admit a request whose KV the engine has already put in place (a sample started from a
        copy of another sample's prefill, `num_computed_tokens` positions): it holds its blocks
        and decodes from the next step."""
        req.status = Status.RUNNING
        req.num_computed_tokens, req.num_cached_tokens = num_computed_tokens, 0
        self._first_scheduled(req)
        self.active.append(req)

    def fork(self, src: Request, dst: Request, num_tokens: int) -> bool:
        """Start dst running from src's first num_tokens positions (a sample of the same prompt:
        src's full blocks shared, the partial one copied); False (nothing taken) when there is
        no free sequence slot or block."""
        if not self.has_free_slot or self.over_share(dst) or not self.kv.fork(src, dst, num_tokens):
            return False
        self.start_running(dst, num_tokens)
        return True

    # ---------------------------------------------------------------- what the engine ran
    def update_from_output(self, out: SchedulerOutput, result: StepResult) -> None:
        """The step `out` planned has run: move the counts of what it computed (releasing the
        lookahead slots not kept), start decoding the prefills that completed, free the finished
        requests and queue the samples that could not start from their prefill. `out` is the plan
        the result answers (its preempted requests are not in the result)."""
        for req, n in result.computed:
            if any(req is p for p in out.preempted):
                raise ValueError(f"update_from_output: {req.request_id} was preempted in this step")
            self.advance(req, n)
        for req in result.prefilled:              # published before a same-step finish frees it
            self.prefill_done(req)
        for req in result.finished:
            self.finish(req)
        self.requeue(result.requeue)

    def advance(self, req: Request, num_tokens: int) -> None:
        """The engine computed num_tokens more positions of req (a prefill chunk, a decode token,
        a verified speculative block); lookahead slots past the next position are released."""
        req.num_computed_tokens += num_tokens
        if req.status is Status.RUNNING:
            self.kv.trim(req, req.num_computed_tokens + 1)

    def prefill_done(self, req: Request) -> None:
        """req's prompt is in the cache: its full blocks are published (prefix cache, store)
        and it decodes from the next step."""
        req.status = Status.RUNNING
        self.kv.cache_full_blocks(req)

    def reserve_lookahead(self, reqs: list[Request], num_tokens: int) -> bool:
        """Speculative decoding: slots for num_tokens positions past each request's next one
        (drafts to verify), for all of reqs or for none (False, nothing kept)."""
        if num_tokens <= 0:
            return True
        for r in reqs:
            if not self.kv.allocate_slots(r, r.num_computed_tokens + 1 + num_tokens):
                for q in reqs:
                    self.kv.trim(q, q.num_computed_tokens + 1)
                return False
        return True

    def abort(self, req: Request) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.active:
            self.active.remove(req)
            self._release(req)
        req.status = Status.FINISHED

    def finish(self, req: Request) -> None:
        if req in self.active:
            self.active.remove(req)
            self._release(req)
        req.status = Status.FINISHED

    def _release(self, req: Request) -> None:
        self._passed_over.pop(id(req), None)
        self.kv.free(req)

    @staticmethod
    def _first_scheduled(req: Request) -> None:
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.active)

    @property
    def num_running(self) -> int:
        return sum(r.status is Status.RUNNING for r in self.active)

    # ---------------------------------------------------------------- planning
    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.active.remove(req)
        self._release(req)
        req.status = Status.WAITING
        req.num_computed_tokens = req.num_cached_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def _lookup(self, req: Request) -> None:
        """Admission: the longest prefix-cached run of blocks, except for a request whose prompt
        is to be scored (prompt_logprobs): a hit would skip rows that must run the decoder, so it
        starts from an empty block table (its blocks are still published when computed)."""
        hit = self.kv.get_computed_blocks(req, use_prefix_cache=not req.needs_prompt_logprobs)
        req.num_computed_tokens = req.num_cached_tokens = hit

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # 1. decode: every running sequence grows by one token; oldest first.
        for req in [r for r in self.active if r.status is Status.RUNNING]:
            if not any(r is req for r in self.active):
                continue                                  # preempted while serving an older one
            while not self.kv.allocate_slots(req, req.num_computed_tokens + 1):
                victims = [r for r in self.active
                           if r is not req and not any(r is d for d in out.decode)]
                if not victims:
                    self._preempt(req, out)
                    break
                self._preempt(victims[-1], out)           # most recently admitted
            else:
                out.decode.append(req)
        # 2. admission: in arrival order, while a slot is free and the whole sequence fits
        #    (an owner past its share passed over).
        out.admitted = self._admit()
        # 3. prefill chunks: the budget left after the decodes, shortest remaining first, the
        #    ones passed over too long before everyone; while sequences decode, at most
        #    max_prefills_while_decoding of them.
        self._plan_prefills(out, self.max_batched_tokens - len(out.decode),
                            self.max_prefills_while_decoding if out.decode else None)
        return out

    def _admit(self) -> list[Request]:
        """Admit waiting requests in arrival order while a slot is free; one whose owner holds
        its share is passed over (it waits for its own request's sequences, not for others), a
        head that does not fit in memory stops admission."""
        admitted = []
        i = 0
        while i < len(self.waiting) and len(self.active) < self.max_num_seqs:
            cand = self.waiting[i]
            if self.over_share(cand):
                i += 1
                continue
            self._lookup(cand)
            if not self.kv.allocate_slots(cand, cand.num_tokens):
                self._release(cand)                       # not now: wait for memory
                cand.num_computed_tokens = cand.num_cached_tokens = 0
                return admitted
            del self.waiting[i]
            cand.status = Status.PREFILLING
            self._first_scheduled(cand)
            self.active.append(cand)
            self._passed_over[id(cand)] = 0
            admitted.append(cand)
        return admitted

    def _plan_prefills(self, out: SchedulerOutput, budget: int, max_chunks: int | None = None) -> None:
        pre = [r for r in self.active if r.status is Status.PREFILLING]
        if not pre:
            return
        order = {id(r): i for i, r in enumerate(pre)}
        wait = self._passed_over

        def key(r: Request):
            w = wait.get(id(r), 0)
            if w >= self.max_prefill_wait:
                return (0, -w, order[id(r)])              # passed over too long: first
            return (1, r.num_tokens - r.num_computed_tokens, order[id(r)])

        for r in sorted(pre, key=key):
            n = min(self.prefill_chunk, r.num_tokens - r.num_computed_tokens)
            fits = n <= budget or not out.prefills        # at least one chunk per step
            if max_chunks is not None and len(out.prefills) >= max_chunks:
                fits = False                              # the bound beside decoding
            if fits and n > 0 and self.kv.allocate_slots(r, r.num_computed_tokens + n):
                out.prefills.append((r, n))
                budget -= n
                wait[id(r)] = 0
            else:
                wait[id(r)] = wait.get(id(r), 0) + 1
