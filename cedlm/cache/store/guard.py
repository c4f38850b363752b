"""`StoreGuard`: a store used as a cache, never as a dependency.

Wraps any backend (`DirStore`, `RedisStore`, or anything with the `Store` methods) so that no
store call ever raises into the engine: an exception is a cache miss (``get`` -> None, ``put`` ->
False, ``keys`` -> []), counted, and logged at most once per ``log_interval_s`` (the first failure
is logged at once; the ones after it are summed into the next line; breaker openings likewise,
on their own line). How long one call
may take is the backend's business (Redis: socket connect/read timeouts, 1 s by default; a
directory: local file I/O); the guard bounds how often a failing store is tried at all with a
circuit breaker, one for reads (get, keys, stats) and one for writes (put, delete), so a full
disk stops the writes while reads still serve hits:

    closed     calls go through; ``failure_threshold`` consecutive failures -> open
    open       calls are skipped (a miss, no I/O) for ``cooldown_s`` seconds -> half_open
    half_open  one trial call goes through: success -> closed, failure -> open again

A failure to reach the store at all (connection refused or reset, a timeout) counts against both
breakers: a hung Redis costs at most ``failure_threshold`` timeouts before everything is skipped.
Other errors (a full disk, an unreadable file, anything unexpected) count against the breaker of
their own kind. Errors from the caller's own arguments (``TypeError``/``ValueError``, e.g. an
entry larger than the store's capacity) are counted but say nothing about the store's health,
so they move no breaker.

The counters and breaker states are written into a caller-owned dict (``stats=``; the KV cache
manager passes its own ``stats``, which the engine's ``kv_stats()`` and the server export):

    store_errors               calls that raised (each one a miss)
    store_timeouts             ... of which were timeouts
    store_skipped              calls skipped because their breaker was open
    store_breaker_state        "open" if either breaker is open, else "half_open" if either is,
                               else "closed"
    store_breaker_open         1 unless both breakers are closed, else 0 (a gauge)
    store_read_breaker         "closed" | "open" | "half_open"
    store_write_breaker        "closed" | "open" | "half_open"
    store_breaker_trips        times a breaker opened
    store_consecutive_failures the larger of the two breakers' failure runs
"""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
READ, WRITE = "read", "write"

DEFAULT_FAILURE_THRESHOLD = 3
DEFAULT_COOLDOWN_S = 30.0
DEFAULT_LOG_INTERVAL_S = 60.0

_SKIPPED = object()
_KIND = {"get": READ, "keys": READ, "stats": READ, "put": WRITE, "delete": WRITE, "close": WRITE}


def _names(e: BaseException) -> set[str]:
    return {c.__name__ for c in type(e).__mro__}


def _is_timeout(e: BaseException) -> bool:
    # builtin TimeoutError (socket.timeout is an alias) or a client's own (redis.exceptions.TimeoutError)
    return isinstance(e, TimeoutError) or "TimeoutError" in _names(e) or "timeout" in type(e).__name__.lower()


def _is_unreachable(e: BaseException) -> bool:
    """The store could not be reached at all (not an error of one operation)."""
    return isinstance(e, ConnectionError) or _is_timeout(e) or "ConnectionError" in _names(e)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]


class _RateLog:
    """At most one line per interval; what it held back is summed into the next one."""

    def __init__(self, interval_s: float):
        self.interval_s, self.next, self.held, self.last = interval_s, float("-inf"), 0, ""

    def __call__(self, now: float, msg: str) -> str | None:
        if now >= self.next:
            more = f" ({self.held} more since the last report, the last: {self.last})" if self.held else ""
            self.next, self.held = now + self.interval_s, 0
            return msg + more
        self.held, self.last = self.held + 1, msg
        return None


class _Breaker:
    def __init__(self):
        self.state, self.failures, self.open_until, self.trial_running = CLOSED, 0, 0.0, False


class StoreGuard:
    def __init__(self, store, *, failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
                 cooldown_s: float = DEFAULT_COOLDOWN_S, log_interval_s: float = DEFAULT_LOG_INTERVAL_S,
                 stats: dict | None = None, clock=time.monotonic):
        if isinstance(store, StoreGuard):
            store = store.store
        if isinstance(failure_threshold, bool) or not isinstance(failure_threshold, int) or failure_threshold < 1:
            raise ValueError(f"failure_threshold: must be an int >= 1, got {failure_threshold!r}")
        if not cooldown_s >= 0:
            raise ValueError(f"cooldown_s: must be >= 0, got {cooldown_s!r}")
        if not log_interval_s >= 0:
            raise ValueError(f"log_interval_s: must be >= 0, got {log_interval_s!r}")
        self.store = store
        self.failure_threshold, self.cooldown_s, self.log_interval_s = failure_threshold, cooldown_s, log_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._breakers = {READ: _Breaker(), WRITE: _Breaker()}
        self._failure_log, self._breaker_log = _RateLog(log_interval_s), _RateLog(log_interval_s)
        self.counters = stats if stats is not None else {}
        for k in ("store_errors", "store_timeouts", "store_skipped", "store_breaker_trips"):
            self.counters.setdefault(k, 0)
        self._publish()

    # ---------------------------------------------------------------- breakers
    @property
    def state(self) -> str:
        """The overall state (see the module docstring); `breaker_states` has both."""
        self.refresh()
        return self.counters["store_breaker_state"]

    def breaker_states(self) -> dict[str, str]:
        self.refresh()
        return {READ: self.counters["store_read_breaker"], WRITE: self.counters["store_write_breaker"]}

    def refresh(self) -> None:
        """Move breakers whose cool-down is over to half_open (so stats read now are current)."""
        with self._lock:
            self._tick()

    def _tick(self) -> None:
        now, changed = self._clock(), False
        for b in self._breakers.values():
            if b.state == OPEN and now >= b.open_until:
                b.state, b.trial_running, changed = HALF_OPEN, False, True
        if changed:
            self._publish()

    def _publish(self) -> None:
        r, w = self._breakers[READ], self._breakers[WRITE]
        states = {r.state, w.state}
        overall = OPEN if OPEN in states else HALF_OPEN if HALF_OPEN in states else CLOSED
        self.counters.update(store_breaker_state=overall, store_breaker_open=int(overall != CLOSED),
                          store_read_breaker=r.state, store_write_breaker=w.state,
                          store_consecutive_failures=max(r.failures, w.failures))

    def _admit(self, kind: str) -> bool:
        """May a call of this kind go to the store now? (Skipped calls are counted.)"""
        with self._lock:
            self._tick()
            b = self._breakers[kind]
            if b.state == CLOSED:
                return True
            if b.state == HALF_OPEN and not b.trial_running:
                b.trial_running = True
                return True
            self.counters["store_skipped"] += 1
            return False

    def _succeeded(self, kind: str) -> None:
        with self._lock:
            b = self._breakers[kind]
            recovered = b.state != CLOSED
            b.failures, b.state, b.trial_running = 0, CLOSED, False
            self._publish()
        if recovered:
            log.info("store: %r answers %ss again; its %s circuit breaker is closed", self.store, kind, kind)

    def note_failure(self, op: str, key, e: Exception) -> None:
        """Count and (rate-limited) log a failure the caller met using what the store returned
        (e.g. a record that cannot be used); it moves no breaker."""
        self._failed(op, key, e, kinds=())

    def _failed(self, op: str, key, e: Exception, kinds=None) -> None:
        if kinds is None:
            kinds = () if isinstance(e, (TypeError, ValueError)) else \
                (READ, WRITE) if _is_unreachable(e) else (_KIND.get(op, WRITE),)
        opened = []
        with self._lock:
            self.counters["store_errors"] += 1
            if _is_timeout(e):
                self.counters["store_timeouts"] += 1
            now = self._clock()
            for kind in kinds:
                b = self._breakers[kind]
                b.failures += 1
                if b.state == HALF_OPEN and b.trial_running and kind != _KIND.get(op, WRITE):
                    continue                     # the other kind's trial is still out: let it decide
                if b.state == HALF_OPEN or (b.state == CLOSED and b.failures >= self.failure_threshold):
                    b.state, b.trial_running, b.open_until = OPEN, False, now + self.cooldown_s
                    self.counters["store_breaker_trips"] += 1
                    opened.append((kind, b.failures))
            own = self._breakers.get(_KIND.get(op, WRITE))
            if not kinds and own.state == HALF_OPEN:
                own.trial_running = False        # an inconclusive trial: let the next call try
            self._publish()
            what = f"{op}{'' if key is None else ' ' + str(key)[:80]}: {_describe(e)}"
            lines = [self._failure_log(now, f"store: {what} - treated as a cache miss")]
            if opened:
                kinds_s = " and ".join(k for k, _ in opened)
                lines.append(self._breaker_log(now, (
                    f"store: {self.store!r}: {max(n for _, n in opened)} failures in a row; {kinds_s} circuit "
                    f"breaker open, {kinds_s} calls are skipped for {self.cooldown_s:.3g} s")))
        for line in lines:
            if line is not None:
                log.warning(line)

    def _call(self, op: str, key, fn, *args):
        kind = _KIND.get(op, WRITE)
        if not self._admit(kind):
            return _SKIPPED
        try:
            out = fn(*args)
        except Exception as e:                   # noqa: BLE001 - a store failure is a cache miss
            self._failed(op, key, e)
            return _SKIPPED
        self._succeeded(kind)
        return out

    # ---------------------------------------------------------------- Store API (never raises)
    def put(self, key: str, record) -> bool:
        """True when the store took the record; False when it failed or was skipped."""
        return self._call("put", key, self.store.put, key, record) is not _SKIPPED

    def get(self, key: str):
        """The record, or None (absent, corrupt, failed or skipped: all misses)."""
        out = self._call("get", key, self.store.get, key)
        return None if out is _SKIPPED else out

    def delete(self, key: str) -> bool:
        return self._call("delete", key, self.store.delete, key) is not _SKIPPED

    def keys(self) -> list[str]:
        """All keys; [] when the store failed or was skipped (see `keys_or_none`)."""
        out = self.keys_or_none()
        return [] if out is None else out

    def keys_or_none(self) -> list[str] | None:
        out = self._call("keys", None, self.store.keys)
        return None if out is _SKIPPED else list(out)

    def stats(self) -> dict:
        """The backend's own stats (when it answers) plus the guard's counters and breaker states."""
        out = self._call("stats", None, self.store.stats)
        base = {} if out is _SKIPPED else dict(out)
        with self._lock:
            self._tick()
            return {**base, **self.counters}

    def close(self) -> None:
        close = getattr(self.store, "close", None)
        if close is not None:
            self._call("close", None, close)

    def __repr__(self) -> str:
        return f"StoreGuard({self.store!r})"


def guard_store(store, *, stats: dict | None = None, **options) -> StoreGuard | None:
    """None -> None; anything else -> a StoreGuard around it. A StoreGuard is kept as it is (its
    own breaker settings win over ``options``) and, given ``stats``, reports into that dict."""
    if store is None:
        return None
    if isinstance(store, StoreGuard):
        if stats is not None and stats is not store.counters:
            with store._lock:
                stats.update(store.counters)
                store.counters = stats
        return store
    return StoreGuard(store, stats=stats, **options)
