"""Run the suite on both cores: a background pytest process beside the foreground one.

The suite runs its tensors on one thread (conftest.py), so on a 2-core machine one core would be
idle for most of a run. When a run selects tests from more than one file, the suite starts one
background pytest process at collection, at nice 10, that runs

1. the tests marked `ahead`, in order: each runs one long process (torch.compile of a decode
   graph, the kernels built from an installed wheel, the numerics files re-run under other
   instruction sets), which the foreground would otherwise wait for;
2. then the selected test files it may share, from the last file to the first, while the
   foreground runs them from the first. A file runs whole in one process, and so do files that
   use one session-scoped conftest fixture (set up once per process: `bench_quick` is a minute
   of benchmarks): a unit. Whichever process reaches a unit first claims it (an exclusive create
   in the run's claims folder) and the other passes it by. A unit with a file marked
   `foreground` (its tests time wall-clock gaps and latencies, which the foreground, at normal
   priority, measures faithfully) is never shared.

The foreground moves the `ahead` tests to its end. For each `ahead` test and each test of a unit
the background claimed, it waits for that test's outcome there and reports it as its own,
phase by phase, without running the test or its fixtures: passed, failed with the background
run's failure text and captured output, or skipped with its reason. A test runs once either way
and can fail either way; a test the background run never reached fails.

`CEDLM_AHEAD=0` runs everything in the foreground; so do a single-CPU machine, `--collect-only`,
a run of one file, and a run that selects only `ahead` tests. The background process runs with
`CEDLM_AHEAD=0` (nothing nested starts another) and follows the plan file named by
`CEDLM_AHEAD_PLAN`; this module is its plugin.
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
from _pytest.reports import TestReport

ENV = "CEDLM_AHEAD"
PLAN_ENV = "CEDLM_AHEAD_PLAN"        # set in the background process: its plan (JSON)
MARK = "ahead"
STAY = "foreground"
WAIT_S = 3600.0                       # the most the foreground waits for one test's outcome
NICE = 10


def wanted(config) -> bool:
    return (os.environ.get(ENV, "1").strip() != "0" and (os.cpu_count() or 1) >= 2
            and not config.option.collectonly and not os.environ.get(PLAN_ENV))


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def ahead_last(items: list) -> list[str]:
    """Move the `ahead` items to the end, in their order (in place); their node ids."""
    marked = [it for it in items if it.get_closest_marker(MARK)]
    if marked:
        items[:] = [it for it in items if not it.get_closest_marker(MARK)] + marked
    return [it.nodeid for it in marked]


def _session_fixtures(item) -> set[str]:
    """The session-scoped fixtures of a conftest that `item` uses (set up once per process)."""
    info = getattr(item, "_fixtureinfo", None)
    out = set()
    for name, defs in (info.name2fixturedefs.items() if info is not None else ()):
        func = getattr(defs[-1], "func", None)
        code = getattr(func, "__code__", None)
        if defs[-1].scope == "session" and code is not None and code.co_filename.endswith("conftest.py"):
            out.add(name)
    return out


def shareable(items: list) -> dict[str, str]:
    """The items the background may take, in the order it tries them, each with its unit (what
    is claimed as a whole): a file, or the files that use one session-scoped conftest fixture
    (set up once per process, so they run in one), named by its first file. Never `ahead`
    items, nor a unit one of whose selected items is marked `foreground`. Units from the last to
    the first (by their last file), each unit's files in order."""
    files: dict[str, list] = {}
    for it in items:
        files.setdefault(file_of(it.nodeid), []).append(it)
    pos = {f: i for i, f in enumerate(files)}
    parent = {f: f for f in files}

    def root(f):
        while parent[f] != f:
            f = parent[f]
        return f
    by_fixture: dict[str, str] = {}
    for f, its in files.items():
        for name in set().union(*(_session_fixtures(it) for it in its)):
            if name in by_fixture:
                a, b = sorted((root(by_fixture[name]), root(f)), key=pos.get)
                parent[b] = a
            else:
                by_fixture[name] = f
    units: dict[str, list[str]] = {}
    for f in files:
        units.setdefault(root(f), []).append(f)
    stay = {root(file_of(it.nodeid)) for it in items if it.get_closest_marker(STAY)}
    out: dict[str, str] = {}
    for unit in sorted((u for u in units if u not in stay), key=lambda u: -pos[units[u][-1]]):
        for f in units[unit]:
            out.update((it.nodeid, unit) for it in files[f] if not it.get_closest_marker(MARK))
    return out


def claim_path(folder: Path, unit: str) -> Path:
    return folder / unit.replace("/", "__").replace(os.sep, "__")


def claim(folder: Path, unit: str) -> bool:
    """Claim `unit` for this process: True for the first caller of either process, once."""
    try:
        os.close(os.open(claim_path(folder, unit), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        return False


class Claims:
    """One process's side of the claims folder: `ours(unit)` claims a unit the first time this
    process asks and then answers the same."""

    def __init__(self, folder: Path):
        self.folder, self.mine, self.theirs = folder, set(), set()

    def ours(self, unit: str) -> bool:
        if unit not in self.mine and unit not in self.theirs:
            (self.mine if claim(self.folder, unit) else self.theirs).add(unit)
        return unit in self.mine


# ------------------------------------------------------------------ the background process's side
class _Follow:
    """(Background process) the plan: which items to run, in which order, what to claim first."""

    def __init__(self, path: str):
        plan = json.loads(Path(path).read_text(encoding="utf-8"))
        self.ahead, self.shared = set(plan["ahead"]), dict(plan["shared"])
        self.order = {n: i for i, n in enumerate([*plan["ahead"], *self.shared])}
        self.claims, self.report = Claims(Path(plan["claims"])), Path(plan["report"])
        self.config = None


_follow = _Follow(os.environ[PLAN_ENV]) if os.environ.get(PLAN_ENV) else None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """(Background process) exactly the plan's items, in its order."""
    if _follow is None:
        return
    order = _follow.order
    items[:] = sorted((it for it in items if it.nodeid in order), key=lambda it: order[it.nodeid])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """(Background process) run a shared unit's items only once this process has claimed it."""
    if _follow is None or item.nodeid in _follow.ahead or _follow.claims.ours(_follow.shared[item.nodeid]):
        return None
    return True                                   # the foreground runs it


def pytest_configure(config):
    if _follow is not None:
        _follow.config = config


def pytest_runtest_logreport(report):
    """(Background process) one JSON line per report (a phase, or a subtest's): the report as
    pytest serializes it for another process (as pytest-xdist sends them), and its outcome."""
    if _follow is None:
        return
    text = ""
    if report.skipped and isinstance(report.longrepr, tuple):
        text = str(report.longrepr[2])                # the skip reason
    elif report.failed:
        text = report.longreprtext[-6000:]            # (the whole report, sections too, is below)
    with open(_follow.report, "a", encoding="utf-8") as f:
        f.write(json.dumps({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                            "duration": report.duration, "text": text,
                            "report": _follow.config.hook.pytest_report_to_serializable(
                                config=_follow.config, report=report)}, default=str) + "\n")


# ------------------------------------------------------------------ the foreground's side
class Ahead:
    """The background pytest process over the `ahead` node ids and the shared ones;
    `theirs(nodeid)` says whether the foreground should report its outcome from there,
    `phases(nodeid)` waits for it."""

    def __init__(self, rootdir: Path, nodeids: list[str], workdir: Path,
                 shared: dict[str, str] | None = None):
        self.nodeids, self.shared, self.workdir, self._final = nodeids, dict(shared or {}), workdir, None
        self.report = workdir / "outcomes.jsonl"
        self.log_path = workdir / "pytest.log"
        (workdir / "claims").mkdir()
        self.claims = Claims(workdir / "claims")
        self.report.touch()
        self.waited = 0.0
        self._read, self._seen = 0, {}
        plan = workdir / "plan.json"
        plan.write_text(json.dumps({"ahead": list(nodeids), "shared": list(self.shared.items()),
                                    "claims": str(self.claims.folder), "report": str(self.report)}))
        files = list(dict.fromkeys(file_of(n) for n in [*nodeids, *self.shared]))
        env = {**os.environ, ENV: "0", PLAN_ENV: str(plan)}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.ahead",
                 "-o", "addopts=", "--rootdir", str(rootdir), *files],
                cwd=rootdir, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=lambda: os.nice(NICE))

    def theirs(self, nodeid: str) -> bool:
        """The background runs `nodeid`: an `ahead` test, or one of a unit it claimed (the
        foreground claims each shared unit it reaches first)."""
        if nodeid in self.nodeids:
            return True
        unit = self.shared.get(nodeid)
        return unit is not None and not self.claims.ours(unit)

    def _records(self) -> dict[str, list[dict]]:
        """Every phase the background run has reported so far, by node id (read on from where
        the last call stopped; a line still being written waits for the next call)."""
        if self._final is not None:
            return self._final
        with open(self.report, "rb") as f:
            f.seek(self._read)
            data = f.read()
        done = data.rfind(b"\n") + 1
        self._read += done
        for line in data[:done].decode("utf-8").splitlines():
            if line.strip():
                rec = json.loads(line)
                self._seen.setdefault(rec["nodeid"], []).append(rec)
        return self._seen

    def phases(self, nodeid: str, timeout: float = WAIT_S) -> list[dict]:
        """The background run's reports of nodeid (setup, call, teardown: "when", "outcome",
        "duration", "text"), once its teardown is reported; a failed call if the process ended
        without it or `timeout` passed."""
        start = time.monotonic()
        deadline = start + timeout
        while True:
            ended = self.proc.poll() is not None      # before reading: then all it wrote is there
            phases = self._records().get(nodeid, [])
            if any(p["when"] == "teardown" for p in phases):
                self.waited += time.monotonic() - start
                return phases
            if ended:
                why = (f"the background run (exit {self.proc.returncode}) ended without running "
                       f"it:\n{self._log_tail()}")
            elif time.monotonic() > deadline:
                why = f"no outcome from the background run after {timeout:.0f} s"
            else:
                time.sleep(0.2)
                continue
            return [{"when": "call", "outcome": "failed", "duration": 0.0, "text": why, "ours": True}]

    def outcome(self, nodeid: str, timeout: float = WAIT_S) -> tuple[str, str]:
        """("passed" | "failed" | "skipped", text) of nodeid's background run."""
        phases = self.phases(nodeid, timeout)
        for p in phases:
            if p["outcome"] == "failed":
                return "failed", failure_text(p)
        for p in phases:
            if p["outcome"] == "skipped":
                return "skipped", p["text"]
        return "passed", ""

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def durations(self) -> list[tuple[float, str]]:
        return sorted(((sum(p["duration"] for p in ps), n) for n, ps in self._records().items()),
                      reverse=True)

    def summary(self) -> list[str]:
        """What ran there (seconds there) and how long the foreground waited for it."""
        took = self.claims.theirs
        spent = {}
        for seconds, nodeid in self.durations():
            key = nodeid if nodeid in self.nodeids else file_of(nodeid)
            spent[key] = spent.get(key, 0.0) + seconds
        lines = [f"{seconds:8.2f}s {key}" for key, seconds in
                 sorted(spent.items(), key=lambda kv: -kv[1])]
        return lines + [f"{len(self.nodeids)} ahead tests and {len(took)} of "
                        f"{len(self.claims.mine) + len(took)} shared units ran there; the foreground "
                        f"waited {self.waited:.1f} s for their outcomes"]

    def stop(self) -> None:
        """End the background run (if still running) and remove its files; the outcomes read so
        far are kept for the summary."""
        self._stop_process()
        self._final = dict(self._records())
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


def failure_text(phase: dict) -> str:
    if phase.get("ours"):                         # the foreground's own: the run never reported it
        return phase["text"]
    return f"{phase['when']} failed in the background run:\n{phase['text']}"


def replay(ahead: Ahead, item) -> None:
    """Report the background run's outcome of `item` as this run's, report by report, through the
    same hooks a test run here reports through (terminal, durations, junitxml)."""
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for p in ahead.phases(item.nodeid):
        rep = None
        if "report" in p:
            rep = item.config.hook.pytest_report_from_serializable(config=item.config, data=p["report"])
        if rep is None:
            longrepr = failure_text(p) if p["outcome"] == "failed" else None
            rep = TestReport(item.nodeid, item.location, {k: 1 for k in item.keywords}, p["outcome"],
                             longrepr, p["when"], duration=p["duration"])
        elif rep.failed:
            rep.sections.append(("where", "in the background process (tests/ahead.py)"))
        elif rep.skipped and isinstance(rep.longrepr, list):
            rep.longrepr = tuple(rep.longrepr)    # (path, line, reason): JSON made it a list
        item.ihook.pytest_runtest_logreport(report=rep)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
