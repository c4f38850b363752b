"""Fair, bounded, cancellable compilation of output constraints, with a cache.

The compiler processes (`grammar_pool`) are few (2) and one compilation may take up to their time
budget (10 s), so the way requests reach them decides whether one client can starve the others.
`CompileQueue` sits in front of them:

- **cache**: compiled grammars are kept by the SHA-256 of (kind, value) (`CACHE_ENTRIES`, least
  recently used out), and so are constraints the compiler rejected (with their message, for any
  parameter name): a repeated schema costs a hash, not a compilation. Identical constraints in
  flight at once compile once (the later ones wait for the first). Time-outs and compiler crashes
  are not cached.
- **bounds**: at most `MAX_PENDING` compilations waiting or running in all, and at most
  `MAX_PER_CLIENT` per client (its address); over either, `CompileBusy` (the handler answers 429
  with `retry-after`, an estimate of when a compiler frees up), before anything is queued.
- **fairness**: its own threads, one per compiler process (never the event loop's shared thread
  pool), take the next job round-robin across clients, and one client runs at most
  `workers - 1` compilations at once (1 with the default 2 compilers): a compiler is always left
  for the other clients, so a client flooding the queue with slow schemas waits behind its own
  and another client's constraint compiles at once, in its normal time.
- **cancellation**: a request that goes away (its client disconnects, its handler is cancelled)
  takes its job out of the queue; a job already compiling finishes and its result is cached.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import math
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from typing import Any, Awaitable, Callable

from cedlm.server.grammar_compile import GrammarError

MAX_PENDING = 64            # compilations waiting or running, every client together
MAX_PER_CLIENT = 4          # ... of one client
CACHE_ENTRIES = 512


class CompileBusy(Exception):
    """The queue (or this client's share of it) is full: answer 429 with `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class ClientGone(Exception):
    """The request went away while its constraint waited to compile."""


class _Job:
    __slots__ = ("key", "param", "kind", "value", "client", "future", "users")

    def __init__(self, key, param, kind, value, client):
        self.key, self.param, self.kind, self.value, self.client = key, param, kind, value, client
        self.future: Future = Future()
        self.users = 1                      # requests waiting on it (identical constraints share it)


def _waiter(future: Future) -> asyncio.Future:
    """An asyncio future that follows `future` (its result, exception or cancellation), and whose
    own cancellation leaves `future` alone (asyncio.wrap_future would cancel it)."""
    loop = asyncio.get_running_loop()
    out = loop.create_future()

    def copy(f: Future) -> None:
        if out.done():
            return
        if f.cancelled():
            out.cancel()
        elif f.exception() is not None:
            out.set_exception(f.exception())
        else:
            out.set_result(f.result())
    future.add_done_callback(lambda f: loop.call_soon_threadsafe(copy, f))
    return out


def constraint_key(kind: str, value: Any) -> str:
    return hashlib.sha256(json.dumps([kind, value], sort_keys=True, ensure_ascii=False).encode()).hexdigest()


class CompileQueue:
    """See the module docstring. `compile_fn(param, kind, value) -> grammar` is the blocking
    compilation (bounds, then a compiler process); it raises `GrammarError`, with
    ``transient = True`` for a time-out or a crash (not cached)."""

    def __init__(self, compile_fn: Callable[[str, str, Any], str], workers: int = 2, *,
                 max_pending: int | None = None, max_per_client: int | None = None,
                 cache_entries: int = CACHE_ENTRIES):
        self.compile_fn, self.workers = compile_fn, max(1, int(workers))
        self.max_pending = MAX_PENDING if max_pending is None else int(max_pending)
        self.max_per_client = MAX_PER_CLIENT if max_per_client is None else int(max_per_client)
        self.cache_entries = int(cache_entries)
        self.cache: OrderedDict[str, tuple[str, str]] = OrderedDict()   # key -> ("ok"|"error", text)
        self.queues: OrderedDict[str, deque[_Job]] = OrderedDict()      # client -> its waiting jobs
        self.inflight: dict[str, _Job] = {}                               # key -> queued or running job
        self.per_client: dict[str, int] = {}
        self.running: dict[str, int] = {}                                 # client -> its jobs compiling
        self.max_running = max(1, self.workers - 1)                       # per client
        self.pending = 0
        self.seconds = 1.0                                               # running mean compile time
        self.counters = {"cache_hits": 0, "compiled": 0, "busy": 0, "cancelled": 0, "shared": 0}
        self.cv = threading.Condition()
        self.threads: list[threading.Thread] = []
        self.closed = False

    # ------------------------------------------------------------------ the request side
    def cached(self, param: str, kind: str, value: Any, key: str | None = None) -> str | None:
        """The cached grammar (or the cached rejection, raised as a GrammarError for param)."""
        key = key or constraint_key(kind, value)
        with self.cv:
            hit = self.cache.get(key)
            if hit is None:
                return None
            self.cache.move_to_end(key)
            self.counters["cache_hits"] += 1
        if hit[0] == "error":
            raise GrammarError(param, hit[1])
        return hit[1]

    def retry_after(self) -> int:
        """Seconds until this client may find room, estimated from the queue and compile time."""
        return max(1, min(60, math.ceil(self.pending / self.workers * self.seconds)))

    def submit(self, param: str, kind: str, value: Any, client: str, key: str | None = None) -> _Job:
        """Queue a compilation (or join an identical one in flight); CompileBusy when full."""
        key = key or constraint_key(kind, value)
        with self.cv:
            job = self.inflight.get(key)
            if job is not None and not job.future.cancelled():
                job.users += 1
                self.counters["shared"] += 1
                return job
            if self.pending >= self.max_pending:
                self.counters["busy"] += 1
                raise CompileBusy(f"{param}: the server is compiling {self.pending} constraints, its limit; "
                                  f"retry later", self.retry_after())
            if self.per_client.get(client, 0) >= self.max_per_client:
                self.counters["busy"] += 1
                raise CompileBusy(f"{param}: {self.max_per_client} constraints of this client are compiling "
                                  f"or waiting to, its limit; retry later", self.retry_after())
            job = _Job(key, param, kind, value, client)
            self.inflight[key] = job
            self.per_client[client] = self.per_client.get(client, 0) + 1
            self.pending += 1
            self.queues.setdefault(client, deque()).append(job)
            self._start_threads()
            self.cv.notify()
            return job

    def leave(self, job: _Job) -> None:
        """A request waiting on job went away: the job leaves the queue once nobody waits on it
        (a running job finishes, and its result is cached)."""
        with self.cv:
            job.users -= 1
            if job.users > 0:
                return
            q = self.queues.get(job.client)
            if q is not None and job in q:
                q.remove(job)
                if not q:
                    del self.queues[job.client]
                job.future.cancel()
                self.counters["cancelled"] += 1
                self._done(job)

    async def compile(self, param: str, kind: str, value: Any, client: str = "",
                      gone: Callable[[], Awaitable[Any]] | None = None) -> str:
        """The grammar string, from the cache or a compiler; GrammarError (400), CompileBusy
        (429) or ClientGone (`gone()` returned first: the job left the queue)."""
        key = constraint_key(kind, value)
        hit = self.cached(param, kind, value, key)
        if hit is not None:
            return hit
        job = self.submit(param, kind, value, client, key)
        waiter = _waiter(job.future)          # cancelling it never cancels the job others may share
        watcher = asyncio.ensure_future(gone()) if gone is not None else None
        try:
            if watcher is not None:
                await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not waiter.done():
                    raise ClientGone(param)
            kind_, text = await asyncio.shield(waiter)
        finally:
            if watcher is not None:
                watcher.cancel()
                if watcher.done() and not watcher.cancelled():
                    watcher.exception()        # retrieved: a receive that failed means gone too
            if not job.future.done():
                self.leave(job)
            waiter.cancel()
        if kind_ == "error":
            raise GrammarError(param, text)
        return text

    # ------------------------------------------------------------------ the compiler side
    def _start_threads(self) -> None:
        while len(self.threads) < self.workers:
            th = threading.Thread(target=self._run, name=f"cedlm-compile-{len(self.threads)}", daemon=True)
            self.threads.append(th)
            th.start()

    def _next(self) -> _Job | None:
        """The next job, round-robin over the clients below their running share (the caller holds
        the lock)."""
        while not self.closed:
            client = next((c for c in self.queues if self.running.get(c, 0) < self.max_running), None)
            if client is not None:
                break
            self.cv.wait()
        else:
            return None
        q = self.queues.pop(client)
        job = q.popleft()
        if q:
            self.queues[client] = q                 # to the back of the round
        self.running[client] = self.running.get(client, 0) + 1
        return job

    def _done(self, job: _Job) -> None:
        if self.inflight.get(job.key) is job:
            del self.inflight[job.key]
        self.per_client[job.client] -= 1
        if not self.per_client[job.client]:
            del self.per_client[job.client]
        self.pending -= 1

    def _stopped(self, job: _Job) -> None:
        self.running[job.client] -= 1
        if not self.running[job.client]:
            del self.running[job.client]
        self.cv.notify_all()                        # a thread may now take this client's next job

    def _run(self) -> None:
        while True:
            with self.cv:
                job = self._next()
            if job is None:
                return
            if not job.future.set_running_or_notify_cancel():
                with self.cv:
                    self._stopped(job)
                    self._done(job)
                continue
            t0 = time.monotonic()
            try:
                result, cache = ("ok", self.compile_fn(job.param, job.kind, job.value)), True
            except GrammarError as e:
                msg = str(e)
                result = ("error", msg.split(": ", 1)[1] if msg.startswith(e.param + ": ") else msg)
                cache = not getattr(e, "transient", False)
            except Exception as e:               # noqa: BLE001 - delivered to the request
                with self.cv:
                    self._stopped(job)
                    self._done(job)
                job.future.set_exception(e)
                continue
            took = time.monotonic() - t0
            with self.cv:
                self.seconds = 0.8 * self.seconds + 0.2 * took
                self.counters["compiled"] += 1
                if cache:
                    self.cache[job.key] = result
                    while len(self.cache) > self.cache_entries:
                        self.cache.popitem(last=False)
                self._stopped(job)
                self._done(job)
            job.future.set_result(result)

    def close(self) -> None:
        with self.cv:
            self.closed = True
            for q in self.queues.values():
                for job in q:
                    job.future.cancel()
            self.queues.clear()
            self.cv.notify_all()
