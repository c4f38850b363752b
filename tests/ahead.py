"""Run the suite's longest single-process tests on the second core, beside everything else.

The suite runs its tensors on one thread (conftest.py), so on a 2-core machine one core is idle
for most of a run, while a few tests that each run one long process (torch.compile of a decode
graph, the kernels built from an installed wheel, the numerics files re-run under other
instruction sets) are a third of a cold run. Those tests carry the `ahead` marker. When a run
selects them and other tests too, the suite starts one background pytest process at collection,
at nice 10, that runs exactly the selected `ahead` tests, in order, and writes each one's outcome
to a report file (this module is that process's plugin); the foreground run moves the `ahead`
tests to its end and, for each, waits for its outcome and reports it as its own: passed, failed
with the background run's failure text, or skipped with its reason. Their durations, as the
background run measured them, are listed at the end of the run.

A test runs once either way and can fail either way. `CEDLM_AHEAD=0` runs everything in the
foreground; so do a single-CPU machine, `--collect-only`, and a run that selects only `ahead`
tests. The background process runs with `CEDLM_AHEAD=0` (nothing nested starts another).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ENV = "CEDLM_AHEAD"
REPORT_ENV = "CEDLM_AHEAD_REPORT"     # set in the background process: where it writes outcomes
MARK = "ahead"
WAIT_S = 3600.0                       # the most the foreground waits for one test's outcome
NICE = 10


def wanted(config) -> bool:
    return (os.environ.get(ENV, "1").strip() != "0" and (os.cpu_count() or 1) >= 2
            and not config.option.collectonly)


def ahead_last(items: list) -> list[str]:
    """Move the `ahead` items to the end, in their order (in place); their node ids."""
    marked = [it for it in items if it.get_closest_marker(MARK)]
    if marked:
        items[:] = [it for it in items if not it.get_closest_marker(MARK)] + marked
    return [it.nodeid for it in marked]


# ------------------------------------------------------------------ the background process's side
def pytest_runtest_logreport(report):
    """(Plugin of the background process) one JSON line per test phase."""
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    text = ""
    if report.skipped and isinstance(report.longrepr, tuple):
        text = str(report.longrepr[2])                # the skip reason
    elif report.failed:
        text = report.longreprtext[-6000:]
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                            "duration": report.duration, "text": text}) + "\n")


# ------------------------------------------------------------------ the foreground's side
class Ahead:
    """The background pytest process over `nodeids`; `outcome(nodeid)` waits for one."""

    def __init__(self, rootdir: Path, nodeids: list[str], workdir: Path):
        self.nodeids, self.workdir, self._final = nodeids, workdir, None
        self.report = workdir / "outcomes.jsonl"
        self.log_path = workdir / "pytest.log"
        self.report.touch()
        env = {**os.environ, ENV: "0", REPORT_ENV: str(self.report)}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.ahead",
                 "-o", "addopts=", "--rootdir", str(rootdir), *nodeids],
                cwd=rootdir, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=lambda: os.nice(NICE))

    def _phases(self) -> dict[str, list[dict]]:
        if self._final is not None:
            return self._final
        out: dict[str, list[dict]] = {}
        for line in self.report.read_text(encoding="utf-8").splitlines():
            if line.strip():
                rec = json.loads(line)
                out.setdefault(rec["nodeid"], []).append(rec)
        return out

    def outcome(self, nodeid: str, timeout: float = WAIT_S) -> tuple[str, str]:
        """("passed" | "failed" | "skipped", text) of nodeid's background run, once its teardown
        is reported; ("failed", why) if the process ended without it or `timeout` passed."""
        deadline = time.monotonic() + timeout
        while True:
            ended = self.proc.poll() is not None      # before reading: then all it wrote is there
            phases = self._phases().get(nodeid, [])
            if any(p["when"] == "teardown" for p in phases):
                for p in phases:
                    if p["outcome"] == "failed":
                        return "failed", f"{p['when']} failed in the background run:\n{p['text']}"
                for p in phases:
                    if p["outcome"] == "skipped":
                        return "skipped", p["text"]
                return "passed", ""
            if ended:
                return "failed", (f"the background run (exit {self.proc.returncode}) ended without "
                                  f"running it:\n{self._log_tail()}")
            if time.monotonic() > deadline:
                return "failed", f"no outcome from the background run after {timeout:.0f} s"
            time.sleep(0.5)

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def durations(self) -> list[tuple[float, str]]:
        return sorted(((sum(p["duration"] for p in ps), n) for n, ps in self._phases().items()),
                      reverse=True)

    def stop(self) -> None:
        """End the background run (if still running) and remove its files; the outcomes read so
        far are kept for the summary."""
        self._stop_process()
        self._final = self._phases()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _stop_process(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def replay(ahead: Ahead, item) -> None:
    """Report the background run's outcome of `item` as this run's."""
    outcome, text = ahead.outcome(item.nodeid)
    if outcome == "failed":
        pytest.fail(text, pytrace=False)
    if outcome == "skipped":
        pytest.skip(text)
