"""Operating the server (issue 30): requests as load tools send them (guidellm's streaming usage),
latency histograms, request ids and logs, clear errors for routes cedlm does not serve, the
version, and the chat page.

The server runs in-process on the `tiny` preset (random weights), as in tests/test_server.py.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from test_server import MODEL, make_app, serve  # noqa: E402  (the server tests' helpers)


@pytest.fixture(scope="module")
def ops_app():
    app = make_app(max_num_seqs=4)
    with serve(app) as base:
        yield app, base


def sse_events(text: str) -> list[dict]:
    """The JSON events of an SSE body (without the closing [DONE])."""
    out = []
    for ln in text.splitlines():
        if ln.startswith("data: ") and ln != "data: [DONE]":
            out.append(json.loads(ln[len("data: "):]))
    return out


# --------------------------------------------------------------------------- 1. guidellm's request

GUIDELLM_STREAM = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_stats_as_guidellm_sends_it(ops_app, route):
    """guidellm's default streaming body (stream_options with continuous_usage_stats, max_tokens and
    max_completion_tokens, stop null, ignore_eos): every chunk carries the usage so far, the last
    chunk the total; before, 400 'stream_options.continuous_usage_stats: stream_options...'."""
    base = ops_app[1]
    body = {"model": MODEL, "max_tokens": 6, "max_completion_tokens": 6, "stop": None, "ignore_eos": True,
            **GUIDELLM_STREAM}
    if route.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Count to ten."}]
    else:
        body["prompt"] = "Count to ten:"
    r = httpx.post(base + route, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.text.rstrip().endswith("data: [DONE]")
    events = sse_events(r.text)
    assert all("usage" in e for e in events), events
    with_choices = [e for e in events if e["choices"]]
    done = [e["usage"]["completion_tokens"] for e in with_choices]
    assert done == sorted(done) and done[-1] == 6                 # the running count, non-decreasing
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    prompt = events[-1]["usage"]["prompt_tokens"]
    assert all(e["usage"]["prompt_tokens"] == prompt for e in events)
    assert all(e["usage"]["total_tokens"] == prompt + e["usage"]["completion_tokens"] for e in events)


def test_stream_options_errors_name_the_field_once(ops_app):
    base = ops_app[1]
    r = httpx.post(base + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": "yes"}})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert msg.count("continuous_usage_stats") == 1 and msg.startswith("stream_options.continuous_usage_stats"), msg
