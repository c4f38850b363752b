"""The one thread that owns the engine.

The Engine is not thread-safe, so nothing but this thread touches it. HTTP handlers (on the
asyncio loop) talk to it through a thread-safe command queue (`submit`, `abort`, `call`); the
thread steps the engine while there is work and publishes each request's progress to that
request's asyncio.Queue with `loop.call_soon_threadsafe`:

    Admitted(cached_tokens)        the scheduler took it (KV reserved); always first, unless Failed
    Delta(text, token_ids, ...)    growth since the last event (text = growth of Request.text)
    Finished(reason, ...)          last event
    Failed(status, message, ...)   instead of any of the above (400 rejected, 429 full, 500)

Admission control: at most `max_waiting` requests wait in the scheduler when the engine cannot
admit at once (more -> 429 at submit), and a request not admitted within `queue_timeout` seconds
is withdrawn (429). Both carry `retry_after` seconds.

The engine is read only through its public surface: `add_request`, `abort` (which also forgets
the request), `step` (which forgets the requests that finished), `has_work` and `snapshot()`;
`snapshot` here is the last engine snapshot as a dict, plus the 429 counts, for the metrics.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from cedlm.engine.request import Status
from cedlm.engine.scheduler import RequestRejected

if TYPE_CHECKING:
    from cedlm.engine.engine import EngineSnapshot

log = logging.getLogger("cedlm.server")


@dataclass
class Admitted:
    cached_tokens: int


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[tuple[list[int], list[float]]] | None


@dataclass
class Finished:
    reason: str
    num_prompt: int
    num_output: int
    cached_tokens: int


@dataclass
class Failed:
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = "invalid_request_error"
    retry_after: int | None = None


@dataclass
class _Track:
    req: Any
    q: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    submitted: float
    admitted: bool = False
    cached: int = 0
    sent_text: int = 0
    sent_tokens: int = 0


@dataclass
class _Submit:
    request_id: str
    prompt_ids: list[int]
    params: Any
    q: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    submitted: float = field(default_factory=time.monotonic)


def _param_of(message: str) -> str | None:
    head = message.split(":", 1)[0].split(" ", 1)[0].strip()
    return head if head.isidentifier() else None


class EngineWorker:
    def __init__(self, engine, *, max_waiting: int | None = None, queue_timeout: float | None = 30.0,
                 retry_after: int = 1):
        self.engine = engine
        self.max_waiting = max_waiting
        self.queue_timeout = queue_timeout
        self.retry_after = max(1, int(retry_after))
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._tracked: dict[str, _Track] = {}
        self._thread: threading.Thread | None = None
        self.rejected = {"queue_full": 0, "queue_timeout": 0}
        self.snapshot: dict = {}
        self._update_snapshot()

    # ------------------------------------------------------------ handler side (any thread)
    def start(self) -> None:
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="cedlm-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._stop = True
            self._wake.set()
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, request_id: str, prompt_ids: list[int], params) -> asyncio.Queue:
        """Queue a request; returns the asyncio.Queue its events arrive on (call from the loop)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._cmds.put(("add", _Submit(request_id, list(prompt_ids), params, q, loop)))
        self._wake.set()
        return q

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))
        self._wake.set()

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread; a Future of its result (for tests and tools)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(("call", (fn, fut)))
        self._wake.set()
        return fut

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        eng = self.engine
        while not self._stop:
            if not eng.has_work and self._cmds.empty():
                self._wake.wait()
            self._wake.clear()
            self._drain()
            if self._stop:
                break
            self._expire()
            progressed = True
            if eng.has_work:
                try:
                    eng.step()
                except Exception as e:            # the engine's state is suspect: fail everyone
                    log.exception("engine step failed")
                    self._fail_all(Failed(500, f"engine error: {type(e).__name__}: {e}",
                                          type="server_error", code="engine_error"))
                    continue
                progressed = self._publish()
            snap = self._update_snapshot()
            if not progressed and snap is not None and snap.num_running == 0:
                time.sleep(0.001)                 # nothing could move (waiting on memory): don't spin hot
        self._fail_all(Failed(503, "the server is shutting down", type="server_error",
                              code="shutting_down"))
        self._update_snapshot()

    def _send(self, t, ev) -> None:
        try:
            t.loop.call_soon_threadsafe(t.q.put_nowait, ev)
        except RuntimeError:                      # the handler's loop is gone
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
                    self.engine.abort(arg)
            elif kind == "call":
                fn, fut = arg
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(self.engine))
                    except BaseException as e:   # noqa: BLE001 - handed to the caller
                        fut.set_exception(e)

    def _queue_full(self) -> EngineSnapshot | None:
        """The engine's snapshot when the request must be refused: the waiting queue is at its
        bound and the engine cannot admit at once; None when it may be queued."""
        if self.max_waiting is None:
            return None
        s = self.engine.snapshot()
        cannot_admit_now = s.num_waiting > 0 or s.num_running >= s.max_num_seqs
        return s if s.num_waiting >= self.max_waiting and cannot_admit_now else None

    def _add(self, sub: _Submit) -> None:
        s = self._queue_full()
        if s is not None:
            self.rejected["queue_full"] += 1
            self._send(sub, Failed(
                429, f"the server is full: {s.num_running} requests running (max_num_seqs "
                     f"{s.max_num_seqs}) and {s.num_waiting} waiting (queue bound {self.max_waiting}); "
                     f"retry after {self.retry_after} s",
                code="rate_limit_exceeded", type="rate_limit_error", retry_after=self.retry_after))
            return
        try:
            req = self.engine.add_request(sub.prompt_ids, sub.params, sub.request_id)
        except RequestRejected as e:
            msg = str(e)
            code = "context_length_exceeded" if "max_model_len" in msg else "request_too_large"
            self._send(sub, Failed(400, msg, param=_param_of(msg), code=code))
            return
        except ValueError as e:
            msg = str(e)
            self._send(sub, Failed(400, msg, param=_param_of(msg)))
            return
        self._tracked[sub.request_id] = _Track(req, sub.q, sub.loop, sub.submitted)

    def _expire(self) -> None:
        if self.queue_timeout is None:
            return
        now = time.monotonic()
        for rid, t in list(self._tracked.items()):
            if not t.admitted and t.req.status is Status.WAITING and not t.req.output_ids \
                    and now - t.submitted > self.queue_timeout:
                self.engine.abort(rid)
                del self._tracked[rid]
                self.rejected["queue_timeout"] += 1
                self._send(t, Failed(
                    429, f"the server is full: the request was not admitted within the queue timeout "
                         f"({self.queue_timeout:g} s); retry after {self.retry_after} s",
                    code="rate_limit_exceeded", type="rate_limit_error", retry_after=self.retry_after))

    def _publish(self) -> bool:
        progressed = False
        for rid, t in list(self._tracked.items()):
            r = t.req
            if not t.admitted and (r.status is not Status.WAITING or r.output_ids or r.finished):
                t.admitted, t.cached = True, r.num_prefix_hit
                self._send(t, Admitted(t.cached))
                progressed = True
            n = len(r.output_ids)
            if n > t.sent_tokens or len(r.text) > t.sent_text:
                top = None
                if r.params.logprobs:
                    top = [(ids.tolist(), lps.tolist()) for ids, lps in r.top_logprobs[t.sent_tokens:n]]
                self._send(t, Delta(r.text[t.sent_text:], r.output_ids[t.sent_tokens:n],
                                    r.output_logprobs[t.sent_tokens:n], top))
                t.sent_text, t.sent_tokens = len(r.text), n
                progressed = True
            if r.finished:
                self._send(t, Finished(r.finish_reason or "stop", len(r.prompt_ids), n, t.cached))
                del self._tracked[rid]           # (the engine forgot it in step())
                progressed = True
        return progressed

    def _fail_all(self, failure: Failed) -> None:
        for rid, t in list(self._tracked.items()):
            try:
                self.engine.abort(rid)
            except Exception:                     # noqa: BLE001 - best effort while failing
                log.exception("abort of %s failed", rid)
            self._send(t, failure)
        self._tracked.clear()

    def _update_snapshot(self) -> EngineSnapshot | None:
        """Refresh `snapshot` (what metrics read) from the engine's; returns the engine's snapshot,
        or None when it could not be taken (the previous engine values are kept)."""
        try:
            s = self.engine.snapshot()
        except Exception:                         # noqa: BLE001 - stats must never kill the loop
            log.debug("engine snapshot failed", exc_info=True)
            self.snapshot = {**self.snapshot, "rejected": dict(self.rejected)}
            return None
        self.snapshot = {
            "running": s.num_running,
            "waiting": s.num_waiting,
            "kv": s.kv,
            "peak": s.peak,
            "counters": s.counters,
            "rejected": dict(self.rejected),
        }
        return s
