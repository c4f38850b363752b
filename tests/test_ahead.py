"""The background pytest process (tests/ahead.py): each test's outcome there, passed, skipped or
failed, is what the foreground reports; a test the background run never ran fails; a shared
file runs whole in whichever process claims it first; files marked `foreground` stay there."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


from tests import ahead

ROOT = Path(__file__).resolve().parents[1]


class Item:
    def __init__(self, nodeid, *marks):
        self.nodeid, self.marks = nodeid, marks

    def get_closest_marker(self, name):
        return object() if name in self.marks else None


def test_outcomes_of_the_background_run_are_reported(tmp_path):
    passes = "tests/test_portability.py::test_the_subset_exists"
    skips = "tests/test_compiled_step.py::test_compiled_step_matches_reference_every_layer_kind[cuda]"
    (tmp_path / "a").mkdir()
    run = ahead.Ahead(ROOT, [passes, skips], tmp_path / "a")
    try:
        assert run.outcome(passes, timeout=300) == ("passed", "")
        outcome, why = run.outcome(skips, timeout=300)
        assert outcome == "skipped" and "cuda" in why.lower(), why
        assert {n for _, n in run.durations()} == {passes, skips}
        assert [p["when"] for p in run.phases(passes)] == ["setup", "call", "teardown"]
    finally:
        run.stop()
    assert not (tmp_path / "a").exists()                        # its files removed
    assert {n for _, n in run.durations()} == {passes, skips}   # the summary still has them


def test_a_test_the_background_run_never_ran_fails(tmp_path):
    """A background process that ended without reporting the test (it crashed, or could not
    collect it): the foreground fails it, with the background's output."""
    missing = "tests/test_portability.py::test_there_is_no_such_test"
    run = object.__new__(ahead.Ahead)                 # the state of one whose process has ended
    run.nodeids, run.workdir, run._final, run.waited = [missing], tmp_path, None, 0.0
    run._read, run._seen = 0, {}
    run.report, run.log_path = tmp_path / "outcomes.jsonl", tmp_path / "pytest.log"
    run.report.touch()
    run.log_path.write_text("ERROR: not found: " + missing)
    run.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])
    run.proc.wait()
    outcome, why = run.outcome(missing, timeout=60)
    assert outcome == "failed" and "(exit 4) ended without running it" in why and "not found" in why, why


def test_ahead_tests_come_last_in_their_order():
    items = [Item("a", "ahead"), Item("b"), Item("c", "ahead"), Item("d")]
    assert ahead.ahead_last(items) == ["a", "c"]
    assert [i.nodeid for i in items] == ["b", "d", "a", "c"]


def test_shared_units_last_first_without_foreground_units_or_ahead_tests():
    items = [Item("t/x.py::a"), Item("t/x.py::b"), Item("t/y.py::a", "foreground"), Item("t/y.py::b"),
             Item("t/z.py::a"), Item("t/z.py::b", "ahead")]
    assert ahead.shareable(items) == {"t/z.py::a": "t/z.py", "t/x.py::a": "t/x.py", "t/x.py::b": "t/x.py"}


def test_files_that_share_a_session_fixture_are_one_unit(request):
    """bench_quick (conftest, session scope) is set up once per process: the files using it are
    claimed together, tried where the last of them stands, each file's items in order; a unit
    with a foreground file stays in the foreground."""
    session = request.session

    def item(nodeid, *marks, uses=()):
        it = Item(nodeid, *marks)
        it._fixtureinfo = request.node._fixtureinfo.__class__(
            argnames=tuple(uses), initialnames=tuple(uses), names_closure=list(uses),
            name2fixturedefs={n: session._fixturemanager.getfixturedefs(n, request.node) for n in uses})
        return it
    items = [item("t/a.py::x", uses=["bench_quick"]), item("t/b.py::x"), item("t/c.py::x", uses=["bench_quick"]),
             item("t/d.py::x", uses=["tmp_path_factory"]), item("t/e.py::x", uses=["tmp_path_factory"])]
    assert list(ahead.shareable(items).items()) == [
        ("t/e.py::x", "t/e.py"), ("t/d.py::x", "t/d.py"),         # a plugin's session fixture: no unit
        ("t/a.py::x", "t/a.py"), ("t/c.py::x", "t/a.py"), ("t/b.py::x", "t/b.py")]
    items[1] = item("t/b.py::x", "foreground", uses=["bench_quick"])
    assert list(ahead.shareable(items)) == ["t/e.py::x", "t/d.py::x"]


def test_a_unit_is_claimed_once(tmp_path):
    assert ahead.claim(tmp_path, "tests/test_x.py")
    assert not ahead.claim(tmp_path, "tests/test_x.py")
    assert ahead.claim_path(tmp_path, "tests/test_x.py").exists()
    mine, theirs = ahead.Claims(tmp_path), ahead.Claims(tmp_path)
    assert mine.ours("tests/test_y.py") and not theirs.ours("tests/test_y.py")
    assert mine.ours("tests/test_y.py") and not theirs.ours("tests/test_y.py")   # the same answer again


def test_a_run_shares_its_files_with_the_background_process(tmp_path):
    """Three files; the first holds the foreground until the background has claimed the last:
    every outcome (a failure with its captured output, a skip with its reason) reported once,
    by the foreground, whichever process ran it."""
    files = [f"tests/fixtures/ahead/case_{n}.py" for n in ("first", "middle", "last")]
    env = {k: v for k, v in os.environ.items() if k != ahead.PLAN_ENV}
    env[ahead.ENV] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=",
                             "-rfs", f"--junitxml={tmp_path / 'junit.xml'}", *files],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 1, out
    assert re.search(r"1 failed, 3 passed, 2 skipped", out), out
    assert "a reason at the end" in out and (tmp_path / "junit.xml").exists(), out
    assert "in the background process (tests/ahead.py)" in out and "assert (1 + 1) == 3" in out, out
    pid = re.search(r"captured in process (\d+)", out)
    assert pid and int(pid.group(1)) != proc.pid, out          # it ran in the other process
    assert "a reason in the middle" in out, out
    m = re.search(r"0 ahead tests and ([0-9]+) of 3 shared units ran there", out)
    assert m and 1 <= int(m.group(1)) <= 2, out
    assert out.count("test_last_fails") <= 3, out      # reported once (its line in the summary)
