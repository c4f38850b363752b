"""Sampling defaults: a request that leaves temperature / top_p / top_k / min_p /
repetition_penalty unset gets the model's generation_config.json values (as vLLM's
`--generation-config auto`); a request's own value wins; without a file the neutral values apply.
The shipped model's file carries the defaults chosen for it (docs/serving.md, "Sampling defaults").
"""
from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from cedlm.engine.loader import DEFAULT_MODEL  # noqa: E402
from cedlm.server.cli import sampling_defaults_of  # noqa: E402
from cedlm.server.constrain import MinPProcessor  # noqa: E402
from cedlm.engine.sampling_defaults import NEUTRAL, describe, read  # noqa: E402
from cedlm.train.model_card import GENERATION_DEFAULTS  # noqa: E402


def test_read_follows_transformers(tmp_path):
    assert read(None) == {} and read(tmp_path) == {}            # no file: nothing
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1,
         "min_p": True, "max_new_tokens": 10, "eos_token_id": 1}))
    assert read(tmp_path) == {"temperature": 0.5, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1}
    assert isinstance(read(tmp_path)["top_k"], int)
    (tmp_path / "g.json").write_text(json.dumps({"do_sample": False, "temperature": 0.7}))
    assert read(tmp_path / "g.json") == {"temperature": 0.0}    # greedy, as transformers reads it
    assert describe({"temperature": 1.0}) == "none" and describe({"temperature": 0.0, "top_k": 0}) == "temperature 0"


def test_the_shipped_model_has_the_chosen_defaults():
    got = read(DEFAULT_MODEL)
    want = {k: v for k, v in GENERATION_DEFAULTS.items() if k in NEUTRAL}
    if GENERATION_DEFAULTS.get("do_sample") is False:
        want["temperature"] = 0.0
    assert got == want
    assert got.get("temperature", 1.0) < 1.0               # not the noise of plain sampling
    assert sampling_defaults_of(argparse.Namespace(model=None, generation_config="auto")) == got
    assert sampling_defaults_of(argparse.Namespace(model=None, generation_config="none")) == {}
    assert sampling_defaults_of(argparse.Namespace(model="tiny", generation_config="auto")) == {}
    with pytest.raises(ValueError, match="generation_config"):
        sampling_defaults_of(argparse.Namespace(model=None, generation_config="/nonexistent/x"))


class Body:
    """A request body with only the given fields set (every other one None)."""

    def __init__(self, **kw):
        self.__dict__.update({"ignore_eos": False, "include_stop_str_in_output": False,
                              "skip_special_tokens": True, **kw})

    def __getattr__(self, name):
        return None


@pytest.fixture(scope="module")
def apps():
    from cedlm.engine.llm import LLM
    from cedlm.server.app import create_app

    def llm():
        return LLM("tiny", kv_budget_bytes=16 << 20, num_threads=1)
    return (create_app(llm(), served_model_name="m"),
            create_app(llm(), served_model_name="m", sampling_defaults={"temperature": 0.0}),
            create_app(llm(), served_model_name="m", sampling_defaults={
                "temperature": 0.6, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1}))


def test_unset_fields_take_the_defaults(apps):
    neutral, _, tuned = (a.state.server for a in apps)
    sp = neutral.params(Body(), [5, 6], 8, None)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty) == (1.0, 1.0, 0, 1.0)
    assert not sp.logits_processors
    sp = tuned.params(Body(), [5, 6], 8, None)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty) == (0.6, 0.9, 40, 1.1)
    assert any(isinstance(p, MinPProcessor) for p in sp.logits_processors)
    sp = tuned.params(Body(temperature=1.2, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0), [5, 6], 8, None)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty) == (1.2, 1.0, 0, 1.0)   # the request wins
    assert not sp.logits_processors


def test_a_request_without_temperature_is_greedy_under_a_greedy_default(apps):
    from starlette.testclient import TestClient
    neutral, greedy, _ = apps

    def text(app, **kw):
        with TestClient(app) as c:
            r = c.post("/v1/completions", json={"model": "m", "prompt": "The", "max_tokens": 8, "ignore_eos": True, **kw})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

    want = text(neutral, temperature=0)
    assert text(greedy, seed=1) == text(greedy, seed=2) == want
    assert text(greedy, temperature=1.0, seed=3) == text(neutral, temperature=1.0, seed=3)
    with TestClient(greedy) as c:                # the Responses object reports the temperature used
        r = c.post("/v1/responses", json={"model": "m", "input": "Hi", "max_output_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["temperature"] == 0.0


def test_llm_without_sampling_params_uses_the_model_defaults(tmp_path):
    """`LLM.generate` / `chat` given no sampling parameters sample with the model directory's
    generation_config.json (its temperature, top_p, top_k, repetition_penalty), as vLLM's LLM does;
    a preset has none."""
    from cedlm import LLM, SamplingParams
    llm = LLM(decode_step="static")
    sp = llm.default_sampling_params()
    assert (sp.temperature, sp.top_p) == (read(DEFAULT_MODEL)["temperature"], read(DEFAULT_MODEL)["top_p"])
    assert sp.max_tokens == SamplingParams().max_tokens
    out = llm.generate("It is a truth", None)[0]
    assert out.outputs[0].token_ids == out.token_ids
    assert LLM("tiny").default_sampling_params() == SamplingParams()
