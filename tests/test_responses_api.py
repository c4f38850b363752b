"""The Responses API (POST /v1/responses), driven by the real `openai` client's
`responses.create` and `responses.stream` against an in-process server on the `tiny` preset
(random weights), as in tests/test_server.py. The answers are compared with the chat completion
the request stands for (same prompt, greedy), so the translation is checked, not the text.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("llguidance")

from test_server import MODEL, client, make_app, serve  # noqa: E402
from test_server_parity import PERSON, is_person, is_weather_args  # noqa: E402

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 8},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}, "strict": True}


@pytest.fixture(scope="module")
def base():
    with serve(make_app(max_num_seqs=4)) as b:
        yield b


@pytest.fixture
def oc(base):
    return client(base, timeout=60)


def chat(base, messages, **kw) -> dict:
    r = httpx.post(base + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": messages, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_create_text_input_with_instructions(oc, base):
    r = oc.responses.create(model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=6,
                            temperature=0)
    want = chat(base, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}],
                max_tokens=6)
    ch = want["choices"][0]
    assert r.object == "response" and r.model == MODEL and r.id.startswith("resp-")
    assert r.output_text == (ch["message"].get("content") or "")
    assert r.status == ("incomplete" if ch["finish_reason"] == "length" else "completed")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == want["usage"]["completion_tokens"]
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Be brief." and r.max_output_tokens == 6 and r.store is False


def test_messages_input_and_reasoning_effort(oc, base):
    msgs = [{"role": "user", "content": [{"type": "input_text", "text": "Hi."}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
            {"role": "user", "content": "Count to three."}]
    r = oc.responses.create(model=MODEL, input=msgs, reasoning={"effort": "high"}, max_output_tokens=12,
                            temperature=0)
    want = chat(base, [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
                       {"role": "user", "content": "Count to three."}], max_tokens=12, reasoning_effort="high")
    msg = want["choices"][0]["message"]
    reasoning = [it for it in r.output if it.type == "reasoning"]
    assert bool(reasoning) == bool(msg.get("reasoning_content"))
    if reasoning:
        assert reasoning[0].content[0].text == msg["reasoning_content"] and reasoning[0].summary == []
    assert r.output_text == (msg.get("content") or "")
    assert r.usage.output_tokens_details.reasoning_tokens == want["usage"]["completion_tokens_details"][
        "reasoning_tokens"]
    assert r.reasoning.effort == "high"


def test_stream_events_assemble_the_same_text(oc):
    kw = dict(model=MODEL, input="Say hello.", max_output_tokens=8, temperature=0)
    whole = oc.responses.create(**kw)
    kinds, deltas = [], []
    with oc.responses.stream(**kw) as s:
        for ev in s:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
            if ev.type == "response.output_text.done":
                assert ev.text == "".join(deltas)
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{whole.status}"
    assert "".join(deltas) == whole.output_text
    if deltas:
        i = kinds.index("response.output_text.delta")
        assert kinds[i - 2:i] == ["response.output_item.added", "response.content_part.added"]
        assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                                "response.output_item.done"]


def test_stream_reasoning_and_usage_events(base):
    """The raw SSE: sequence numbers count up from 0, reasoning text comes as reasoning_text events,
    the final response carries the usage."""
    with httpx.stream("POST", base + "/v1/responses", timeout=60, json={
            "model": MODEL, "input": "Hi.", "reasoning": {"effort": "low"}, "max_output_tokens": 6,
            "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        evs = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ")]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    kinds = [e["type"] for e in evs]
    assert "response.reasoning_text.delta" in kinds
    final = evs[-1]["response"]
    assert final["usage"]["output_tokens"] == 6 and final["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    assert final["output"][0]["type"] == "reasoning"


def test_function_tool_call(oc):
    r = oc.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], max_output_tokens=100,
                            tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    calls = [it for it in r.output if it.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1
    assert calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert is_weather_args(json.loads(calls[0].arguments))
    # the call and its result go back as input items
    r2 = oc.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert r2.usage.input_tokens > r.usage.input_tokens
    # streamed: the client's helper assembles the call
    with oc.responses.stream(model=MODEL, input="Weather?", tools=[WEATHER], tool_choice="required",
                             parallel_tool_calls=False, max_output_tokens=100, temperature=0) as s:
        final = s.get_final_response()
    calls = [it for it in final.output if it.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and is_weather_args(json.loads(calls[0].arguments))


def test_json_schema_output(oc):
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    r = oc.responses.create(model=MODEL, input="A record.", text=fmt, max_output_tokens=60, extra_body={"seed": 5})
    assert r.status == "completed" and is_person(json.loads(r.output_text))
    with oc.responses.stream(model=MODEL, input="A record.", text=fmt, max_output_tokens=60, extra_body={"seed": 6}) as s:
        final = s.get_final_response()
    assert final.status == "completed" and is_person(json.loads(final.output_text))


@pytest.mark.parametrize("extra,param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"), ({"store": True}, "store"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"), ({"background": True}, "background"),
    ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary"),
    ({"include": ["reasoning.encrypted_content"]}, "include"), ({"conversation": "conv_1"}, "conversation"),
    ({"tool_choice": {"type": "web_search_preview"}, "tools": [WEATHER]}, "tool_choice.type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
])
def test_unsupported_features_are_501_naming_them(base, extra, param):
    r = httpx.post(base + "/v1/responses", json={"model": MODEL, "input": "hi", **extra})
    assert r.status_code == 501, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "unsupported_feature" and err["message"].startswith(param)


def test_bad_values_are_400_naming_the_responses_field(base, oc):
    for body, param in (({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"), ({}, "input"),
                        ({"input": "hi", "reasoning": {"effort": "huge"}}, "reasoning"),
                        ({"input": [{"role": "robot", "content": "x"}]}, "input"),
                        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text")):
        r = httpx.post(base + "/v1/responses", json={"model": MODEL, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    with pytest.raises(openai.NotFoundError):
        oc.responses.create(model="nope", input="hi")
    r = httpx.get(base + "/v1/responses/resp_1")
    assert r.status_code == 404 and "not stored" in r.json()["error"]["message"]
