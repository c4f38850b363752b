"""The background run of the `ahead` tests (tests/ahead.py): each test's outcome there, passed,
skipped or failed, is what the foreground reports; a test the background run never ran fails."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import ahead

ROOT = Path(__file__).resolve().parents[1]


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
    finally:
        run.stop()
    assert not (tmp_path / "a").exists()                        # its files removed
    assert {n for _, n in run.durations()} == {passes, skips}   # the summary still has them


def test_a_test_the_background_run_never_ran_fails(tmp_path):
    """A background process that ended without reporting the test (it crashed, or could not
    collect it): the foreground fails it, with the background's output."""
    missing = "tests/test_portability.py::test_there_is_no_such_test"
    run = object.__new__(ahead.Ahead)                 # the state of one whose process has ended
    run.nodeids, run.workdir, run._final = [missing], tmp_path, None
    run.report, run.log_path = tmp_path / "outcomes.jsonl", tmp_path / "pytest.log"
    run.report.touch()
    run.log_path.write_text("ERROR: not found: " + missing)
    run.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])
    run.proc.wait()
    outcome, why = run.outcome(missing, timeout=60)
    assert outcome == "failed" and "(exit 4) ended without running it" in why and "not found" in why, why

    class Item:
        nodeid = missing
    with pytest.raises(pytest.fail.Exception, match="ended without running it"):
        ahead.replay(run, Item())


def test_ahead_tests_come_last_in_their_order():
    class Item:
        def __init__(self, name, marked):
            self.nodeid, self.marked = name, marked

        def get_closest_marker(self, name):
            return object() if self.marked and name == "ahead" else None
    items = [Item("a", True), Item("b", False), Item("c", True), Item("d", False)]
    assert ahead.ahead_last(items) == ["a", "c"]
    assert [i.nodeid for i in items] == ["b", "d", "a", "c"]
