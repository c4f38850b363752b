"""The one thread that owns the engine.

The Engine is not thread-safe, so nothing but this thread touches it. HTTP handlers (on the
asyncio loop) talk to it through a thread-safe command queue (`submit`, `abort`, `call`); the
thread steps the engine while there is work and turns the `StepOutput`s each step returns into
events (server/events.py: Admitted, Delta, Finished, Failed) on the request's asyncio.Queue with
`loop.call_soon_threadsafe`. Nothing is diffed: a StepOutput says what the step produced.

A request of several samples (`SamplingParams.n` / `best_of`) is one engine group
(`Engine.add_samples`: the prompt is prefilled once): `submit_samples` returns one queue per
sample, and each sample's events are published on its own queue like a request's; a sample that
waits for the group's prefill counts as admitted once the first sample is.

Admission control: at most `max_waiting` requests wait in the scheduler when the engine cannot
admit at once (more -> 429 at submit), and a request not admitted within `queue_timeout` seconds
is withdrawn (429). Both carry `retry_after` seconds.

Containment: a failure while handling one request fails that request alone. The engine finishes a
request whose batch raised with finish_reason "error" (and `req.error`); the worker sends it a
500 with a generic message and its request id (the details are logged under that id, never sent)
and everyone else goes on. Handling one command (add, abort, publish) that raises fails only that
request. A raise out of `engine.step()` itself leaves the engine's state suspect: the requests in
flight get a 500 and the loop goes on; `max_step_failures` such raises in a row (no good step in
between) or `max_restarts` crashes of the loop within a minute mark the engine failed: the thread
ends, every request then gets 503 at once, `/health` says "failed" and `on_failed` is called (the
CLI exits the process so a supervisor restarts it). `health()` is the truth /health serves:
("ready" | "degraded" | "failed", reason); degraded = engine errors in the last
`degraded_window` seconds, one loop iteration (a step, a store call) running longer than
`stall_after` seconds, store errors or an open store circuit breaker.

The engine is read only through its public surface: `add_request`, `abort` (which also forgets
the request), `step` (which forgets the requests that finished), `has_work` and `snapshot()`;
`snapshot` here is the last engine snapshot as a dict, plus the 429 counts, for the metrics.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

from cedlm.engine.request import Status
from cedlm.engine.sampler import ConstraintConflict, ConstraintTimeout
from cedlm.engine.scheduler import RequestRejected
from cedlm.server.events import Admitted, Delta, Failed, Finished
from cedlm.server.submission import Submission, Track, refused, sample_ids

__all__ = ["Admitted", "Delta", "EngineWorker", "Failed", "Finished", "sample_ids"]

if TYPE_CHECKING:
    from cedlm.engine.engine import EngineSnapshot
    from cedlm.engine.output import StepOutput

log = logging.getLogger("cedlm.server")


class _EngineFailed(Exception):
    pass


def _error_id() -> str:
    return f"err-{uuid.uuid4().hex[:16]}"


class EngineWorker:
    def __init__(self, engine, *, max_waiting: int | None = None, queue_timeout: float | None = 30.0,
                 retry_after: int = 1, max_step_failures: int = 5, max_restarts: int = 3,
                 degraded_window: float = 60.0, stall_after: float = 30.0,
                 on_failed: Callable[[str], Any] | None = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.queue_timeout = queue_timeout
        self.retry_after = max(1, int(retry_after))
        self.max_step_failures, self.max_restarts = max_step_failures, max_restarts
        self.degraded_window, self.stall_after = degraded_window, stall_after
        self.on_failed = on_failed
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()            # orders submit() against the engine failing
        self._stop = False
        self._tracked: dict[str, Track] = {}
        self._owners: dict[str, Track] = {}      # owner (HTTP request of several prompts) -> its first sequence
        self._thread: threading.Thread | None = None
        self._failed: str | None = None          # why the engine is failed (sticky)
        self._recent: collections.deque = collections.deque(maxlen=64)   # (monotonic, reason)
        self._busy_since: float | None = None    # start of the engine thread's current iteration
        self._store_errors = (0, 0.0)            # (last count seen, when it last grew)
        self.rejected = {"queue_full": 0, "queue_timeout": 0}
        self.errors = {"request": 0, "step": 0, "loop": 0}
        # called on the engine thread with each finished request's last StepOutput (the latency
        # histograms, the per-request log line: server/latency.py, server/tracing.py); cheap, never raise
        self.on_finished: list[Callable[[StepOutput], Any]] = []
        self.snapshot: dict = {}
        self._update_snapshot()

    # ------------------------------------------------------------ handler side (any thread)
    def start(self) -> None:
        if self._thread is None and self._failed is None:
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="cedlm-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._stop = True
            self._wake.set()
            if self._thread is not threading.current_thread():
                self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def failed(self) -> str | None:
        return self._failed

    def health(self) -> tuple[str, str | None]:
        """("ready" | "degraded" | "failed", reason or None)."""
        if self._failed is not None:
            return "failed", self._failed
        if not self.alive:
            return "failed", "the engine thread is not running"
        now = time.monotonic()
        t = self._busy_since
        if t is not None and now - t > self.stall_after:
            return "degraded", (f"the engine thread has been busy for {now - t:.0f} s in one iteration "
                                f"(a step or a store call may hang)")
        recent = [r for ts, r in list(self._recent) if now - ts <= self.degraded_window]
        if recent:
            return "degraded", (f"{len(recent)} engine error{'s' if len(recent) > 1 else ''} in the last "
                                f"{self.degraded_window:g} s; the last: {recent[-1]}")
        kv = self.snapshot.get("kv", {})
        state = kv.get("store_breaker_state", "closed")
        if state == "open":
            return "degraded", ("the KV store's circuit breaker is open: store reads/writes are skipped "
                                "(prefix-cache misses)")
        if state == "half_open":
            return "degraded", ("the KV store's circuit breaker is half-open: after failures, one trial "
                                "call at a time goes to the store (closes on success)")
        n, when = self._store_errors
        if n and now - when <= self.degraded_window:
            return "degraded", f"KV store errors in the last {self.degraded_window:g} s (treated as cache misses)"
        return "ready", None

    def submit(self, request_id: str, prompt_ids: list[int], params) -> asyncio.Queue:
        """Queue a request; returns the asyncio.Queue its events arrive on (call from the loop)."""
        return self.submit_samples(request_id, prompt_ids, params)[0]

    def submit_samples(self, request_id: str, prompt_ids: list[int], params, images=None,
                       owner: str | None = None) -> list[asyncio.Queue]:
        """Queue a request of `params.num_samples` samples (n / best_of; one engine group:
        `Engine.add_samples`); returns one asyncio.Queue per sample, in sample order. The samples'
        engine ids are `sample_ids(request_id, k)`. `owner`: the HTTP request of several prompts
        this one belongs to (the engine runs at most half the slots of one owner at once; its
        later prompts count as admitted with its first)."""
        loop = asyncio.get_running_loop()
        qs: list[asyncio.Queue] = [asyncio.Queue() for _ in range(params.num_samples)]
        with self._lock:
            if self._failed is not None:
                for q in qs:
                    q.put_nowait(self._failed_event())
                return qs
            self._cmds.put(("add", Submission(request_id, list(prompt_ids), params, qs, loop, images=images,
                                               owner=owner)))
        self._wake.set()
        return qs

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))
        self._wake.set()

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread; a Future of its result (for tests and tools)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._failed is not None:
                fut.set_exception(RuntimeError(f"the engine has failed: {self._failed}"))
                return fut
            self._cmds.put(("call", (fn, fut)))
        self._wake.set()
        return fut

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        crashes: list[float] = []
        try:
            while True:
                try:
                    self._loop()
                    break                                  # asked to stop
                except _EngineFailed as e:
                    self._set_failed(str(e))
                    break
                except BaseException as e:                 # noqa: BLE001 - the thread must not die silently
                    eid = _error_id()
                    log.critical("engine loop crashed [%s]; restarting it", eid, exc_info=e)
                    self.errors["loop"] += 1
                    self._note(f"the engine loop crashed (error id {eid})")
                    self._fail_all(lambda rid: self._internal(rid))
                    now = time.monotonic()
                    crashes = [t for t in crashes if now - t < 60.0] + [now]
                    if len(crashes) > self.max_restarts or not isinstance(e, Exception):
                        self._set_failed(f"the engine loop crashed {len(crashes)} time(s) within 60 s "
                                         f"(the last: error id {eid})")
                        break
        finally:
            self._fail_all(lambda rid: self._failed_event() if self._failed else Failed(
                503, "the server is shutting down", type="server_error", code="shutting_down"))
            self._update_snapshot()

    def _loop(self) -> None:
        eng = self.engine
        failures = 0
        while not self._stop:
            self._busy_since = None
            if not eng.has_work and self._cmds.empty():
                self._wake.wait()
            self._busy_since = time.monotonic()
            self._wake.clear()
            self._drain()
            if self._stop:
                break
            self._expire()
            progressed = True
            if eng.has_work:
                try:
                    outputs = eng.step()
                    failures = 0
                except Exception as e:            # the engine's state is suspect: fail who is in flight
                    failures += 1
                    eid = _error_id()
                    log.error("engine step failed [%s] (%d in a row); failing the %d requests in flight",
                              eid, failures, len(self._tracked), exc_info=e)
                    self.errors["step"] += 1
                    self._note(f"an engine step failed (error id {eid})")
                    self._fail_all(lambda rid: self._internal(rid))
                    self._update_snapshot()
                    if failures >= self.max_step_failures:
                        raise _EngineFailed(f"{failures} engine steps failed in a row "
                                            f"(the last: error id {eid})") from e
                    continue
                progressed = self._publish(outputs)
            snap = self._update_snapshot()
            if not progressed and snap is not None and snap.num_running == 0:
                time.sleep(0.001)                 # nothing could move (waiting on memory): don't spin hot

    # ------------------------------------------------------------ failure bookkeeping
    def _note(self, reason: str) -> None:
        self._recent.append((time.monotonic(), reason))

    def _internal(self, rid: str) -> Failed:
        return Failed(500, f"the engine failed while processing this request; the request id is {rid}",
                      type="server_error", code="engine_error", request_id=rid)

    def _failed_event(self) -> Failed:
        return Failed(503, "the engine has failed and is not serving requests (see /health); "
                           "the server must be restarted", type="server_error", code="engine_failed")

    def _set_failed(self, reason: str) -> None:
        log.critical("engine failed: %s", reason)
        with self._lock:
            self._failed = reason
            pending = []
            while True:
                try:
                    pending.append(self._cmds.get_nowait())
                except queue.Empty:
                    break
        for kind, arg in pending:                 # commands that will never run
            if kind == "add":
                self._send(arg, self._failed_event())
            elif kind == "call":
                _, fut = arg
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(RuntimeError(f"the engine has failed: {reason}"))
        if self.on_failed is not None:
            try:
                self.on_failed(reason)
            except Exception:                     # noqa: BLE001
                log.exception("on_failed callback raised")

    def _send(self, t, ev) -> None:
        for q in (t.qs if isinstance(t, Submission) else [t.q]):
            try:
                t.loop.call_soon_threadsafe(q.put_nowait, ev)
            except RuntimeError:                  # the handler's loop is gone
                pass

    def _drain(self) -> None:
        while True:
            try:
                kind, arg = self._cmds.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                if self._tracked.pop(arg, None) is not None:
                    log.info("request %s aborted (the client went away)", arg)
                    self._abort(arg)
            elif kind == "call":
                fn, fut = arg
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(self.engine))
                    except BaseException as e:   # noqa: BLE001 - handed to the caller
                        fut.set_exception(e)

    def _abort(self, rid: str) -> None:
        try:
            self.engine.abort(rid)
        except Exception as e:                    # noqa: BLE001 - one abort must not stop the engine
            eid = _error_id()
            log.error("abort of %s failed [%s]", rid, eid, exc_info=e)
            self.errors["request"] += 1
            self._note(f"aborting a request failed (error id {eid})")

    def _queue_full(self) -> EngineSnapshot | None:
        """The engine's snapshot when the request must be refused: the waiting queue is at its
        bound and the engine cannot admit at once; None when it may be queued."""
        if self.max_waiting is None:
            return None
        s = self.engine.snapshot()
        # the free sequence slots take waiting requests at the next step: the queue holds
        # max_waiting beyond them (a burst of requests arrives before that step runs)
        free = max(0, s.max_num_seqs - s.num_running)
        return s if s.num_waiting >= self.max_waiting + free else None

    def _add(self, sub: Submission) -> None:
        try:
            # a later prompt of a request already taken is not refused for the queue (the whole
            # request was bounded by slots + queue when it came: ServerState.check_capacity)
            s = None if sub.owner is not None and sub.owner in self._owners else self._queue_full()
            if s is not None:
                self.rejected["queue_full"] += 1
                self._send(sub, Failed(
                    429, f"the server is full: {s.num_running} requests running (max_num_seqs "
                         f"{s.max_num_seqs}) and {s.num_waiting} waiting (queue bound {self.max_waiting}); "
                         f"retry after {self.retry_after} s",
                    code="rate_limit_exceeded", type="rate_limit_error", retry_after=self.retry_after))
                return
            reqs = self.engine.add_samples(sub.prompt_ids, sub.params, sub.request_id, images=sub.images,
                                           owner=sub.owner)
        except ValueError as e:                   # RequestRejected too: a 400 naming the limit
            self._send(sub, refused(str(e), rejected=isinstance(e, RequestRejected)))
            return
        except Exception as e:                    # noqa: BLE001 - this request fails, nobody else
            log.error("adding request %s failed", sub.request_id, exc_info=e)
            self.errors["request"] += 1
            self._note(f"adding a request failed (request id {sub.request_id})")
            for rid in sample_ids(sub.request_id, len(sub.qs)):
                self._abort(rid)
            self._send(sub, self._internal(sub.request_id))
            return
        # a later prompt of a request of several waits behind its own request's share of the
        # slots (the scheduler's fair share), not in the queue: admitted with its first prompt
        first = self._owners.get(sub.owner) if sub.owner is not None else None
        leader = first
        for req, q in zip(reqs, sub.qs):
            t = self._tracked[req.request_id] = Track(req, q, sub.loop, sub.submitted, leader)
            if req.sample_index == 0:
                leader = t                        # the prompt's other samples wait on its sample 0
        if sub.owner is not None and first is None:
            self._owners[sub.owner] = self._tracked[reqs[0].request_id]

    def _expire(self) -> None:
        self._owners = {o: t for o, t in self._owners.items() if t.req.request_id in self._tracked}
        if self.queue_timeout is None:
            return
        now = time.monotonic()
        for rid, t in list(self._tracked.items()):
            if not t.admitted and t.req.status is Status.WAITING and not t.req.output_ids \
                    and now - t.submitted > self.queue_timeout:
                self._abort(rid)
                del self._tracked[rid]
                self.rejected["queue_timeout"] += 1
                self._send(t, Failed(
                    429, f"the server is full: the request was not admitted within the queue timeout "
                         f"({self.queue_timeout:g} s); retry after {self.retry_after} s",
                    code="rate_limit_exceeded", type="rate_limit_error", retry_after=self.retry_after))

    def _publish(self, outputs: list[StepOutput]) -> bool:
        """Turn the step's outputs into events on the requests' queues; a sample waiting on its
        group's prefill counts as admitted once the first sample is. True when anything moved."""
        progressed = bool(outputs)
        for o in outputs:
            t = self._tracked.get(o.request_id)
            if t is None:
                continue                          # aborted meanwhile
            try:
                self._publish_one(o, t)
            except Exception as e:                # noqa: BLE001 - this request fails, nobody else
                log.error("publishing request %s failed", o.request_id, exc_info=e)
                self.errors["request"] += 1
                self._note(f"publishing a request failed (request id {o.request_id})")
                self._tracked.pop(o.request_id, None)
                self._abort(o.request_id)
                self._send(t, self._internal(o.request_id))
        for t in list(self._tracked.values()):
            if not t.admitted and t.leader is not None and t.leader.admitted:
                t.admitted = True
                self._send(t, Admitted(t.cached))
                progressed = True
        return progressed

    def _publish_one(self, o: StepOutput, t: Track) -> None:
        rid = o.request_id
        if o.failed and (o.error or "").startswith(ConstraintConflict.__name__ + ":"):
            # the request's own constraints leave no token (e.g. allowed_token_ids against its
            # grammar): a 400 for it alone; nothing is wrong with the server (/health stays ready)
            log.info("request %s: %s", rid, o.error)
            del self._tracked[rid]
            self._finished(o)
            self._send(t, Failed(400, "the request's constraints leave no token to generate: "
                                      + o.error.split(": ", 1)[1], param="allowed_token_ids",
                                 code="constraint_conflict"))
            return
        if o.failed and (o.error or "").startswith(ConstraintTimeout.__name__ + ":"):
            # its constraint's token mask did not arrive in time (constrain.py): a 400 naming it
            msg = o.error.split(": ", 1)[1]
            log.info("request %s: %s", rid, o.error)
            del self._tracked[rid]
            self._finished(o)
            self._send(t, Failed(400, msg, param=msg.split(":", 1)[0], code="constraint_timeout"))
            return
        if o.failed:                              # the engine failed this request's batch: it alone gets the error
            log.error("request %s failed in the engine: %s", rid, o.error or "(no detail)")
            self.errors["request"] += 1
            self._note(f"a request failed in the engine (request id {rid})")
            del self._tracked[rid]
            self._finished(o)
            self._send(t, self._internal(rid))
            return
        if not t.admitted:
            t.admitted, t.cached = True, o.num_cached_tokens
            self._send(t, Admitted(t.cached))
        if o.prompt_logprobs is not None:
            t.prompt_logprobs = list(o.prompt_logprobs)
        if o.new_token_ids or o.text:
            top = None if o.new_top_logprobs is None else [(list(i), list(v)) for i, v in o.new_top_logprobs]
            self._send(t, Delta(o.text, list(o.new_token_ids), list(o.new_logprobs), top, t.prompt_logprobs))
            t.prompt_logprobs = None
        if o.finished:
            self._finished(o)                    # logged and measured before the client hears of it
            self._send(t, Finished(o.finish_reason, o.num_prompt_tokens, o.num_output_tokens, t.cached,
                                   t.prompt_logprobs))
            del self._tracked[rid]               # (the engine forgot it in step())

    def _finished(self, o: StepOutput) -> None:
        """Hand a finished request's output to the `on_finished` observers (their failure is logged,
        never the request's)."""
        for fn in self.on_finished:
            try:
                fn(o)
            except Exception:                     # noqa: BLE001 - observers must not fail requests
                log.exception("an on_finished observer failed for request %s", o.request_id)

    def _fail_all(self, failure: Callable[[str], Failed]) -> None:
        for rid, t in list(self._tracked.items()):
            self._abort(rid)
            self._send(t, failure(rid))
        self._tracked.clear()

    def _update_snapshot(self) -> EngineSnapshot | None:
        """Refresh `snapshot` (what metrics read) from the engine's; returns the engine's snapshot,
        or None when it could not be taken (the previous engine values are kept)."""
        try:
            s = self.engine.snapshot()
        except Exception:                         # noqa: BLE001 - stats must never kill the loop
            log.debug("engine snapshot failed", exc_info=True)
            self.snapshot = {**self.snapshot, "rejected": dict(self.rejected), "errors": dict(self.errors)}
            return None
        n = int(s.kv.get("store_errors", 0) or 0)
        if n > self._store_errors[0]:
            self._store_errors = (n, time.monotonic())
        self.snapshot = {
            "running": s.num_running,
            "waiting": s.num_waiting,
            "kv": s.kv,
            "peak": s.peak,
            "counters": s.counters,
            "rejected": dict(self.rejected),
            "errors": dict(self.errors),
        }
        return s
