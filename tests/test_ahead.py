"""The background run of the `ahead` tests (tests/ahead.py): each test's outcome there, passed,
skipped or failed, is what the foreground reports; a test the background run never ran fails."""
from __future__ import annotations

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
    missing = "tests/test_portability.py::test_there_is_no_such_test"
    (tmp_path / "b").mkdir()
    run = ahead.Ahead(ROOT, [missing], tmp_path / "b")
    try:
        outcome, why = run.outcome(missing, timeout=300)
    finally:
        run.stop()
    assert outcome == "failed" and "ended without running it" in why, why
    with pytest.raises(pytest.fail.Exception, match="ended without running it"):
        class Item:
            nodeid = missing
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
