"""Server fixes: a forced tool call cut by max_tokens is never plain content,
and skip_special_tokens is honoured (vLLM's default true), never silently ignored.

The server runs in-process on the `tiny` preset (random weights), as in tests/test_server.py.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("llguidance")

from test_server import MODEL, client, make_app, serve  # noqa: E402
from test_server_parity import TIME, WEATHER  # noqa: E402

from cedlm.server.tools import CUT_ARGS_REFUSAL, CUT_REFUSAL, ForcedStream, cut_refusal  # noqa: E402

MSG = [{"role": "user", "content": "Weather?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def base():
    with serve(make_app(max_num_seqs=4)) as b:
        yield b


def test_forced_stream_cut_calls():
    """The unit: the partial call of a cut named function / "required" array."""
    s = ForcedStream(NAMED)
    assert s.feed('{"city": "Os') == [] and s.cut() == [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Os'}}]
    s = ForcedStream("required")
    done = s.feed('[{"name": "get_time", "parameters": {"tz": "utc"}}, {"name": "get_weather", "parameters": {"ci')
    assert [c["function"]["name"] for c in done] == ["get_time"]
    assert s.cut() == [{"type": "function", "function": {"name": "get_weather", "arguments": '{"ci'}}]
    s = ForcedStream("required")
    assert s.feed('[{"na') == [] and s.cut() == []          # no name yet: nothing to return
    s = ForcedStream("required", parallel=False)
    s.feed('[{"name": "get_time", "parameters": {"tz": "utc"}}, {"name": "get_weather", "parameters": {')
    assert s.cut() == [] and cut_refusal(s, []) is None      # one call only: the complete one
    s = ForcedStream("required")
    assert s.feed('[{"na') == [] and cut_refusal(s, s.cut()) == CUT_REFUSAL
    s = ForcedStream(NAMED)
    s.feed('{"ci')
    assert cut_refusal(s, s.cut()) == CUT_ARGS_REFUSAL


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_call_cut_by_max_tokens_is_a_tool_call(base, stream):
    """As vLLM: finish_reason "length", the call in tool_calls with its arguments as far as they
    were generated, no content; and a refusal saying it was cut (LangChain's structured output
    raises OpenAIRefusalError on it; a call with invalid arguments alone it turns into None)."""
    oc = client(base)
    kw = dict(model=MODEL, messages=MSG, max_tokens=3, temperature=0, tools=[WEATHER], tool_choice=NAMED)
    if not stream:
        ch = oc.chat.completions.create(**kw).choices[0]
        assert ch.finish_reason == "length" and not ch.message.content, ch
        assert ch.message.refusal == CUT_ARGS_REFUSAL
        calls = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls]
    else:
        name, args, fins, content, refusal = "", "", [], "", ""
        for chunk in oc.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                content += c.delta.content or ""
                refusal += c.delta.refusal or ""
                for d in c.delta.tool_calls or []:
                    name += d.function.name or ""
                    args += d.function.arguments or ""
                if c.finish_reason:
                    fins.append(c.finish_reason)
        assert fins == ["length"] and content == "" and refusal == CUT_ARGS_REFUSAL
        calls = [(name, args)]
    assert len(calls) == 1 and calls[0][0] == "get_weather"
    assert calls[0][1].startswith("{")
    with pytest.raises(ValueError):
        json.loads(calls[0][1])
    # with room to finish, the same request is a complete call
    ch = oc.chat.completions.create(**{**kw, "max_tokens": 100}).choices[0]
    assert ch.finish_reason == "tool_calls" and json.loads(ch.message.tool_calls[0].function.arguments)
    assert ch.message.refusal is None


def test_required_tool_call_cut_before_its_name_is_a_refusal(base):
    r = httpx.post(base + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": MSG, "max_tokens": 1, "temperature": 0, "tools": [WEATHER, TIME],
        "tool_choice": "required"}).json()
    ch = r["choices"][0]
    assert ch["finish_reason"] == "length" and not ch["message"].get("content")
    assert ch["message"]["refusal"] == (CUT_ARGS_REFUSAL if ch["message"].get("tool_calls") else CUT_REFUSAL)


def test_skip_special_tokens_honoured(base):
    """With ignore_eos the tiny model's text may contain special tokens: left out by default (as
    vLLM), kept with skip_special_tokens=false; the token ids are the same either way."""
    body = {"model": MODEL, "prompt": "a", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "logit_bias": {"1": 30}}            # id 1 = EOS in the shipped tokenizer: make it appear
    default = httpx.post(base + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    kept = httpx.post(base + "/v1/completions", json={**body, "skip_special_tokens": False},
                      timeout=60).json()["choices"][0]
    assert default["logprobs"]["tokens"] == kept["logprobs"]["tokens"]
    specials = [t for t in kept["logprobs"]["tokens"] if t.startswith("<｜") and t.endswith("｜>")]
    assert specials, kept["logprobs"]["tokens"]
    assert any(t in kept["text"] for t in specials)
    assert not any(t in default["text"] for t in specials), default["text"]
    # chat streams the same way
    st = httpx.post(base + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": MSG, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
        "logit_bias": {"1": 30}}).json()["choices"][0]["message"]["content"]
    assert "<｜end▁of▁sentence｜>" not in (st or "")
    r = httpx.post(base + "/v1/completions", json={**body, "skip_special_tokens": "no"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "skip_special_tokens"
