"""Logits processors for the engine's ``SamplingParams.logits_processors`` hook.

A processor is a callable ``(output_ids: list[int], logits: Tensor[vocab]) -> Tensor`` that the
engine applies to a sequence's next-token logits before sampling (after ``logit_bias``, before
the penalties and temperature). Each request gets its own processors, built by the handler, off
the engine thread; the samples of one request (``n`` / ``best_of``) share them.

- ``GrammarProcessor``: constrained decoding with llguidance (https://github.com/guidance-ai/llguidance,
  pinned in pyproject.toml). A per-sequence ``LLMatcher`` masks every token the grammar does not
  allow next and advances on each sampled token (it consumes the tokens of ``output_ids`` it has
  not seen yet; states are keyed by those tokens, so samples sharing the processor and a
  preempted, recomputed sequence stay consistent). Once the grammar is complete only EOS is
  allowed. In thinking mode
  the grammar starts after the first ``</think>`` (``gate``): the reasoning is free text, the
  answer is constrained.
  Its token masks are computed off the engine thread, in the server's mask threads
  (``MaskWorkers``; llguidance drops the GIL while it computes one): the engine calls ``prepare``
  right after each token, so the next mask is computed while the model runs, and ``wait`` before
  sampling (the engine holds a row back while its mask is late, engine.py). A mask that has not
  arrived ``MASK_DEADLINE_S`` after its token was sampled ends that request alone with
  ``ConstraintTimeout`` (a 400 naming the constraint).
- ``MinTokensProcessor`` (vLLM's ``min_tokens``): EOS and ``stop_token_ids`` are banned until
  ``min_tokens`` tokens have been generated.
- ``MinPProcessor`` (vLLM's ``min_p``): drops tokens whose probability, at the request's
  temperature, is below ``min_p`` times the most likely token's.

``Grammars`` (one per server) owns the llguidance tokenizer, built from the served HF
``tokenizers`` tokenizer on first use, and compiles request grammars (JSON schema, regex, Lark,
choice): through a fair, bounded, cancellable queue with a cache (``compile_queue``), bounds
first (``grammar_limits``), then in a compiler process (``grammar_pool``, ``grammar_compile``),
reporting an invalid one as a ``GrammarError`` that the handler turns into
a 400. JSON output is compact (no free whitespace): a weak model cannot pad it forever.
"""
from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np
import torch

from cedlm.engine.sampler import ConstraintTimeout
from cedlm.server.compile_queue import CompileQueue
from cedlm.server.grammar_compile import GrammarError, clean_message, llguidance
from cedlm.server.grammar_limits import GrammarLimit, check_constraint
from cedlm.server.grammar_pool import GrammarPool

__all__ = ["GrammarError", "Grammars", "GrammarProcessor", "MinTokensProcessor", "MinPProcessor"]

NEG_INF = float("-inf")
MASK_THREADS = 2             # threads computing grammar masks, per server
MASK_DEADLINE_S = 5.0        # a mask not there this long after its token was sampled ends the request


class MaskWorkers:
    """The threads that compute grammar masks (and advance matchers) off the engine thread."""

    def __init__(self, threads: int = MASK_THREADS):
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cedlm-mask")

    def submit(self, fn, *args) -> Future:
        return self.pool.submit(fn, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


_default_workers: MaskWorkers | None = None
_default_lock = threading.Lock()


def default_workers() -> MaskWorkers:
    global _default_workers
    with _default_lock:
        if _default_workers is None:
            _default_workers = MaskWorkers()
        return _default_workers


class Grammars:
    """Compiles request constraints against the served tokenizer (thread-safe, built lazily).

    `compile` checks the bounds first (`grammar_limits`: 400 naming the limit) and then compiles
    in a compiler process (`grammar_pool`: a crash or a runaway costs only that request); the
    engine's matchers are built here, in the server, from the validated grammar string."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tok, self.vocab_size = tokenizer, int(vocab_size)
        self._lltok = None
        self._pool: GrammarPool | None = None
        self._lock = threading.Lock()
        self.masks: MaskWorkers | None = None      # the mask threads, started with the first processor
        self._queue: CompileQueue | None = None

    @property
    def available(self) -> bool:
        return llguidance is not None and self.tok is not None and hasattr(self.tok, "hf")

    def lltok(self):
        with self._lock:
            if self._lltok is None:
                if llguidance is None:
                    raise GrammarError("response_format", "structured output needs the 'llguidance' "
                                                          "package (pip install llguidance)")
                self._lltok = llguidance.LLTokenizer(self.tok.hf.to_str(), n_vocab=self.tok.vocab_size,
                                                     eos_token=self.tok.eos_id)
            return self._lltok

    def pool(self) -> GrammarPool:
        with self._lock:
            if self._pool is None:
                self._pool = GrammarPool(self.tok.hf.to_str(), self.tok.vocab_size, self.tok.eos_id)
            return self._pool

    def queue(self) -> CompileQueue:
        workers = self.pool().workers
        with self._lock:
            if self._queue is None:
                self._queue = CompileQueue(lambda p, k, v: self.pool().compile(p, k, v), workers=workers)
            return self._queue

    async def compile_async(self, param: str, kind: str, value: Any, client: str = "", gone=None) -> str:
        """`compile` through the queue (cache, bounds, fairness, cancellation: compile_queue.py);
        CompileBusy (429) when it is full, ClientGone when `gone()` returns first."""
        self.check(param, kind, value)              # milliseconds: refused before it queues
        return await self.queue().compile(param, kind, value, client, gone)

    @staticmethod
    def check(param: str, kind: str, value: Any) -> None:
        if llguidance is None:
            raise GrammarError(param, "structured output needs the 'llguidance' package (pip install llguidance)")
        try:
            check_constraint(param, kind, value)
        except GrammarLimit as e:
            raise GrammarError(e.param, str(e).split(": ", 1)[-1]) from None

    def compile(self, param: str, kind: str, value: Any) -> str:
        """A validated grammar string for the constraint (kind: json_schema, json_object, regex,
        choice, grammar); GrammarError (400) when it is invalid, over a bound, crashes the
        compiler or runs past its time budget. Blocking: call it off the event loop."""
        self.check(param, kind, value)
        return self.pool().compile(param, kind, value)

    def regex(self, pattern: str, param: str) -> str:
        return self.compile(param, "regex", pattern)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None
            if self.masks is not None:
                self.masks.close()
                self.masks = None
            if self._queue is not None:
                self._queue.close()
                self._queue = None

    # ------------------------------------------------------------------ processors
    def processor(self, grammar: str, param: str, gate_id: int | None = None) -> "GrammarProcessor":
        lltok = self.lltok()
        m = llguidance.LLMatcher(lltok, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(param, f"the grammar could not be compiled: {clean_message(m.get_error())}")
        with self._lock:
            if self.masks is None:
                self.masks = MaskWorkers()
            workers = self.masks
        return GrammarProcessor(lambda: llguidance.LLMatcher(lltok, grammar, log_level=0), self.vocab_size,
                                self.tok.eos_id, gate_id, workers=workers, param=param, first=m)


class GrammarProcessor:
    """Masks the logits to what the grammar allows next (see the module docstring).

    One object may serve several sequences (the engine's samples of an n / best_of request share
    their processors), so matcher states are keyed by the constrained tokens they have consumed:
    a call finds the state for its own tokens, or advances the state of their longest known
    prefix, or (a sequence the cache no longer knows, e.g. one the engine recomputed) replays its
    tokens on a fresh matcher. Samples with identical histories share one state.

    Masks are computed in the mask threads (`workers`), one job at a time per processor (the
    matchers are touched only there): `prepare(output_ids)` starts the mask of that history,
    `wait(output_ids, timeout)` says whether it has arrived (raising `ConstraintTimeout` once it
    is `deadline` seconds late), `__call__` applies it (waiting for it if need be)."""

    MAX_STATES = 64
    MAX_MASKS = 16

    def __init__(self, factory, vocab_size: int, eos_id: int, gate_id: int | None = None, *,
                 workers: MaskWorkers | None = None, param: str = "response_format",
                 deadline: float | None = None, first=None):
        self.factory, self.V, self.eos, self.gate = factory, int(vocab_size), int(eos_id), gate_id
        self.param = param
        self.deadline = MASK_DEADLINE_S if deadline is None else float(deadline)
        self.workers = workers or default_workers()
        self.states: dict[tuple, Any] = {(): first if first is not None else factory()}
        self._job = threading.Lock()             # the matchers: one job at a time
        self._lock = threading.Lock()            # the masks table
        self.masks: OrderedDict[tuple, tuple[Future, float]] = OrderedDict()
        self.prepare([])                         # the first token's mask, while the prompt runs

    def _span(self, output_ids: list[int]) -> tuple | None:
        if self.gate is None:
            return tuple(output_ids)
        try:
            k = output_ids.index(self.gate)
        except ValueError:
            return None
        return tuple(output_ids[k + 1:])

    def _matcher(self, span: tuple):
        m = self.states.get(span)
        if m is not None:
            return m
        parent = next((span[:k] for k in range(len(span) - 1, -1, -1) if span[:k] in self.states), None)
        if parent is not None and len(span) - len(parent) <= 8:
            m = self.states.pop(parent)         # a sibling still at `parent` replays from scratch
            if not parent:
                self.states[()] = m.deep_copy()     # the empty state is every sample's start
        else:
            m, parent = self.factory(), ()
        m.consume_tokens(list(span[len(parent):]))
        if len(self.states) >= self.MAX_STATES:
            self.states.pop(next(iter(self.states)))
        self.states[span] = m
        return m

    def _allowed(self, m) -> torch.Tensor:
        allowed = torch.zeros(self.V, dtype=torch.bool, device="cpu")   # from the host bitmask
        if not m.is_error():
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
            n = min(self.V, bits.shape[0])
            allowed[:n] = torch.from_numpy(bits[:n].astype(np.bool_))
        if not bool(allowed.any()):            # a rejected token or a dead end: end the output
            allowed[self.eos] = True
        return allowed

    # ------------------------------------------------------------------ masks off the engine thread
    def _compute(self, span: tuple) -> torch.Tensor:
        with self._job:
            return self._allowed(self._matcher(span))

    def _mask(self, span: tuple) -> tuple[Future, float]:
        """The mask job of span (started now if it is not known) and when it was asked for."""
        with self._lock:
            got = self.masks.get(span)
            if got is None or got[0].cancelled():
                got = self.masks[span] = (self.workers.submit(self._compute, span), time.monotonic())
                while len(self.masks) > self.MAX_MASKS:
                    self.masks.popitem(last=False)
            return got

    def prepare(self, output_ids: list[int]) -> None:
        span = self._span(list(output_ids))
        if span is not None:
            self._mask(span)

    def wait(self, output_ids: list[int], timeout: float) -> bool:
        span = self._span(list(output_ids))
        if span is None:
            return True
        fut, since = self._mask(span)
        try:
            fut.result(timeout=max(0.0, timeout))
            return True
        except FutureTimeout:
            if time.monotonic() - since > self.deadline:
                raise ConstraintTimeout(f"{self.param}: the constraint's token mask took longer than the limit "
                                        f"of {self.deadline:g} s; simplify the constraint") from None
            return False

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        span = self._span(list(output_ids))
        if span is None:                       # still reasoning (thinking mode)
            return logits
        allowed = self._mask(span)[0].result()
        V = logits.shape[-1]
        if V != self.V:
            full = torch.zeros(V, dtype=torch.bool, device="cpu")
            full[:min(V, self.V)] = allowed[:min(V, self.V)]
            allowed = full
        return logits.masked_fill(~allowed.to(logits.device, non_blocking=True), NEG_INF)


class MinTokensProcessor:
    def __init__(self, min_tokens: int, banned: list[int]):
        self.min_tokens, self.banned = int(min_tokens), sorted(set(int(t) for t in banned))

    def __call__(self, output_ids, logits):
        if len(output_ids) >= self.min_tokens or not self.banned:
            return logits
        out = logits.clone()
        out[torch.tensor([t for t in self.banned if t < out.shape[-1]], dtype=torch.long,
                         device=out.device)] = NEG_INF
        return out


class MinPProcessor:
    """Keeps tokens with p >= min_p * p_max at temperature T, i.e. logit >= max + T * ln(min_p)."""

    def __init__(self, min_p: float, temperature: float):
        self.min_p, self.t = float(min_p), float(temperature)

    def __call__(self, output_ids, logits):
        if self.min_p <= 0 or self.t <= 0:
            return logits
        cut = logits.max() + self.t * math.log(self.min_p)
        return logits.masked_fill(logits < cut, NEG_INF)
