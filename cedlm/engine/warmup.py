"""Compiling the engine's graphs off the serving path.

A compiled step (`CompiledDecode`, and with DSpark the verify and draft steps) needs its graphs
built by torch.compile before it runs: minutes on a cold 2-core machine, seconds from the on-disk
cache. `BackgroundCompile` lets the engine serve meanwhile:

    bg = BackgroundCompile(jobs, log)     # jobs: (label, callable that builds one graph)
    bg.start()                            # a daemon thread at low priority (nice 5)
    ...                                   # the engine steps on the uncompiled step
    if bg.done: ...                       # the engine adopts the graphs at a step boundary

The uncompiled step is the same function as the compiled one (the exactness tests pin their
outputs), so a request that starts on one and ends on the other gets the same tokens. Each job
runs the compiled function once on scratch inputs prepared by the engine's thread before the
start (no block is allocated from this thread); the engine frees them after adopting. Progress
is logged as vLLM logs its compile phases, with an estimate from the last compile on this machine
(`~/.cache/cedlm/compile_times.json`), and read by `/health` (`status()`).
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from cedlm.util import cache_root, freeze_heap

log = logging.getLogger(__name__)

NICE = 5                    # the compile thread's (and its compiler processes') niceness
# While the compile thread traces (pure Python, holding the GIL), a serving thread that releases
# the GIL in each torch op waits up to the interpreter's switch interval (5 ms) to get it back, per
# op: hundreds of ops per decode step. A shorter interval while compiling bounds that wait.
SWITCH_INTERVAL_S = 0.00002
HEARTBEAT_S = 30.0          # a "still compiling" line this often


def times_path() -> Path:
    return cache_root() / "compile_times.json"


def _load_times() -> dict[str, float]:
    try:
        got = json.loads(times_path().read_text())
        return {str(k): float(v) for k, v in got.items()} if isinstance(got, dict) else {}
    except (OSError, ValueError, TypeError):
        return {}


def _save_times(times: dict[str, float]) -> None:
    path = times_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(times, indent=1, sort_keys=True))
        os.replace(tmp, path)                      # readers see the old file or the new one
    except OSError:
        pass                                       # an estimate is a nicety, never an error


class BackgroundCompile:
    """Runs `jobs` [(label, fn)] one after another in a daemon thread; `done` once all ran (a
    job that raises is logged and counted as failed: its step stays uncompiled)."""

    def __init__(self, jobs: list[tuple[str, Callable[[], object]]], key: str = "",
                 log_line: Callable[[str], None] | None = None):
        self.jobs = list(jobs)
        self.total = len(self.jobs)
        self.key = key                 # what the estimates are kept under (model and threads)
        self.say = log_line or log.info
        self.current: str | None = None
        self.index = 0                 # jobs finished
        self.failed: list[str] = []
        self.seconds: dict[str, float] = {}
        self.started = self.job_started = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def start(self) -> "BackgroundCompile":
        if not self.jobs:
            self._done.set()
            return self
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch, SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._run, name="cedlm-compile", daemon=True)
        self._thread.start()
        return self

    def status(self) -> str | None:
        """What is compiling now, for /health ("decode graph 1/2 (batch 1), 42 s of about 180 s"),
        or None when nothing is."""
        current, index, started = self.current, self.index, self.job_started
        if self.done or current is None or started is None:
            return None
        so_far = time.monotonic() - started
        est = _load_times().get(self._est_key(current))
        about = f" of about {est:.0f} s" if est else ""
        return f"{current} ({index + 1}/{self.total}), {so_far:.0f} s{about}"

    def _est_key(self, label: str) -> str:
        return f"{self.key} {label}".strip()

    def _run(self) -> None:
        try:
            self._run_jobs()
        except Exception as e:                             # never leave `done` unset
            log.warning("background compile stopped (%s: %s)", type(e).__name__, e)
            self.failed.append("background compile")
        finally:
            self.index, self.current = self.total, None
            sys.setswitchinterval(self._switch)
            self._done.set()

    def _run_jobs(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)   # this thread only
        except (OSError, AttributeError):
            pass
        times = _load_times()
        self.started = time.monotonic()
        n = len(self.jobs)
        for i, (label, fn) in enumerate(self.jobs):
            self.current, self.index, self.job_started = label, i, time.monotonic()
            est = times.get(self._est_key(label))
            self.say(f"compiling {label} ({i + 1}/{n}) in the background; "
                     + (f"about {est:.0f} s (the last compile here)" if est else
                        "the first compile on this machine takes minutes (then cached on disk)")
                     + "; the uncompiled step runs meanwhile")
            beat = threading.Event()
            ticker = threading.Thread(target=self._heartbeat, args=(label, i, n, beat), daemon=True)
            ticker.start()
            try:
                fn()
            except Exception as e:                         # the step stays uncompiled
                self.failed.append(label)
                log.warning("compiling %s failed (%s: %s); it keeps running uncompiled", label,
                            type(e).__name__, (str(e).strip().splitlines() or [""])[0][:200])
            finally:
                beat.set()
            sec = time.monotonic() - self.job_started
            self.seconds[label] = sec
            if label not in self.failed:
                times[self._est_key(label)] = round(sec, 1)
                self.say(f"compiled {label} ({i + 1}/{n}) in {sec:.1f} s")
        _save_times(times)
        freeze_heap(collect=False)      # the graphs and the compiler's state: out of every full collection
        self.say(f"background compile finished in {time.monotonic() - self.started:.1f} s; the "
                 f"engine switches to the compiled step at its next step")

    def _heartbeat(self, label: str, i: int, n: int, stop: threading.Event) -> None:
        while not stop.wait(HEARTBEAT_S):
            self.say(f"still compiling {label} ({i + 1}/{n}): "
                     f"{time.monotonic() - self.job_started:.0f} s so far")
