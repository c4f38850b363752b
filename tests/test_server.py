"""The OpenAI-compatible server, driven by the real `openai` client over loopback HTTP.

Each server is started in-process (uvicorn in a thread) on a free loopback port, serving the
`tiny` preset (random weights, shipped 512-token tokenizer); outputs are gibberish, so the tests
check shapes, counts and limits, not text.
"""
from __future__ import annotations

import contextlib
import threading
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

import torch  # noqa: E402

from conftest import _free_port, wait_healthy  # noqa: E402  (the suite's helpers)
from cedlm.engine.llm import LLM  # noqa: E402
from cedlm.server.aliases import AliasTable, default_served_name, parse_alias  # noqa: E402
from cedlm.server.app import create_app  # noqa: E402

torch.set_num_threads(1)
MODEL = "cedlm-tiny"
MSG = [{"role": "user", "content": "Say hello."}]


@contextlib.contextmanager
def serve(app):
    """Run `app` with uvicorn on a free loopback port in a thread; yields the base URL."""
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                           lifespan="on"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    base = f"http://127.0.0.1:{port}"
    assert wait_healthy(base, th.is_alive, 20, 0.05), "server did not start"
    try:
        yield base
    finally:
        server.should_exit = True
        th.join(10)


def make_app(**kw):
    llm_kw = {k: kw.pop(k) for k in list(kw) if k in ("max_num_seqs", "kv_budget_bytes", "max_model_len")}
    llm = LLM("tiny", kv_budget_bytes=llm_kw.pop("kv_budget_bytes", 16 << 20), replay_mode="exact",
              num_threads=1, **llm_kw)
    kw.setdefault("served_model_name", MODEL)
    return create_app(llm, **kw)


def client(base, **kw):
    kw.setdefault("api_key", "unused")
    kw.setdefault("max_retries", 0)
    kw.setdefault("timeout", 30)
    return openai.OpenAI(base_url=f"{base}/v1", **kw)


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def disconnects(base) -> float:
    m = httpx.get(f"{base}/metrics").text
    return float(next(ln for ln in m.splitlines()
                      if ln.startswith("cedlm_client_disconnects_total")).rsplit(" ", 1)[1])


def engine_idle(app, timeout=10.0):
    """Poll (on the engine thread) until no request is active or waiting and no KV block is used."""
    deadline = time.monotonic() + timeout
    while True:
        st = app.state.worker.call(lambda e: (e.pool.num_used, len(e.scheduler.active),
                                              len(e.scheduler.waiting), len(e.requests))).result(5)
        if st == (0, 0, 0, 0) or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


@pytest.fixture(scope="module")
def main_app():
    app = make_app(aliases={"cedlm": "current", "tiny-old": "deprecated"}, max_num_seqs=8)
    with serve(app) as base:
        yield app, base


@pytest.fixture
def oc(main_app):
    return client(main_app[1])


# --------------------------------------------------------------------------- chat / completions


def test_chat_non_streaming_and_streaming_agree(oc):
    r = oc.chat.completions.create(model=MODEL, messages=MSG, max_tokens=6, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert r.model == MODEL and r.object == "chat.completion"
    ch = r.choices[0]
    assert ch.finish_reason == "length" and ch.message.role == "assistant"
    assert getattr(ch.message, "reasoning_content", None) is None          # chat mode
    u = r.usage
    assert u.completion_tokens == 6 and u.prompt_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0
    assert u.completion_tokens_details.reasoning_tokens == 0

    chunks = list(oc.chat.completions.create(model=MODEL, messages=MSG, max_tokens=6, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ch.message.content                                       # greedy: same output
    fin = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert fin == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == u.prompt_tokens


def test_completions_text_and_token_ids_with_logprobs(oc):
    r = oc.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0,
                              logprobs=2, extra_body={"ignore_eos": True})
    ch = r.choices[0]
    assert r.object == "text_completion" and ch.finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert len(ch.logprobs.tokens) == 5 and len(ch.logprobs.top_logprobs) == 5
    assert all(lp <= 0 for lp in ch.logprobs.token_logprobs)
    assert all(len(t) <= 2 for t in ch.logprobs.top_logprobs)

    r2 = oc.completions.create(model=MODEL, prompt=[0, 70, 80, 90, 100], max_tokens=4, temperature=0,
                               extra_body={"ignore_eos": True})
    assert r2.usage.prompt_tokens == 5 and r2.usage.completion_tokens == 4

    chunks = list(oc.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                        temperature=0, stream=True, stream_options={"include_usage": True},
                                        extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ch.text
    assert chunks[-1].usage.completion_tokens == 5


def test_cached_tokens_on_repeated_long_prefix(oc):
    system = {"role": "system", "content": "You are a careful assistant who answers briefly. " * 12}
    first = oc.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": "one"}],
                                       max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 128
    again = oc.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": "two"}],
                                       max_tokens=2, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 64 and cached % 64 == 0 and cached < again.usage.prompt_tokens


# --------------------------------------------------------------------------- reasoning effort


@pytest.mark.parametrize("effort,expect", [("minimal", "50"), ("low", "50"), ("medium", "75"), ("high", "75"),
                                           ("xhigh", "75"), ("max", "100"), ("ultra", "100"), (37, "37"),
                                           ("none", "none")])
def test_reasoning_effort_tiers_and_integer(oc, effort, expect):
    raw = oc.chat.completions.with_raw_response.create(model=MODEL, messages=MSG, max_tokens=4,
                                                       temperature=0, reasoning_effort=effort,
                                                       extra_body={"ignore_eos": True})
    assert raw.headers["x-cedlm-reasoning-effort"] == expect
    r = raw.parse()
    rt = r.usage.completion_tokens_details.reasoning_tokens
    if expect == "none":
        assert rt == 0 and getattr(r.choices[0].message, "reasoning_content", None) is None
    else:
        assert 1 <= rt <= r.usage.completion_tokens
        assert r.choices[0].message.reasoning_content is not None


def test_reasoning_effort_extension_field(oc):
    raw = oc.chat.completions.with_raw_response.create(
        model=MODEL, messages=MSG, max_tokens=3, temperature=0, reasoning_effort="low",
        extra_body={"cedlm_reasoning_effort": 88})
    assert raw.headers["x-cedlm-reasoning-effort"] == "88"                  # the extension wins
    chat = oc.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1, temperature=0)
    think = raw.parse()
    assert think.usage.prompt_tokens > chat.usage.prompt_tokens             # the effort line


@pytest.mark.parametrize("body", [{"reasoning_effort": "huge"}, {"reasoning_effort": 0},
                                  {"reasoning_effort": 101}, {"reasoning_effort": True},
                                  {"reasoning_effort": "50"}, {"cedlm_reasoning_effort": "high"}])
def test_bad_reasoning_effort_is_400(oc, body):
    with pytest.raises(openai.BadRequestError) as ei:
        oc.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1, extra_body=body)
    err = ei.value.body
    assert ei.value.status_code == 400 and err["param"] == next(iter(body))
    assert next(iter(body)) in err["message"]


# --------------------------------------------------------------------------- model aliases


def test_aliases_current_deprecated_unknown(oc):
    names = {m.id: m for m in oc.models.list().data}
    assert set(names) == {MODEL, "cedlm", "tiny-old"}

    raw = oc.chat.completions.with_raw_response.create(model="cedlm", messages=MSG, max_tokens=1)
    assert "x-cedlm-model-deprecated" not in raw.headers
    r = raw.parse()
    assert r.model == "cedlm" and getattr(r, "warning", None) is None

    raw = oc.chat.completions.with_raw_response.create(model="tiny-old", messages=MSG, max_tokens=1)
    assert raw.headers["x-cedlm-model-deprecated"] == f"tiny-old -> {MODEL}"
    r = raw.parse()
    assert r.model == "tiny-old" and MODEL in r.warning and "deprecated" in r.warning

    with oc.completions.with_streaming_response.create(model="tiny-old", prompt="hi", max_tokens=2,
                                                       stream=True) as resp:
        assert resp.headers["x-cedlm-model-deprecated"] == f"tiny-old -> {MODEL}"
        chunks = list(resp.parse())
    assert "deprecated" in chunks[0].warning and all(c.model == "tiny-old" for c in chunks)

    with pytest.raises(openai.NotFoundError) as ei:
        oc.chat.completions.create(model="deepseek-v4.1-flash", messages=MSG, max_tokens=1)
    err = ei.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert all(n in err["message"] for n in (MODEL, "cedlm", "tiny-old"))


def test_alias_table_and_cli_helpers():
    from cedlm.server.cli import add_parser, parse_bytes
    assert parse_bytes("256M") == 256 << 20 and parse_bytes("1GiB") == 1 << 30 and parse_bytes("4096") == 4096
    assert default_served_name(None) == "cedlm-small" and default_served_name("tiny") == "cedlm-tiny"
    assert parse_alias("old") == ("old", "current") and parse_alias("old=deprecated") == ("old", "deprecated")
    with pytest.raises(ValueError):
        parse_alias("old=gone")
    t = AliasTable.from_cli("cedlm-small", ["v0=deprecated"])
    assert t.names() == ["cedlm-small", "cedlm", "v0"] and t.resolve("v0").deprecated
    import argparse
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    a = p.parse_args(["serve", "--kv-budget", "64M", "--alias", "x=deprecated", "--alias", "y"])
    assert a.host == "127.0.0.1" and a.port == 8000 and a.kv_budget_bytes == 64 << 20 and a.num_threads == 1
    assert a.alias == ["x=deprecated", "y"] and a.model is None and a.prefill_mode == "bounded"


# --------------------------------------------------------------------------- errors


def test_error_shapes(main_app, oc):
    base = main_app[1]
    with pytest.raises(openai.BadRequestError) as ei:                        # context too long
        oc.completions.create(model=MODEL, prompt=[5] * 5000, max_tokens=1)
    assert ei.value.body["code"] == "context_length_exceeded" and "max_model_len 4096" in ei.value.body["message"]
    with pytest.raises(openai.BadRequestError) as ei:                        # prompt + max_tokens
        oc.completions.create(model=MODEL, prompt=[5] * 4000, max_tokens=200)
    assert ei.value.body["param"] == "max_tokens" and "max_model_len" in ei.value.body["message"]

    for body, param in [(b"{not json", None), (b'{"model": "cedlm-tiny"}', "messages"),
                        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
                        (b'{"messages": [{"role": "wizard", "content": "x"}]}', "messages"),
                        (b'{"messages": [{"role": "user", "content": "x"}], "n": 0}', "n")]:
        r = httpx.post(f"{base}/v1/chat/completions", content=body,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
        assert err["type"] == "invalid_request_error" and err["message"]
    r = httpx.get(f"{base}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_api_key():
    app = make_app(api_key="sekrit")
    with serve(app) as base:
        with pytest.raises(openai.AuthenticationError) as ei:
            client(base, api_key="wrong").models.list()
        assert ei.value.body["code"] == "invalid_api_key"
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{base}/health").status_code == 200
        r = client(base, api_key="sekrit").completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert r.usage.completion_tokens == 1


# --------------------------------------------------------------------------- limits


def test_429_when_full_then_client_retry_succeeds():
    # one slot; one request may wait, for at most 0.5 s
    app = make_app(max_num_seqs=1, max_waiting=1, queue_timeout=0.5, retry_after=1)
    with serve(app) as base:
        hog = client(base).completions.create(model=MODEL, prompt="occupy", max_tokens=3000,
                                              stream=True, extra_body={"ignore_eos": True})
        it = iter(hog)
        next(it)                                                             # admitted and running
        result = {}

        def waiter():                                                        # waits, then times out
            try:
                client(base).completions.create(model=MODEL, prompt="w", max_tokens=1)
            except openai.RateLimitError as e:
                result["timeout"] = e

        th = threading.Thread(target=waiter)
        th.start()
        wait_for(lambda: app.state.worker.snapshot["waiting"] == 1)
        with pytest.raises(openai.RateLimitError) as ei:                     # queue bound reached
            client(base).completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert ei.value.response.headers["retry-after"] == "1"
        assert ei.value.body["code"] == "rate_limit_exceeded"
        th.join(10)
        e = result["timeout"]
        assert "queue timeout" in e.body["message"] and e.response.headers["retry-after"] == "1"

        # the client's own retries: the slot frees up while it backs off
        done = {}

        def retrier():
            c = client(base, max_retries=6)
            done["r"] = c.completions.create(model=MODEL, prompt="retry", max_tokens=2)

        th = threading.Thread(target=retrier)
        th.start()
        wait_for(lambda: app.state.worker.rejected["queue_timeout"] >= 2)     # the retrier saw a 429
        hog.close()                                                          # disconnect frees the slot
        th.join(30)
        assert done["r"].usage.completion_tokens == 2
        metrics = httpx.get(f"{base}/metrics").text
        rejected = [ln for ln in metrics.splitlines() if ln.startswith("cedlm_requests_rejected_total")]
        assert sum(float(ln.rsplit(" ", 1)[1]) for ln in rejected) >= 3
        assert engine_idle(app) == (0, 0, 0, 0)


def test_concurrent_streams_with_disconnects_free_kv(main_app):
    app, base = main_app
    n, results, errors = 6, {}, []

    def run(i):
        try:
            c = client(base)
            stream = c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"client {i} says hi"}], max_tokens=60,
                temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            got = 0
            for ch in stream:
                got += 1
                if i % 2 == 0 and got == 3:                                  # walk away mid-stream
                    stream.close()
                    results[i] = "closed"
                    return
                if ch.usage is not None:
                    results[i] = ch.usage.completion_tokens
        except Exception as e:                                               # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert all(results[i] == "closed" for i in range(0, n, 2))
    assert all(results[i] == 60 for i in range(1, n, 2))
    assert engine_idle(app) == (0, 0, 0, 0)                                  # KV back to zero
    assert disconnects(base) >= 3
    r = client(base).chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
    assert r.usage.completion_tokens >= 1                                    # still answering


def test_non_streaming_disconnect_aborts(main_app):
    app, base = main_app
    before = disconnects(base)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", json={"prompt": "long", "max_tokens": 3000, "ignore_eos": True},
                   timeout=httpx.Timeout(30, read=0.5))
    assert engine_idle(app) == (0, 0, 0, 0)                                  # 3000 tokens would take far longer
    assert disconnects(base) == before + 1


def test_metrics(main_app, oc):
    base = main_app[1]
    oc.completions.create(model=MODEL, prompt="metrics " * 40, max_tokens=1)
    oc.completions.create(model=MODEL, prompt="metrics " * 40, max_tokens=1)
    m = httpx.get(f"{base}/metrics").text
    vals = {}
    for ln in m.splitlines():
        if ln and not ln.startswith("#"):
            k, v = ln.rsplit(" ", 1)
            vals[k] = float(v)
    lab = f'model_name="{MODEL}"'
    for kind in ("main_kv", "index_keys", "window", "compressor_state"):
        assert f'cedlm_kv_bytes_in_use{{kind="{kind}",{lab}}}' in vals
    assert vals[f"cedlm_kv_bytes_per_token{{{lab}}}"] > 0
    assert vals[f"cedlm_prefix_cache_hits_total{{{lab}}}"] >= 1
    assert vals[f"cedlm_prefix_cache_queries_total{{{lab}}}"] >= vals[f"cedlm_prefix_cache_hits_total{{{lab}}}"]
    assert vals[f"cedlm_prompt_tokens_total{{{lab}}}"] > 0 and vals[f"cedlm_generation_tokens_total{{{lab}}}"] > 0
    assert f"cedlm_num_requests_running{{{lab}}}" in vals and f"cedlm_num_requests_waiting{{{lab}}}" in vals


def test_reasoning_splitter_streams_a_prefix_of_the_final_split():
    from cedlm.server.app import ReasoningSplitter
    from cedlm.text.chat import parse_assistant
    text = "<think>plan a</think>answer b"
    for cut in range(1, len(text)):                 # every two-piece split of the stream
        sp = ReasoningSplitter(thinking=True)
        parts = [sp.feed(text[:cut]), sp.feed(text[cut:]), sp.finish()]
        r, c = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
        assert (r, c) == parse_assistant(text, thinking=True) == ("plan a", "answer b")
    sp = ReasoningSplitter(thinking=False)
    assert sp.feed("x</think>y") == ("", "x</think>y")


def test_token_id_outside_vocabulary_is_400(oc):
    with pytest.raises(openai.BadRequestError) as ei:
        oc.completions.create(model=MODEL, prompt=[1, 2, 99999], max_tokens=1)
    assert ei.value.body["param"] == "prompt" and "vocabulary" in ei.value.body["message"]
