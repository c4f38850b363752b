"""vLLM / OpenAI parity of the server, driven by the real `openai` client.

Prompt scoring the way lm-evaluation-harness's `local-completions` asks for it (echo, max_tokens 0
or 1, logprobs=1, lists of prompts), n / best_of, penalties and logit_bias, refused parameters,
/v1/models/{id}, /tokenize and /detokenize, DeepSeek's `thinking` shape and effort tiers,
--default-max-tokens, and constrained decoding (response_format json_schema / json_object,
tool_choice required / named, streaming tool calls). The model is the `tiny` preset with random
weights: outputs are gibberish, so structured output must be valid because of the grammar alone.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

import torch  # noqa: E402
from test_server import MODEL, client, engine_idle, make_app, serve  # noqa: E402

from cedlm.server.tools import DSMLStream, check_tools  # noqa: E402
from cedlm.text.chat import parse_tool_calls, render_tool_calls  # noqa: E402

MSG = [{"role": "user", "content": "Give me a record."}]
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 8},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}},
                                       "required": ["tz"], "additionalProperties": False}}}


def is_person(v) -> bool:
    return (isinstance(v, dict) and set(v) == {"name", "age", "ok"} and isinstance(v["name"], str)
            and len(v["name"]) <= 6 and type(v["age"]) is int and 0 <= v["age"] <= 99 and type(v["ok"]) is bool)


def is_weather_args(v) -> bool:
    return (isinstance(v, dict) and set(v) == {"city", "days"} and isinstance(v["city"], str)
            and len(v["city"]) <= 8 and type(v["days"]) is int and 1 <= v["days"] <= 7)


@pytest.fixture(scope="module")
def app_base():
    app = make_app(max_num_seqs=8)
    with serve(app) as base:
        yield app, base


@pytest.fixture
def oc(app_base):
    return client(app_base[1])


def post(base, path, body):
    return httpx.post(f"{base}{path}", json=body, timeout=60)


def bad(base, path, body, param):
    r = post(base, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err["message"]


# --------------------------------------------------------------------------- prompt scoring


def reference_logprobs(app, ids: list[int]) -> list[float]:
    """log p(ids[j] | ids[:j]) for j >= 1 from the model's dense forward (no engine)."""
    model = app.state.engine.model
    with torch.no_grad():
        logits = model(torch.tensor([ids]))
        logits = logits[0] if logits.dim() == 3 else logits
    lp = torch.log_softmax(logits.float(), -1)
    return [float(lp[j - 1, ids[j]]) for j in range(1, len(ids))]


def test_echo_scoring_as_lm_eval_sends_it(app_base, oc):
    app, base = app_base
    prompts = [[0, 70, 80, 90, 100, 110], [0, 5, 6, 7], [0, 300, 301, 302, 303, 304, 305, 306]]
    r = oc.completions.create(model=MODEL, prompt=prompts, echo=True, max_tokens=0, logprobs=1, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c, ids in zip(r.choices, prompts):
        lp = c.logprobs
        assert len(lp.tokens) == len(ids) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(x <= 0 for x in lp.token_logprobs[1:])
        for tok, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert 1 <= len(top) <= 2 and max(top.values()) >= tok - 1e-6     # lm-eval's is_greedy check
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        assert c.finish_reason == "length"
        ref = reference_logprobs(app, ids)
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], ref)) < 1e-3 * max(1.0, max(map(abs, ref)))
    assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == 0

    # max_tokens=1 (lm-eval's default): the prompt's logprobs, then one generated token
    r1 = oc.completions.create(model=MODEL, prompt=[prompts[0]], echo=True, max_tokens=1, logprobs=1,
                               temperature=0, extra_body={"ignore_eos": True})
    lp1 = r1.choices[0].logprobs
    assert len(lp1.tokens) == len(prompts[0]) + 1
    assert lp1.token_logprobs[0] is None
    assert lp1.token_logprobs[1:-1] == pytest.approx(r.choices[0].logprobs.token_logprobs[1:], abs=1e-5)
    assert r1.choices[0].text.startswith(r.choices[0].text)


def test_echo_text_prompts_and_vllm_prompt_logprobs(app_base, oc):
    _, base = app_base
    r = oc.completions.create(model=MODEL, prompt=["It is a truth", "Call me"], echo=True, max_tokens=0,
                              logprobs=0, temperature=0)
    assert [c.text for c in r.choices] == ["It is a truth", "Call me"]
    assert all(c.logprobs.top_logprobs is None and c.logprobs.token_logprobs[0] is None for c in r.choices)
    toks = post(base, "/tokenize", {"model": MODEL, "prompt": "It is a truth"}).json()
    assert len(r.choices[0].logprobs.tokens) == toks["count"]

    body = {"model": MODEL, "prompt": "It is a truth", "max_tokens": 2, "prompt_logprobs": 2,
            "temperature": 0, "ignore_eos": True}
    c = post(base, "/v1/completions", body).json()["choices"][0]
    plp = c["prompt_logprobs"]
    assert plp[0] is None and len(plp) == toks["count"]
    for tid, entry in zip(toks["tokens"][1:], plp[1:]):
        assert str(tid) in entry and 1 <= len(entry) <= 3
        assert entry[str(tid)]["rank"] >= 1 and entry[str(tid)]["logprob"] <= 0

    # echo alone: no engine work, the prompt comes back
    r = oc.completions.create(model=MODEL, prompt=["abc", "de"], echo=True, max_tokens=0)
    assert r.choices[0].text == "abc" and r.usage.completion_tokens == 0 and len(r.choices) == 2


def test_echo_streaming(app_base, oc):
    chunks = list(oc.completions.create(model=MODEL, prompt=[[0, 70, 80, 90], [0, 5, 6]], echo=True,
                                        max_tokens=2, logprobs=1, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True}))
    by = {0: [], 1: []}
    for ch in chunks:
        for c in ch.choices:
            by[c.index].append(c)
    for k, n_prompt in ((0, 4), (1, 3)):
        toks = [t for c in by[k] if c.logprobs for t in c.logprobs.tokens]
        assert len(toks) == n_prompt + 2
        assert by[k][0].logprobs.token_logprobs[0] is None
        assert [c.finish_reason for c in by[k] if c.finish_reason] == ["length"]


def test_max_tokens_zero_needs_scoring(app_base):
    _, base = app_base
    msg = bad(base, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens")
    assert "echo" in msg


# --------------------------------------------------------------------------- n, best_of, penalties, bias


def test_n_and_best_of(app_base, oc):
    app, _ = app_base
    r = oc.chat.completions.create(model=MODEL, messages=MSG, n=3, max_tokens=4, seed=7, temperature=1.0,
                                   extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 12
    assert len({c.message.content for c in r.choices}) > 1                 # seed + i: different samples
    again = oc.chat.completions.create(model=MODEL, messages=MSG, n=3, max_tokens=4, seed=7, temperature=1.0,
                                       extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]

    r = oc.completions.create(model=MODEL, prompt=["a", "b"], n=2, best_of=3, max_tokens=3, seed=1, logprobs=0,
                              extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.usage.completion_tokens == 2 * 3 * 3
    for p in (0, 1):
        a, b = (sum(c.logprobs.token_logprobs) for c in r.choices[2 * p:2 * p + 2])
        assert a >= b                                                      # best first

    chunks = list(oc.chat.completions.create(model=MODEL, messages=MSG, n=2, max_tokens=3, stream=True,
                                             extra_body={"ignore_eos": True}))
    fins = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert fins == [0, 1]
    assert engine_idle(app) == (0, 0, 0, 0)


def test_logit_bias_and_penalties_are_honoured(oc):
    r = oc.completions.create(model=MODEL, prompt=[0, 5, 6], max_tokens=4, temperature=0,
                              logit_bias={"77": 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].logprobs is None
    ids = [int(t.split(":")[1]) for t in oc.completions.create(
        model=MODEL, prompt=[0, 5, 6], max_tokens=4, temperature=0, logit_bias={"77": 100}, logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}).choices[0].logprobs.tokens]
    assert ids == [77] * 4
    r = oc.completions.create(model=MODEL, prompt=[0, 5, 6], max_tokens=16, temperature=0, logprobs=0,
                              extra_body={"ignore_eos": True, "repetition_penalty": 50.0,
                                          "return_tokens_as_token_ids": True})
    out = [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]
    assert len(set(out)) == len(out) and not {5, 6} & set(out)
    plain = oc.completions.create(model=MODEL, prompt=[0, 5, 6], max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
    pen = oc.completions.create(model=MODEL, prompt=[0, 5, 6], max_tokens=16, temperature=0,
                                frequency_penalty=2.0, presence_penalty=2.0, extra_body={"ignore_eos": True})
    assert pen.choices[0].text != plain.choices[0].text
    r = oc.completions.create(model=MODEL, prompt=[0, 5, 6], max_tokens=3, temperature=0, logprobs=0,
                              extra_body={"ignore_eos": True, "allowed_token_ids": [9, 10],
                                          "return_tokens_as_token_ids": True})
    assert {int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens} <= {9, 10}


@pytest.mark.parametrize("body,param", [
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 200}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"n": 0}, "n"), ({"n": 99}, "n"),
    ({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 3, "stream": True}, "best_of"),
    ({"use_beam_search": True}, "use_beam_search"), ({"suffix": "end"}, "suffix"),
    ({"length_penalty": 0.5}, "length_penalty"), ({"min_p": 2}, "min_p"), ({"min_tokens": -1}, "min_tokens"),
    ({"service_tier": "flex"}, "service_tier"), ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"guided_regex": "(("}, "guided_regex"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
])
def test_invalid_sampling_parameters_are_400(app_base, body, param):
    _, base = app_base
    msg = bad(base, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1, **body}, param)
    assert param in msg


@pytest.mark.parametrize("body,param", [
    ({"functions": [{"name": "f"}]}, "functions"), ({"function_call": "auto"}, "function_call"),
    ({"store": True}, "store"), ({"audio": {"voice": "x"}}, "audio"), ({"modalities": ["audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"), ({"echo": True}, "echo"),
    ({"web_search_options": {}}, "web_search_options"), ({"thinking": {"type": "on"}}, "thinking"),
    ({"thinking": "yes"}, "thinking"), ({"chat_template_kwargs": {"foo": 1}}, "chat_template_kwargs"),
    ({"tool_choice": "required"}, "tool_choice"), ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"), ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
])
def test_invalid_chat_parameters_are_400(app_base, body, param):
    _, base = app_base
    msg = bad(base, "/v1/chat/completions", {"model": MODEL, "messages": MSG, "max_tokens": 1, **body}, param)
    assert param.split(".")[0] in msg


def test_check_tools_names_the_entry():
    with pytest.raises(ValueError, match=r"tools\[1\]\.function\.parameters"):
        check_tools([WEATHER, {"type": "function", "function": {"name": "g", "parameters": 3}}])


# --------------------------------------------------------------------------- models, tokenize


def test_model_by_id(app_base, oc):
    m = oc.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    assert oc.models.retrieve("cedlm").id == "cedlm"
    with pytest.raises(openai.NotFoundError) as ei:
        oc.models.retrieve("gpt-4o")
    err = ei.value.body
    assert err["code"] == "model_not_found" and "gpt-4o" in err["message"] and MODEL in err["message"]


def test_tokenize_and_detokenize(app_base, oc):
    _, base = app_base
    t = post(base, "/tokenize", {"model": MODEL, "prompt": "Once upon a time"}).json()
    assert set(t) >= {"tokens", "count", "max_model_len"} and t["count"] == len(t["tokens"])
    r = oc.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1)
    assert r.usage.prompt_tokens == t["count"]
    no_bos = post(base, "/tokenize", {"model": MODEL, "prompt": "Once upon a time", "add_special_tokens": False,
                                      "return_token_strs": True}).json()
    assert no_bos["tokens"] == t["tokens"][1:] and len(no_bos["token_strs"]) == no_bos["count"]
    d = post(base, "/detokenize", {"model": MODEL, "tokens": no_bos["tokens"]}).json()
    assert d == {"prompt": "Once upon a time"}

    for thinking in (None, {"type": "enabled"}):
        body = {"model": MODEL, "messages": MSG}
        extra = {} if thinking is None else {"thinking": thinking}
        t = post(base, "/tokenize", {**body, **extra}).json()
        c = oc.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1, extra_body=extra)
        assert t["count"] == c.usage.prompt_tokens
    assert post(base, "/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404
    bad(base, "/tokenize", {"model": MODEL}, "prompt")
    bad(base, "/detokenize", {"model": MODEL, "tokens": [10 ** 9]}, "tokens")


# --------------------------------------------------------------------------- thinking, effort, defaults


@pytest.mark.parametrize("extra,expect", [({"thinking": {"type": "enabled"}}, "75"),
                                          ({"thinking": {"type": "disabled"}}, "none"),
                                          ({"thinking": {"type": "enabled"}, "reasoning_effort": "max"}, "100"),
                                          ({"thinking": {"type": "disabled"}, "reasoning_effort": "high"}, "none"),
                                          ({"chat_template_kwargs": {"thinking": True, "reasoning_effort": "low"}},
                                           "50")])
def test_deepseek_thinking_shape(oc, extra, expect):
    raw = oc.chat.completions.with_raw_response.create(model=MODEL, messages=MSG, max_tokens=2, temperature=0,
                                                       extra_body={"ignore_eos": True, **extra})
    assert raw.headers["x-cedlm-reasoning-effort"] == expect
    msg = raw.parse().choices[0].message
    assert (getattr(msg, "reasoning_content", None) is not None) == (expect != "none")


def test_default_max_tokens():
    app = make_app(default_max_tokens=5)
    with serve(app) as base:
        oc = client(base)
        r = oc.chat.completions.create(model=MODEL, messages=MSG, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
        r = oc.completions.create(model=MODEL, prompt="x", extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5
    import argparse

    from cedlm.server.cli import add_parser
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    assert p.parse_args(["serve"]).default_max_tokens == 256
    assert p.parse_args(["serve", "--default-max-tokens", "0"]).default_max_tokens == 0


# --------------------------------------------------------------------------- structured output


def test_json_schema_response_format(oc):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in (0, 1):
        r = oc.chat.completions.create(model=MODEL, messages=MSG, max_tokens=120, seed=seed, response_format=rf)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert is_person(json.loads(r.choices[0].message.content))
    chunks = list(oc.chat.completions.create(model=MODEL, messages=MSG, max_tokens=120, seed=2, stream=True,
                                             response_format=rf))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert is_person(json.loads(text))
    r = oc.chat.completions.create(model=MODEL, messages=MSG, max_tokens=120, temperature=0, n=2,
                                   response_format={"type": "json_schema",
                                                    "json_schema": {"name": "p", "schema": PERSON}})
    assert all(is_person(json.loads(c.message.content)) for c in r.choices)


def test_json_schema_with_the_openai_parse_helper(oc):
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=6)
        age: int = pydantic.Field(ge=0, le=99)
        ok: bool

    r = oc.chat.completions.parse(model=MODEL, messages=MSG, max_tokens=120, seed=3, response_format=Person)
    assert isinstance(r.choices[0].message.parsed, Person)


def test_json_object_and_other_grammars(app_base, oc):
    _, base = app_base
    r = oc.chat.completions.create(model=MODEL, messages=MSG, max_tokens=200, temperature=0,
                                   response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:                                        # cut by max_tokens: still a valid prefix of an object
        assert r.choices[0].message.content.startswith("{")
    r = post(base, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 20,
                                       "guided_choice": ["yes", "no"]}).json()
    assert r["choices"][0]["text"] in ("yes", "no")
    r = post(base, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 20, "seed": 4,
                                       "structured_outputs": {"regex": "[0-9]{3}-[a-c]{2}"}}).json()
    import re
    assert re.fullmatch("[0-9]{3}-[a-c]{2}", r["choices"][0]["text"])
    r = post(base, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 60, "seed": 5,
                                       "response_format": {"type": "json_schema",
                                                           "json_schema": {"name": "p", "schema": PERSON}}}).json()
    assert is_person(json.loads(r["choices"][0]["text"]))


def test_tool_choice_required_and_named(oc):
    for parallel in (False, None):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        r = oc.chat.completions.create(model=MODEL, messages=MSG, max_tokens=80, temperature=0,
                                       tools=[WEATHER, TIME], tool_choice="required", **extra)
        ch = r.choices[0]
        assert ch.message.tool_calls, ch.message
        if parallel is False:
            assert len(ch.message.tool_calls) == 1 and ch.finish_reason == "tool_calls"
        else:      # the random model never closes the array: cut by max_tokens, complete calls kept
            assert ch.finish_reason in ("tool_calls", "length")
        calls = ch.message.tool_calls
        if ch.finish_reason == "length":        # and the cut call, its arguments as far as generated
            assert calls[-1].function.name in ("get_weather", "get_time")
            calls = calls[:-1]
        for tc in calls:
            args = json.loads(tc.function.arguments)
            assert tc.id.startswith("call_") and tc.type == "function"
            if tc.function.name == "get_weather":
                assert is_weather_args(args)
            else:
                assert tc.function.name == "get_time" and args["tz"] in ("utc", "cet")
    r = oc.chat.completions.create(model=MODEL, messages=MSG, max_tokens=100, seed=3, tools=[WEATHER, TIME],
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    tc = r.choices[0].message.tool_calls
    assert len(tc) == 1 and tc[0].function.name == "get_weather" and is_weather_args(json.loads(tc[0].function.arguments))


def test_tool_calls_stream(oc):
    stream = oc.chat.completions.create(model=MODEL, messages=MSG, max_tokens=100, seed=11, stream=True,
                                        tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    calls: dict[int, dict] = {}
    fin = []
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                cur = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                cur["id"] = d.id or cur["id"]
                cur["name"] += (d.function.name or "") if d.function else ""
                cur["arguments"] += (d.function.arguments or "") if d.function else ""
            if c.finish_reason:
                fin.append(c.finish_reason)
            assert not c.delta.content
    assert fin == ["tool_calls"] and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and is_weather_args(json.loads(calls[0]["arguments"]))

    # the openai client's stream helper assembles the same deltas
    with oc.chat.completions.stream(model=MODEL, messages=MSG, max_tokens=100, seed=12, tools=[WEATHER],
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}}) as s:
        final = s.get_final_completion()
    tc = final.choices[0].message.tool_calls
    assert tc and tc[0].function.name == "get_weather" and is_weather_args(json.loads(tc[0].function.arguments))


def test_auto_tool_calls_parsed_while_streaming(oc):
    """tool_choice auto: the model's own DSML block (here forced by a regex, the random model would
    not write one) is parsed into tool_calls deltas while streaming, as the non-streaming parse."""
    block = render_tool_calls([{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}])
    regex = "Sure\\.\n\n" + "".join("\\" + ch if ch in ".^$*+?()[]{}|\\" else ch for ch in block)
    kw = dict(model=MODEL, messages=MSG, max_tokens=200, temperature=0, tools=[WEATHER],
              extra_body={"structured_outputs": {"regex": regex}})
    r = oc.chat.completions.create(**kw)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content == "Sure."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == \
        [("get_weather", {"city": "Oslo", "days": 3})]
    content, calls, fin = "", [], []
    for chunk in oc.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += [(d.function.name, json.loads(d.function.arguments)) for d in c.delta.tool_calls or []]
            fin += [c.finish_reason] if c.finish_reason else []
    assert content == "Sure." and calls == [("get_weather", {"city": "Oslo", "days": 3})] and fin == ["tool_calls"]


def test_dsml_stream_equals_the_parse_for_any_chunking():
    block = render_tool_calls([{"name": "f", "arguments": {"a": "x<y", "b": [1, 2]}},
                               {"name": "g", "arguments": {}}])
    for text in (f"Hello\n\n{block}", block, "no calls at all\n", "ends with <｜DS"):
        want_content, want_calls = parse_tool_calls(text)
        if not want_calls:
            want_content = text
        for step in (1, 2, 5, 1000):
            s = DSMLStream()
            got, calls = "", []
            for i in range(0, len(text), step):
                d, c = s.feed(text[i:i + step])
                got += d
                calls += c
            d, c = s.finish()
            got, calls = got + d, calls + c
            assert got == want_content and calls == want_calls, (text, step)


def test_every_declared_parameter_is_documented_and_refusals_are_400(app_base):
    from cedlm.server.protocol import HONOURED, REFUSED, ChatCompletionRequest, CompletionRequest
    declared = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    assert declared == set(HONOURED), declared ^ set(HONOURED)
    assert not declared & set(REFUSED) - {"prompt_logprobs", "echo", "suffix"}
    _, base = app_base
    probe = {"use_beam_search": True, "length_penalty": 0.5, "prompt_logprobs": 1, "functions": [{"name": "f"}],
             "function_call": "auto", "audio": {}, "modalities": ["audio"], "prediction": {}, "web_search_options": {},
             "store": True, "verbosity": "low", "echo": True, "add_generation_prompt": False,
             "continue_final_message": True, "chat_template": "x", "documents": [], "priority": 1,
             "truncate_prompt_tokens": 3, "logits_processors": ["x"], "guided_decoding_backend": "xgrammar",
             "guided_whitespace_pattern": " ", "bad_words": ["x"], "n_logprobs": 2, "suffix": "x"}
    assert set(probe) == set(REFUSED)
    for k, v in probe.items():
        if k in ("prompt_logprobs", "echo", "suffix"):
            continue                      # completions parameters; refused on chat
        bad(base, "/v1/chat/completions", {"model": MODEL, "messages": MSG, "max_tokens": 1, k: v}, k)
    for k in ("use_beam_search", "suffix", "truncate_prompt_tokens", "bad_words"):
        bad(base, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1, k: probe[k]}, k)


def test_grammar_processor_gate_and_shared_samples():
    """One processor object serves several samples (the engine shares it across n): each call's
    mask depends only on that call's own tokens; in thinking mode nothing is masked before
    </think>."""
    from cedlm.server.constrain import Grammars
    from cedlm.text.tokenizer import load_tokenizer
    tok = load_tokenizer("default")
    g = Grammars(tok, tok.vocab_size)
    grammar = g.regex("(ab|cd)+x", "guided_regex")
    ids = {s: tok.encode_plain(s) for s in ("ab", "cd", "x")}
    fresh = lambda: g.processor(grammar, "guided_regex")           # noqa: E731
    shared = fresh()
    V = tok.vocab_size
    seqs = [[], ids["ab"], ids["cd"], ids["ab"] + ids["cd"], ids["cd"] + ids["cd"], ids["ab"]]
    for seq in seqs + list(reversed(seqs)):
        want = torch.isfinite(fresh()(seq, torch.zeros(V)))
        assert torch.equal(torch.isfinite(shared(seq, torch.zeros(V))), want), seq
        assert 0 < int(want.sum()) < V
    end = torch.isfinite(fresh()(ids["ab"] + ids["x"], torch.zeros(V)))
    assert end.nonzero().flatten().tolist() == [tok.eos_id]                 # complete: only EOS
    think_end = tok.token_to_id("</think>")
    gated = g.processor(grammar, "guided_regex", think_end)
    assert torch.isfinite(gated([5, 6, 100], torch.zeros(V))).all()          # still reasoning
    assert torch.equal(torch.isfinite(gated([5, think_end], torch.zeros(V))),
                       torch.isfinite(fresh()([], torch.zeros(V))))
