"""StopChecker (cedlm.engine.stop)."""

import pytest

from cedlm.engine.sampling_params import SamplingParams
from cedlm.engine.stop import StopChecker


def _feed(checker, pieces, tokens=None):
    tokens = tokens or [100 + i for i in range(len(pieces))]
    results = [checker.update_delta(t, d) for t, d in zip(tokens, pieces)]
    return results


def test_stop_string_across_two_deltas():
    c = StopChecker(SamplingParams(stop=["STOP"], max_tokens=50), eos_token_id=1)
    r = _feed(c, ["Hello S", "TO", "P and more"])
    assert [x.finished for x in r] == [False, False, True]
    assert r[0].text == "Hello " and r[1].text == ""            # "S", "STO" held back
    assert r[2] == (True, "stop", "")
    assert c.output == "Hello " and c.stop_reason == "STOP"


def test_stop_string_included_in_output():
    c = StopChecker(SamplingParams(stop="STOP", include_stop_str_in_output=True), eos_token_id=1)
    r = _feed(c, ["ab ST", "OP tail"])
    assert r[0] == (False, None, "ab ST")                       # no hold-back needed here
    assert r[1] == (True, "stop", "OP")
    assert c.output == "ab STOP"


def test_stop_string_inside_one_delta_and_full_text_api():
    c = StopChecker(SamplingParams(stop=["\n\n", "END"]), eos_token_id=None)
    assert c.update(5, "one") == (False, None, "one")
    res = c.update(6, "one two END x\n\n")
    assert res == (True, "stop", " two ")                       # earliest match wins
    assert c.stop_reason == "END"


def test_held_back_prefix_released_when_it_stops_matching():
    c = StopChecker(SamplingParams(stop=["</answer>"], max_tokens=50), eos_token_id=1)
    r = _feed(c, ["x </an", "swer", "-not", " ok"])
    assert [x.text for x in r] == ["x ", "", "</answer-not", " ok"]
    assert not any(x.finished for x in r)
    assert c.output == "x </answer-not ok"


def test_hold_back_uses_longest_possible_prefix():
    c = StopChecker(SamplingParams(stop=["aab"], max_tokens=50), eos_token_id=None)
    r = _feed(c, ["xa", "a", "a", "b"])
    # "xa" -> hold "a"; "xaa" -> hold "aa"; "xaaa" -> "aa" still held, one "a" released
    assert [x.text for x in r] == ["x", "", "a", ""]
    assert r[-1].finished and c.output == "xa"


def test_length_releases_held_back_text():
    c = StopChecker(SamplingParams(stop=["STOP"], max_tokens=2), eos_token_id=1)
    r = _feed(c, ["hi", " ST"])
    assert r[0] == (False, None, "hi")
    assert r[1] == (True, "length", " ST")
    assert c.output == "hi ST" and c.num_tokens == 2


def test_max_tokens_length():
    c = StopChecker(SamplingParams(max_tokens=3), eos_token_id=1)
    r = _feed(c, ["a", "b", "c"])
    assert [x.finished for x in r] == [False, False, True]
    assert r[-1].reason == "length" and c.output == "abc"
    with pytest.raises(RuntimeError):
        c.update_delta(5, "d")


def test_stop_token_id():
    c = StopChecker(SamplingParams(stop_token_ids=[42]), eos_token_id=1)
    r = _feed(c, ["a", "b", "<x>"], tokens=[5, 6, 42])
    assert r[-1] == (True, "stop", "") and c.output == "ab" and c.stop_reason == 42
    c = StopChecker(SamplingParams(stop_token_ids=[42], include_stop_str_in_output=True))
    _feed(c, ["a", "<x>"], tokens=[5, 42])
    assert c.output == "a<x>"


def test_eos_vs_ignore_eos():
    c = StopChecker(SamplingParams(max_tokens=10), eos_token_id=1)
    r = _feed(c, ["a", "</s>"], tokens=[5, 1])
    assert r[-1] == (True, "stop", "") and c.output == "a" and c.stop_reason == 1
    c = StopChecker(SamplingParams(max_tokens=3, ignore_eos=True), eos_token_id=1)
    r = _feed(c, ["a", "</s>", "b"], tokens=[5, 1, 6])
    assert [x.finished for x in r] == [False, False, True]
    assert r[-1].reason == "length" and c.output == "a</s>b"
    c = StopChecker(SamplingParams(), eos_token_id=[1, 2])          # several eos ids
    assert c.update_delta(2, "") == (True, "stop", "")


def test_stop_beats_length_on_last_token():
    c = StopChecker(SamplingParams(max_tokens=2, stop=["X"]), eos_token_id=1)
    r = _feed(c, ["a", "bXc"])
    assert r[-1] == (True, "stop", "b")


def test_outside_finish_releases_held_text_and_rejects_shrinking_text():
    c = StopChecker(SamplingParams(stop=["STOP"]), eos_token_id=1)
    assert c.update(5, "go S").text == "go "
    with pytest.raises(ValueError):
        c.update(6, "go")
    assert c.held_back == "S"
    assert c.finish("length") == (True, "length", "S")
    assert c.output == "go S"
