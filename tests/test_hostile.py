"""Hostile inputs, each sent beside a running bystander stream.

For every item the test asserts that the process lives (the server still answers), that the
bystander's greedy stream is identical to running it alone, and that the KV blocks return to 0.
The `tiny` preset is served over loopback (helpers from tests/test_server.py).
"""
from __future__ import annotations

import json
import os
import threading

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_server import MODEL, engine_idle, make_app, serve  # noqa: E402

from cedlm.server import grammar_limits  # noqa: E402

pytestmark = pytest.mark.foreground    # times wall-clock latencies: see tests/ahead.py

BYSTANDER = {"model": MODEL, "prompt": "The bystander says", "max_tokens": 48, "temperature": 0,
             "ignore_eos": True, "stream": True}


def _stream_text(base: str) -> str:
    """The bystander's streamed text (greedy, fixed length)."""
    parts = []
    with httpx.stream("POST", f"{base}/v1/completions", json=BYSTANDER, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                assert "error" not in ev, ev
                parts.extend(c["text"] for c in ev["choices"])
    return "".join(parts)


def _post(base, path, body, **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{base}{path}", content=data, headers={"content-type": "application/json",
                                                              **kw.pop("headers", {})},
                      timeout=kw.pop("timeout", 120), **kw)


@pytest.fixture(scope="module")
def hostile_app():
    app = make_app(max_num_seqs=4)
    with serve(app) as base:
        alone = _stream_text(base)
        yield app, base, alone


MAX_GAP_S = 1.0         # the bystander's longest gap between tokens beside any hostile request


def beside_bystander(app, base, alone, hostile, max_gap: float = MAX_GAP_S):
    """Run hostile() while the bystander streams; returns hostile()'s result after checking that
    the server lives, the bystander's text equals `alone`, its longest gap between tokens is
    under `max_gap` seconds and the KV blocks are back at 0."""
    return beside_timed_bystander(app, base, alone, hostile, max_gap)[0]


def _stream_timed(base: str, body: dict | None = None) -> tuple[str, float]:
    """The bystander's streamed text and its longest gap between tokens (seconds, from its first)."""
    import time
    parts, last, gap = [], None, 0.0
    with httpx.stream("POST", f"{base}/v1/completions", json=body or BYSTANDER, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                assert "error" not in ev, ev
                now = time.monotonic()
                if last is not None:
                    gap = max(gap, now - last)
                last = now
                parts.extend(c["text"] for c in ev["choices"])
    return "".join(parts), gap


def beside_timed_bystander(app, base, alone, hostile, max_gap: float = MAX_GAP_S):
    """beside_bystander, also returning the bystander's longest gap between tokens."""
    got: dict = {}
    th = threading.Thread(target=lambda: got.setdefault("r", _stream_timed(base)))
    th.start()
    try:
        result = hostile()
    finally:
        th.join(120)
    text, gap = got.get("r", (None, None))
    assert text == alone, "the bystander's stream changed"
    print(f"bystander's longest gap {gap:.3f} s")
    assert gap < max_gap, f"the bystander waited {gap:.2f} s between two tokens"
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    assert engine_idle(app) == (0, 0, 0, 0)
    return result, gap


def deep_defs(n: int) -> dict:
    """The crashing schema: a $defs chain of n nested objects."""
    d = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["a"]}
         for i in range(n)}
    d[f"d{n}"] = {"type": "integer"}
    return {"$defs": d, "$ref": "#/$defs/d0"}


# =========================================================================== 1. constraint compilation


def test_deep_schema_is_400_naming_the_limit_and_the_server_lives(hostile_app):
    app, base, alone = hostile_app
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_json": deep_defs(1000)}
    r = beside_bystander(app, base, alone, lambda: _post(base, "/v1/completions", body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "guided_json" and "nested deeper than" in err["message"]


@pytest.mark.parametrize("field,value,words", [
    ("guided_choice", [str(i) for i in range(grammar_limits.MAX_CHOICES + 1)], "choices, more than"),
    ("guided_choice", ["x" * 40000, "y" * 40000], "characters in all"),
    ("guided_grammar", "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(1500)) + 'r1500: "a"\n',
     "rules, more than"),
    ("guided_regex", "a" * (grammar_limits.MAX_REGEX_CHARS + 1), "more than the limit"),
])
def test_constraint_bounds_are_400_before_compiling(hostile_app, field, value, words):
    app, base, alone = hostile_app
    r = _post(base, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field and words in r.text, r.text


def test_ref_chain_limit():
    refs = {"$defs": {f"r{i}": {"$ref": f"#/$defs/r{i + 1}"} for i in range(100)}, "$ref": "#/$defs/r0"}
    refs["$defs"]["r100"] = {"type": "string"}
    with pytest.raises(grammar_limits.GrammarLimit, match=r"\$ref hops"):
        grammar_limits.check_schema("guided_json", refs)
    tree = {"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array",
                                                                          "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"}
    grammar_limits.check_schema("guided_json", tree)            # recursion is fine: not unfolded


def test_a_compiler_crash_costs_only_that_request(hostile_app, monkeypatch):
    """With the bounds lifted, the 1,000-level repro crashes llguidance (a segfault, which
    would take the server down if it compiled in-process): only the compiler process dies; the request gets a 400 without
    internal text, the bystander streams on, and the next constraint compiles."""
    app, base, alone = hostile_app
    monkeypatch.setattr(grammar_limits, "MAX_SCHEMA_DEPTH", 10**6)
    monkeypatch.setattr(grammar_limits, "MAX_REF_CHAIN", 10**6)
    pool = app.state.server.grammars.pool()
    crashed = pool.counters["crashed"]
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_json": deep_defs(1000)}
    r = beside_bystander(app, base, alone, lambda: _post(base, "/v1/completions", body))
    assert r.status_code == 400, r.text
    assert "compiler failed" in r.json()["error"]["message"]
    assert pool.counters["crashed"] == crashed + 1
    ok = _post(base, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_regex": "ab"})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "ab"


def test_a_runaway_compilation_is_cut_at_the_time_budget(hostile_app, monkeypatch):
    app, base, alone = hostile_app
    pool = app.state.server.grammars.pool()
    monkeypatch.setattr(pool, "timeout", 0.001)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_choice": [f"option {i}" for i in range(1000)]}
    r = beside_bystander(app, base, alone, lambda: _post(base, "/v1/completions", body))
    assert r.status_code == 400 and "took longer than the limit" in r.json()["error"]["message"], r.text
    monkeypatch.undo()
    ok = _post(base, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_regex": "ab"})
    assert ok.status_code == 200


def test_grammar_error_messages_carry_no_internal_text():
    from cedlm.server.grammar_compile import clean_message
    assert clean_message("thread '<unnamed>' panicked at src/lib.rs:12:5:\nboom") == "the compiler could not process it"
    assert clean_message("expected ':'\nat line 3") == "expected ':'"


# =========================================================================== 2. prompt scoring memory


def test_prompt_scoring_runs_the_decoder_chunk_by_chunk_with_the_same_logprobs():
    """The engine scores a prompt a chunk of decoder rows at a time (memory linear in the prompt,
    RELIABILITY.md has the figures); the logprobs, ranks and top-k equal the one-shot pass's
    (every prompt row through the decoder at once), and so do the
    tokens generated after it."""
    import torch

    from cedlm.engine.llm import LLM
    from cedlm.engine.prompt_scoring import prompt_logprobs
    from cedlm.engine.sampling_params import SamplingParams
    llm = LLM("tiny", num_threads=1, prefill_chunk=64)
    m = llm.engine.model
    ids = torch.randint(5, 500, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = prompt_logprobs(m.prefill(ids, m.new_state(), "full", chunk_size=64), ids, 5)
    rows = []
    orig = m.decoder_pass

    def spy(x, *a, **kw):
        rows.append(x.shape[1])
        return orig(x, *a, **kw)
    m.decoder_pass = spy
    try:
        out = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=5))[0]
    finally:
        m.decoder_pass = orig
    assert max(rows) <= 64                            # never every prompt row at once
    got = out.prompt_logprobs
    assert len(got) == len(ref) == 300 and got[0] is None
    for a, b in zip(ref[1:], got[1:]):
        assert a.token_id == b.token_id and a.rank == b.rank and a.top_ids == b.top_ids
        assert abs(a.logprob - b.logprob) < 1e-4
        assert max(abs(u - v) for u, v in zip(a.top_logprobs, b.top_logprobs)) < 1e-4
    plain = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids


# =========================================================================== 3. tokenisation


def test_a_text_that_cannot_fit_is_refused_before_tokenizing(hostile_app, monkeypatch):
    """The character budget is max_token_chars x the prompt limit (a token covers at most that
    many characters), not 4x it: a text above it is a 400 without any tokenizing."""
    app, base, alone = hostile_app
    srv = app.state.server
    budget = srv.max_token_chars * srv.max_prompt_tokens
    calls = []
    orig = srv.tok.encode_plain
    monkeypatch.setattr(srv.tok, "encode_plain", lambda t: calls.append(len(t)) or orig(t))
    text = "word " * (budget // 5 + 10)
    r = beside_bystander(app, base, alone, lambda: _post(base, "/v1/completions",
                                                         {"model": MODEL, "prompt": text, "max_tokens": 1}))
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
    assert [n for n in calls if n > 1000] == []                     # the bystander's prompt is short


def test_long_text_is_encoded_in_pieces_with_the_same_ids(tok):
    """A long text goes through the batch API (which releases the GIL) in pieces cut at
    pre-token boundaries; the ids equal one whole encode."""
    import random
    r = random.Random(0)
    words = ["hello", "world", "The", "é", "naïve", "123456", "a1b2", "  ", "\n", "\n\n", "don't", "...", "x",
             "日本語", "👍", "\t", "--", "ab_cd", "Zürich", "<｜User｜>", "I", "a"]
    text = "".join(r.choice(words) + r.choice([" ", "", " ", ", "]) for _ in range(40000))
    pieces = tok.split_pieces(text)
    assert len(pieces) > 3 and "".join(pieces) == text
    from cedlm.text.tokenizer import _tk
    plain = _tk().Tokenizer(tok.hf.model)
    plain.normalizer, plain.pre_tokenizer = tok.hf.normalizer, tok.hf.pre_tokenizer
    assert tok.encode_plain(text) == plain.encode(text, add_special_tokens=False).ids


# =========================================================================== 4. lone surrogate in a key


def test_lone_surrogate_in_a_key_is_400_and_the_connection_stays_usable(hostile_app):
    """A lone surrogate in a JSON key used to be a 500 (the error message naming the key could
    not be encoded) and the connection was dropped; now a 400 naming the escaped key, and the
    same keep-alive connection serves the next requests."""
    import http.client
    app, base, alone = hostile_app
    host, port = base.removeprefix("http://").split(":")

    conn = http.client.HTTPConnection(host, int(port), timeout=60)

    def send(path, body):
        conn.request("POST", path, body=body.encode(), headers={"content-type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read().decode()

    def hostile():
        return [send("/v1/completions", '{"model":"%s","prompt":"a","max_tokens":2,"\\udc00":1}' % MODEL),
                send("/v1/chat/completions",
                     '{"model":"%s","messages":[{"role":"user","content":"a","\\ud800x":1}]}' % MODEL)]
    out = beside_bystander(app, base, alone, hostile)
    good = json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 2})
    out += [send("/v1/completions", good) for _ in range(3)]          # the same connection
    conn.close()
    assert [s for s, _ in out] == [400, 400, 200, 200, 200], out
    assert "unpaired surrogate" in out[0][1] and "\\\\udc00" in out[0][1]


# =========================================================================== 5. sampling floats


@pytest.mark.parametrize("temperature", [3.5e38, 1e30, 1.0001e4])
def test_temperature_where_float32_overflows_is_400(hostile_app, temperature):
    app, base, alone = hostile_app
    body = {"model": MODEL, "prompt": "a", "max_tokens": 4, "temperature": temperature, "allowed_token_ids": [100, 200]}
    r = beside_bystander(app, base, alone, lambda: _post(base, "/v1/completions", body))
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text


def test_largest_temperature_keeps_the_constraints(hostile_app):
    app, base, alone = hostile_app
    r = _post(base, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 8, "temperature": 1e4,
                                        "allowed_token_ids": [100, 200], "ignore_eos": True, "seed": 1,
                                        "return_tokens_as_token_ids": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    toks = r.json()["choices"][0]["logprobs"]["tokens"]
    assert toks and all(t in ("token_id:100", "token_id:200") for t in toks), toks


# =========================================================================== 6. slots per request


def test_one_request_cannot_take_every_slot(hostile_app):
    """n / best_of are capped at half the sequence slots (400 naming the field), so one request
    leaves the others a fair share."""
    app, base, alone = hostile_app
    cap = app.state.server.max_samples
    assert cap == 2                                              # max_num_seqs 4
    for field in ("n", "best_of"):
        body = {"model": MODEL, "prompt": "a", "max_tokens": 4, field: cap + 1}
        r = beside_bystander(app, base, alone, lambda: _post(base, "/v1/completions", body))
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = _post(base, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2, "n": cap})
    assert r.status_code == 200 and len(r.json()["choices"]) == cap


def test_a_request_of_many_prompts_leaves_a_fair_share_to_a_bystander():
    """Fair share: a request of 16 prompts on 8 slots runs at most 4 of its
    sequences at once (the scheduler's per-owner share), so a 4-token request sent while it runs
    is admitted at once and done while the big one still runs; the big request's outputs equal
    running it alone, and the KV blocks return to 0."""
    import time
    app = make_app(max_num_seqs=8, max_waiting=32)
    big = {"model": MODEL, "prompt": [f"prompt number {i} says" for i in range(16)], "max_tokens": 24,
           "temperature": 0, "ignore_eos": True}
    small = {"model": MODEL, "prompt": "a bystander", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    texts = lambda r: [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]  # noqa: E731
    with serve(app) as base:
        t0 = time.monotonic()
        alone = texts(_post(base, "/v1/completions", big))
        big_alone_s = time.monotonic() - t0
        small_alone = texts(_post(base, "/v1/completions", small))
        got: dict = {}
        th = threading.Thread(target=lambda: got.setdefault("r", _post(base, "/v1/completions", big)))
        th.start()
        most = 0
        while th.is_alive():                       # until the big request runs
            most = app.state.worker.call(lambda e: sum(r.owner is not None for r in e.scheduler.active)).result(5)
            if most:
                break
            time.sleep(0.01)
        t1 = time.monotonic()
        r = _post(base, "/v1/completions", small)
        small_s = time.monotonic() - t1
        big_running = th.is_alive()
        most = max(most, app.state.worker.call(
            lambda e: sum(r.owner is not None for r in e.scheduler.active)).result(5))
        th.join(120)
        assert r.status_code == 200 and texts(r) == small_alone, r.text
        assert big_running, f"the bystander ({small_s:.2f} s) waited for the whole big request"
        assert small_s < big_alone_s / 2, (small_s, big_alone_s)
        assert 0 < most <= 4
        assert got["r"].status_code == 200 and texts(got["r"]) == alone
        assert engine_idle(app) == (0, 0, 0, 0)


def test_six_requests_at_once_keep_the_bystander_s_pace():
    """Six requests arriving at once beside a decoding bystander (unconstrained, then constrained):
    while it decodes, a step runs at most `max_prefills_while_decoding` (1) of their prefills
    (each a call of its own that its next token waits for), so the bystander's longest gap stays
    under MAX_GAP_S and its text is identical; all six are served and the KV blocks return to 0."""
    from concurrent.futures import ThreadPoolExecutor
    app = make_app(max_num_seqs=8)
    sched = app.state.engine.scheduler
    assert sched.max_prefills_while_decoding == 1
    plan, seen = sched.schedule, []

    def spy():
        out = plan()
        seen.append((len(out.decode), len(out.prefills)))
        return out
    sched.schedule = spy
    body = {"model": MODEL, "prompt": "Letters:", "max_tokens": 12, "temperature": 0}
    with serve(app) as base:
        alone = _stream_text(base)
        for extra in ({}, {"guided_regex": "[a-z]{3,9}( [a-z]{3,9}){0,5}"}):
            def six():
                while not app.state.worker.call(lambda e: e.scheduler.num_running).result(5):
                    pass                                # the bystander decodes first
                seen.clear()
                with ThreadPoolExecutor(6) as ex:
                    return list(ex.map(lambda _: _post(base, "/v1/completions", {**body, **extra}), range(6)))
            rs = beside_bystander(app, base, alone, six)
            assert [r.status_code for r in rs] == [200] * 6, [r.text for r in rs]
            beside = [p for d, p in seen if d]
            assert max(beside) == 1 and sum(beside) >= 6, seen     # one prefill a step beside decoding


# =========================================================================== 7. contradictory constraints


def test_contradictory_constraints_are_400_and_health_stays_ready(hostile_app):
    app, base, alone = hostile_app
    tok = app.state.server.tok
    a = tok.encode_plain("a")
    assert len(a) == 1
    bodies = [  # contradicts from the first token: refused before running
        {"model": MODEL, "prompt": "x", "max_tokens": 4, "allowed_token_ids": [0], "guided_regex": "abc"},
        # allows the first token only: the engine finds the dead end at the second
        {"model": MODEL, "prompt": "x", "max_tokens": 4, "allowed_token_ids": a, "guided_regex": "a[bc]"},
    ]
    for i, (body, words) in enumerate(zip(bodies, ("can begin the output", "leave no token"))):
        # the second runs a decode step, batched with the bystander's if beside it (batched
        # decode rounds differently, and the random tiny model has near-ties): sent alone
        send = lambda: _post(base, "/v1/completions", body)          # noqa: E731
        r = beside_bystander(app, base, alone, send) if i == 0 else send()
        assert r.status_code == 400 and words in r.text, r.text
        err = r.json()["error"]
        assert err["param"] == "allowed_token_ids" and err["code"] == "constraint_conflict", err
    h = httpx.get(f"{base}/health", timeout=10).json()
    assert h["status"] == "ready", h                              # a request's fault, not the server's
    assert engine_idle(app) == (0, 0, 0, 0)


# =========================================================================== 8. more than the queue can hold


def test_a_request_larger_than_the_queue_is_400_and_a_fitting_burst_is_served():
    app = make_app(max_num_seqs=4, max_waiting=8)
    with serve(app) as base:
        r = _post(base, "/v1/completions", {"model": MODEL, "prompt": ["a"] * 13, "max_tokens": 2})
        assert r.status_code == 400 and "holds at most 12 at once" in r.json()["error"]["message"], r.text
        r = _post(base, "/v1/completions", {"model": MODEL, "prompt": ["a"] * 12, "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 12, r.text     # slots + queue
        assert engine_idle(app) == (0, 0, 0, 0)


# =========================================================================== 9. lower items


def test_the_key_is_checked_before_the_body_and_metrics_need_it():
    app = make_app(api_key="sekret")
    with serve(app) as base:
        for body in (b"{not json", b'{"prompt": "' + b"x" * 100000 + b'"}'):
            r = _post(base, "/v1/completions", body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert httpx.get(f"{base}/metrics").status_code == 401
        assert httpx.get(f"{base}/metrics", headers={"authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(f"{base}/health").status_code == 200
        ok = _post(base, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2},
                   headers={"authorization": "Bearer sekret"})
        assert ok.status_code == 200
    app = make_app(api_key="sekret", metrics_public=True)
    with serve(app) as base:
        assert httpx.get(f"{base}/metrics").status_code == 200
        assert _post(base, "/v1/completions", b"{").status_code == 401


def test_store_counters_and_breaker_state_are_in_metrics():
    from cedlm.server.metrics import store_metrics
    kv = {"store_breaker_state": "half_open", "store_read_breaker": "half_open", "store_write_breaker": "closed",
          "store_errors": 7, "store_timeouts": 2, "store_skipped": 5, "store_breaker_trips": 1, "store_block_hits": 3,
          "store_consecutive_failures": 3}
    fams = {f.name: f for f in store_metrics(["model_name"], "m", kv)}
    val = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    assert val[("cedlm_store_errors_total", (("model_name", "m"),))] == 7
    assert val[("cedlm_store_skipped_total", (("model_name", "m"),))] == 5
    assert val[("cedlm_store_breaker_state", (("breaker", "read"), ("model_name", "m"), ("state", "half_open")))] == 1
    assert val[("cedlm_store_breaker_state", (("breaker", "write"), ("model_name", "m"), ("state", "closed")))] == 1
    assert val[("cedlm_store_breaker_state", (("breaker", "read"), ("model_name", "m"), ("state", "open")))] == 0
    assert list(store_metrics(["model_name"], "m", {})) == []          # no store: nothing


def test_health_names_the_half_open_breaker_accurately(hostile_app):
    app, base, alone = hostile_app
    w = app.state.worker
    saved = dict(w.snapshot)
    try:
        w.snapshot = {**saved, "kv": {**saved.get("kv", {}), "store_breaker_state": "half_open"}}
        status, reason = w.health()
        assert status == "degraded" and "half-open" in reason and "skipped" not in reason
    finally:
        w.snapshot = saved


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_unfinished_headers_are_cut_at_the_header_timeout(hostile_app, http):
    """A connection that never finishes its request headers (sent a byte at a time) is closed
    after the header timeout; a normal keep-alive connection is served."""
    import socket
    import time

    import uvicorn

    from cedlm.server.http_protocol import http_protocol
    app, _, alone = hostile_app
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off",
                                           http=http_protocol(0.5, http)))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        slow = socket.create_connection(("127.0.0.1", port))
        t0 = time.monotonic()
        closed = False
        for ch in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            try:
                slow.sendall(bytes([ch]))
            except OSError:
                closed = True
                break
            slow.settimeout(0.05)
            try:
                if slow.recv(1) == b"":
                    closed = True
                    break
            except socket.timeout:
                pass
            except OSError:                                          # reset by the server: closed
                closed = True
                break
            if time.monotonic() - t0 > 5:
                break
        assert closed and time.monotonic() - t0 < 3, "a slow header was held open"
        with httpx.Client() as c:                                   # keep-alive: several requests
            for _ in range(2):
                assert c.get(f"{base}/health").status_code == 200
        assert _stream_text(base) == alone
    finally:
        server.should_exit = True
        th.join(10)


def test_openapi_documents_the_temperature_bound_and_token_ids():
    from cedlm.engine.sampling_params import TEMPERATURE_MAX
    from cedlm.server.protocol import CompletionRequest, DetokenizeRequest
    t = CompletionRequest.model_json_schema()["properties"]["temperature"]["anyOf"][0]
    assert t["maximum"] == TEMPERATURE_MAX
    assert DetokenizeRequest.model_json_schema()["properties"]["tokens"]["items"]["minimum"] == 0


def test_openapi_carries_the_run_time_bounds_and_the_rules_between_fields(hostile_app):
    """/openapi.json is refined at app start (server/openapi_rules.py): token ids below the loaded
    model's vocabulary, max_tokens within the context, n / best_of within the sample cap, a 401
    on every keyed route (/metrics included), and the rules between fields JSON schema cannot
    state in the operation's description; such a rule is a 400 with code invalid_combination."""
    app, base, _ = hostile_app
    srv = app.state.server
    doc = httpx.get(f"{base}/openapi.json", timeout=30).json()
    comps, paths = doc["components"]["schemas"], doc["paths"]
    vocab = min(srv.vocab_size, srv.tok.vocab_size)
    assert comps["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == vocab - 1
    cp = comps["CompletionRequest"]["properties"]
    assert cp["n"]["maximum"] == srv.max_samples == 2
    assert cp["max_tokens"]["anyOf"][0]["maximum"] == srv.max_model_len - 1
    assert cp["guided_choice"]["anyOf"][0]["minItems"] == 1
    assert "oneOf" in comps["TokenizeRequest"]
    assert "401" in paths["/metrics"]["get"]["responses"] and "401" not in paths["/health"]["get"]["responses"]
    assert "best_of` >= `n`" in paths["/v1/completions"]["post"]["description"]
    r = _post(base, "/v1/completions", {"model": MODEL, "prompt": "a", "n": 2, "best_of": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_combination", r.text
    r = _post(base, "/detokenize", {"model": MODEL, "tokens": [1.0, 2]})   # JSON schema's integers
    assert r.status_code == 200, r.text
    # an id outside the vocabulary is a 400 before echo decodes it (was a 500: the tokenizer's overflow)
    for ids in ([[-1]], [[vocab + 10**20]]):
        r = _post(base, "/v1/completions", {"model": MODEL, "prompt": ids, "echo": True, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


# =========================================================================== request body shape


def _deep(n: int) -> str:
    return "[" * n + "]" * n


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", _deep(100_000), None),                       # the raw body itself
    ("/v1/chat/completions", '{"model":"%s","max_tokens":1,"messages":[{"role":"user","content":"x"}],"meta":%s}'
     % (MODEL, _deep(5000)), "meta"),
    ("/v1/completions", '{"model":"%s","prompt":"x","max_tokens":1,"guided_json":%s}' % (MODEL, _deep(5000)),
     "guided_json"),
    ("/tokenize", '{"model":"%s","prompt":"x","q":%s}' % (MODEL, _deep(100_000)), "q"),
    ("/detokenize", '{"model":"%s","tokens":%s}' % (MODEL, _deep(3000)), "tokens"),
    ("/v1/responses", '{"model":"%s","input":"x","text":{"format":{"type":"json_schema","schema":%s}}}'
     % (MODEL, _deep(500)), "text"),
])
def test_deep_json_body_is_400_naming_the_limit_before_parsing(hostile_app, path, body, param):
    """A body nested deeper than MAX_DEPTH is measured on the raw bytes and refused before
    json.loads recurses into it: a 400 naming the limit and the top-level field (it was "There was
    an error parsing the body", or a 500 where a validator recursed)."""
    from cedlm.server.protocol import MAX_DEPTH
    app, base, alone = hostile_app
    r = beside_bystander(app, base, alone, lambda: _post(base, path, body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "nesting_too_deep" and err["param"] == param, err
    assert f"nested deeper than {MAX_DEPTH} levels" in err["message"]


def test_json_depth_limit_is_exact_and_strings_do_not_count(hostile_app):
    from cedlm.server.protocol import MAX_DEPTH
    _, base, _ = hostile_app
    brackets = "[{\\\"]}" * 200                                  # brackets and escaped quotes in a string

    def body(levels):                                           # the root object is level 1
        return '{"model":"%s","prompt":"%s","max_tokens":1,"x":%s}' % (MODEL, brackets, _deep(levels - 1))
    ok = _post(base, "/v1/completions", body(MAX_DEPTH))
    assert ok.status_code == 200, ok.text
    r = _post(base, "/v1/completions", body(MAX_DEPTH + 1))
    assert r.status_code == 400 and r.json()["error"]["param"] == "x", r.text


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "guided_json": _deep(200_000)}, "guided_json"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": _deep(200_000)}}, "structured_outputs"),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "a", "type": "function", "function": {
            "name": "f", "arguments": '{"a":%s}' % _deep(200_000)}}]},
        {"role": "tool", "tool_call_id": "a", "content": "x"}]}, "messages"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "a", "name": "f",
                                  "arguments": '{"a":%s}' % _deep(200_000)},
                                 {"type": "function_call_output", "call_id": "a", "output": "x"}]}, "input"),
])
def test_deep_json_inside_a_string_field_is_400(hostile_app, path, body, param):
    """JSON text carried in a string (a schema, tool-call arguments) is measured before it is
    parsed; it was a RecursionError inside the validator: a 500."""
    app, base, alone = hostile_app
    r = beside_bystander(app, base, alone,
                         lambda: _post(base, path, {"model": MODEL, "max_tokens": 1, **body}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "nested deeper than" in err["message"], err


def test_logit_bias_of_4001_digits_is_400_naming_the_field(hostile_app):
    """A bias is compared with [-100, 100] before float(): 4,001 digits raised OverflowError (a
    500); NaN and infinities are refused the same way, and the message does not repeat the number."""
    app, base, alone = hostile_app
    for bias in ("9" * 4001, "-" + "9" * 4001, "1e999", "NaN"):
        body = '{"model":"%s","prompt":"x","max_tokens":1,"logit_bias":{"5":%s}}' % (MODEL, bias)
        r = _post(base, "/v1/completions", body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "logit_bias" and "[-100, 100]" in err["message"] and len(r.text) < 400, err
    for key in ("²", "1" * 40):
        r = _post(base, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1, "logit_bias": {key: 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    r = _post(base, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1, "logit_bias": {"5": 100}})
    assert r.status_code == 200, r.text


def test_too_many_messages_are_refused_before_validation(hostile_app):
    """220,000 empty messages (6 MB) are a 400 before the body is parsed (more JSON objects than
    MAX_CONTAINERS, counted on the raw bytes: the parser would build every one holding the GIL);
    5,000 are a 400 naming the message limit after a length check, not seconds of validating
    every message before the prompt limit refused them."""
    import time

    from cedlm.server.body_guard import MAX_CONTAINERS
    from cedlm.server.protocol import MAX_MESSAGES
    app, base, alone = hostile_app
    for n, words in ((220_000, f"more than the limit of {MAX_CONTAINERS}"), (5_000, f"at most {MAX_MESSAGES}")):
        msgs = ",".join(['{"role":"user","content":""}'] * n)
        for path, body in (("/v1/chat/completions", '{"model":"%s","max_tokens":1,"messages":[%s]}' % (MODEL, msgs)),
                           ("/tokenize", '{"model":"%s","messages":[%s]}' % (MODEL, msgs)),
                           ("/v1/responses", '{"model":"%s","input":[%s]}' % (MODEL, msgs))):
            t0 = time.monotonic()
            r = (beside_bystander(app, base, alone, lambda: _post(base, path, body)) if n > MAX_CONTAINERS
                 else _post(base, path, body))
            took = time.monotonic() - t0
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert words in err["message"], err
            assert err["param"] in ("messages", "input") if n == 5_000 else err["code"] == "too_many_values", err
            assert took < 20, took                 # with the bystander; the refusal itself is well under 1 s
    few = [{"role": "user", "content": "hi"}] * 3
    assert _post(base, "/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": few}).status_code == 200


def test_json_containers_are_counted_outside_strings():
    from cedlm.server.protocol.json_depth import containers_over
    assert containers_over(b'{"a": [1, {"b": []}], "s": "[[[{{{"}', 3) == 4
    assert containers_over(b'{"a": [1, {"b": []}], "s": "[[[{{{"}', 4) is None
    tricky = json.dumps(["\\", ['"[', {}]]).encode()            # an escaped quote, then a bracket in a string
    assert containers_over(tricky, 2) == 3


def test_a_recursion_error_while_handling_a_request_is_a_400(hostile_app, monkeypatch):
    app, base, _ = hostile_app

    def deep(name):
        raise RecursionError("maximum recursion depth exceeded")
    monkeypatch.setattr(app.state.server, "resolve", deep)
    r = _post(base, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "nesting_too_deep", r.text


def test_deeper_than_matches_a_parser_on_random_json(monkeypatch):
    """The raw-byte depth scan against the parsed value's depth: random JSON with brackets,
    quotes and backslashes inside strings, with chunks as small as one byte (chunk edges inside
    escapes)."""
    import random

    from cedlm.server.protocol import json_depth

    def depth(v):
        best, stack = 0, [(v, 1)]
        while stack:
            x, d = stack.pop()
            if isinstance(x, (dict, list)):
                best = max(best, d)
                stack.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))
        return best

    rnd = random.Random(0)

    def gen(d):
        if d <= 0 or rnd.random() < 0.2:
            return rnd.choice(['a[{\\"]}', "\\\\", 'x\\\\"[[', 1, None, "[]{}", '"]\\', "\\\\\\"])
        if rnd.random() < 0.5:
            return [gen(d - 1) for _ in range(rnd.randint(0, 3))]
        return {rnd.choice(["k", "[k{", '\\"q']) + str(i): gen(d - 1) for i in range(rnd.randint(0, 3))}
    for chunk in (1, 3, 7, 1 << 20):
        monkeypatch.setattr(json_depth, "_CHUNK", chunk)
        for _ in range(300):
            v = gen(rnd.randint(1, 10))
            text = json.dumps(v).encode()
            for limit in (2, 3, 5):
                assert (json_depth.deeper_than(text, limit) is not None) == (depth(v) > limit), (chunk, text, limit)


def test_deeply_nested_tool_arguments_in_model_output_stay_text():
    from cedlm.text.chat_tools import DSML, parse_tool_calls
    value = _deep(50_000)
    out = (f'<{DSML} calls>\n<{DSML} invoke name="f">\n<{DSML} parameter name="a" string="false">{value}'
           f'</{DSML} parameter>\n</{DSML} invoke>\n</{DSML} calls>')
    _, calls = parse_tool_calls(out)
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": value}


def test_a_500_says_connection_close_and_the_next_request_is_served(hostile_app, monkeypatch):
    """After an unhandled exception uvicorn closes the connection once the 500 is sent; the 500
    says `connection: close`, so a keep-alive client opens a new connection instead of losing its
    next request on a dropped one."""
    import http.client
    app, base, _ = hostile_app
    host, port = base.removeprefix("http://").split(":")

    def boom(name):
        raise RuntimeError("a bug")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 1})
    headers = {"content-type": "application/json"}
    monkeypatch.setattr(app.state.server, "resolve", boom)
    conn.request("POST", "/v1/completions", body=body, headers=headers)
    r = conn.getresponse()
    r.read()
    assert r.status == 500 and r.getheader("connection") == "close" and r.will_close
    monkeypatch.undo()
    conn.request("POST", "/v1/completions", body=body, headers=headers)    # reconnects, as told
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("connection") != "close", r.read()
    r.read()
    conn.request("POST", "/v1/completions", body=body, headers=headers)    # kept alive again
    assert conn.getresponse().status == 200
    conn.close()
    with httpx.Client(timeout=60) as c:                                    # a pooled client
        monkeypatch.setattr(app.state.server, "resolve", boom)
        assert c.post(f"{base}/v1/completions", content=body, headers=headers).status_code == 500
        monkeypatch.undo()
        assert all(c.post(f"{base}/v1/completions", content=body, headers=headers).status_code == 200
                   for _ in range(3))


def test_a_body_that_trickles_in_gets_408(monkeypatch):
    """A body sent a byte at a time is cut at the body deadline (BODY_TIMEOUT_S plus 1 s per
    MIN_BODY_RATE bytes received) with a 408 and connection: close; a body sent at speed is not."""
    import socket
    import time

    from cedlm.server import http_protocol
    monkeypatch.setattr(http_protocol, "BODY_TIMEOUT_S", 1.0)
    app = make_app()
    with serve(app) as base:
        host, port = base.removeprefix("http://").split(":")
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 1000\r\n\r\n")
        t0, data = time.monotonic(), b""
        s.settimeout(0.2)
        while time.monotonic() - t0 < 8 and b"\r\n\r\n" not in data:
            try:
                s.sendall(b" ")
                data += s.recv(65536)
            except socket.timeout:
                pass
            except OSError:
                break
        took = time.monotonic() - t0
        s.settimeout(5)
        try:
            while not data.rstrip().endswith(b"}"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass
        s.close()
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), data[:300]
        assert b"connection: close" in head.lower() and 0.9 < took < 4, took
        err = json.loads(body)["error"]
        assert err["code"] == "request_timeout" and "1 s plus 1 s per" in err["message"], err
        big = {"model": MODEL, "prompt": "x " * 200_000, "max_tokens": 1}          # 400 KB, sent at speed
        r = _post(base, "/v1/completions", big)
        assert r.status_code == 400 and "characters" in r.text, r.text           # the prompt limit, not 408
        assert _post(base, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("field,value", [
    ("guided_regex", "((a{60}){60}){60}"),
    ("guided_regex", "(((a{60}){60}){60}){60}"),                 # ran past the compiler's 10 s budget
    ("structured_outputs", {"regex": "x(b{100}|c){1000}"}),
    ("guided_json", {"type": "string", "pattern": "^((a{60}){60}){60}$"}),
    ("guided_json", {"type": "object", "patternProperties": {"^(k{300}){300}$": {"type": "integer"}}}),
    ("guided_grammar", "start: /((a{60}){60}){60}/\n"),
])
def test_counted_repetitions_are_multiplied_out_and_bounded_before_compiling(hostile_app, field, value):
    """((a{60}){60}){60} is 216,000 copies of `a` to llguidance (0.6 s of compiling, a level more
    runs past the time budget and costs the compiler process): refused in milliseconds, naming
    the limit."""
    import time
    app, base, alone = hostile_app
    t0 = time.monotonic()
    r = _post(base, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, field: value})
    took = time.monotonic() - t0
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and f"more than the limit of {grammar_limits.MAX_REGEX_UNROLLED}" in err["message"]
    assert "multiplied out" in err["message"] and took < 2.0, (took, err)


def test_regex_unrolled_size():
    from cedlm.server.grammar_limits import regex_unrolled
    assert regex_unrolled("((a{60}){60}){60}") == 216_000
    assert regex_unrolled(r"\d{4}-\d{2}-\d{2}") == 10
    assert regex_unrolled("(a|bc){3}") == 9 and regex_unrolled("x{2,5}") == 5 and regex_unrolled("x{2,}") == 2
    assert regex_unrolled("[{}]{10}") == 10 and regex_unrolled(r"\{3}") == 3 and regex_unrolled(r"\p{L}{5}") == 5
    assert regex_unrolled("a*b+c?") == 3 and regex_unrolled("(" * 5000 + "a" + ")" * 5000) == 1


def test_a_large_but_bounded_repetition_still_compiles(hostile_app):
    app, base, _ = hostile_app
    r = _post(base, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_regex": "a{1000}"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "aaaa", r.text


# =========================================================================== constraint masks off the engine thread


def _slow_masks(monkeypatch, seconds: float, first_too: bool = False):
    """Every grammar mask (but the first, unless first_too) takes `seconds` longer to compute."""
    import time

    from cedlm.server.constrain import GrammarProcessor
    compute = GrammarProcessor._compute

    def slow(self, span):
        if span or first_too:
            time.sleep(seconds)
        return compute(self, span)
    monkeypatch.setattr(GrammarProcessor, "_compute", slow)


CONSTRAINED = {"model": MODEL, "prompt": "Letters:", "max_tokens": 6, "temperature": 0,
               "guided_regex": "[a-z]{3,9}( [a-z]{3,9}){0,5}"}


def test_a_slow_grammar_mask_holds_back_only_its_own_request(hostile_app, monkeypatch):
    """Grammar masks are computed off the engine thread: with every mask 0.8 s slow, the
    constrained request is held back while its mask is late, the bystander keeps streaming (its
    longest gap far below 0.8 s) and the constrained output is identical to the fast one."""
    app, base, alone = hostile_app
    fast = _post(base, "/v1/completions", CONSTRAINED)
    assert fast.status_code == 200, fast.text
    _, gap_alone = _stream_timed(base)
    _slow_masks(monkeypatch, 0.8)
    if os.environ.get("CEDLM_MASKS_ON_ENGINE_THREAD"):          # the engine waits for every mask
        from cedlm.engine import engine
        monkeypatch.setattr(engine, "MASK_WAIT_S", 60.0)
    r, gap = beside_timed_bystander(app, base, alone, lambda: _post(base, "/v1/completions", CONSTRAINED))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == fast.json()["choices"][0]["text"]
    print("bystander longest gap", gap, "alone", gap_alone)
    assert gap < 0.5, (gap, gap_alone)


def test_samples_sharing_a_slow_grammar_give_the_same_outputs(hostile_app, monkeypatch):
    """n = 2 seeded samples share one grammar processor; with masks late (rows held back) each
    sample's output is the one it gets with fast masks."""
    app, base, _ = hostile_app
    body = {**CONSTRAINED, "max_tokens": 4, "temperature": 0.9, "seed": 7, "n": 2}
    fast = _post(base, "/v1/completions", body)
    assert fast.status_code == 200, fast.text
    _slow_masks(monkeypatch, 0.3)
    slow = _post(base, "/v1/completions", body)
    assert slow.status_code == 200, slow.text
    texts = lambda r: [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]  # noqa: E731
    assert texts(slow) == texts(fast)
    assert engine_idle(app) == (0, 0, 0, 0)


def test_a_grammar_mask_past_its_deadline_is_400_naming_the_constraint(hostile_app, monkeypatch):
    from cedlm.server import constrain
    app, base, alone = hostile_app
    monkeypatch.setattr(constrain, "MASK_DEADLINE_S", 0.5)
    _slow_masks(monkeypatch, 1.5)
    r, gap = beside_timed_bystander(app, base, alone, lambda: _post(base, "/v1/completions", CONSTRAINED))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "guided_regex" and err["code"] == "constraint_timeout", err
    assert "limit of 0.5 s" in err["message"] and gap < 0.5, (gap, err)
    events = []                             # streaming: the tokens so far, then an error event naming it
    with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0,
            "stream": True, "response_format": {"type": "json_object"}}) as s:
        assert s.status_code == 200
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "constraint_timeout" and events[-1]["error"]["param"] == "response_format"
    assert engine_idle(app) == (0, 0, 0, 0)


# =========================================================================== fair compilation


def _slow_compiles(monkeypatch, app, seconds: float, prefix: str = ""):
    """Compiling a regex that starts with `prefix` takes `seconds` longer (a slow schema)."""
    import time
    pool = app.state.server.grammars.pool()
    compile_ = pool.compile

    def slow(param, kind, value):
        if isinstance(value, str) and value.startswith(prefix):
            time.sleep(seconds)
        return compile_(param, kind, value)
    monkeypatch.setattr(pool, "compile", slow)


def test_a_repeated_schema_is_compiled_once(hostile_app):
    app, base, _ = hostile_app
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "title": "compiled once"}
    q = app.state.server.grammars.queue()
    before = (q.counters["compiled"], q.counters["cache_hits"])
    for _ in range(3):
        r = _post(base, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_json": schema})
        assert r.status_code == 200, r.text
    assert (q.counters["compiled"], q.counters["cache_hits"]) == (before[0] + 1, before[1] + 2)


def test_a_client_flooding_the_compilers_gets_429_and_another_client_is_compiled_next(hostile_app, monkeypatch):
    """20 slow schemas at once from one client: its share (4) queues, the rest are 429 with
    retry-after at once; a constraint from another client (another loopback address) compiles
    at once on the compiler a client always leaves to the others; /health and /v1/models answer
    at once throughout; the bystander streams on."""
    import time
    from concurrent.futures import ThreadPoolExecutor
    app, base, alone = hostile_app
    _slow_compiles(monkeypatch, app, 1.0, "flood")
    other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=60)
    pool = httpx.Client(limits=httpx.Limits(max_connections=24), timeout=60)      # one client's connections

    def flood():
        with ThreadPoolExecutor(20) as ex:
            futs = [ex.submit(pool.post, f"{base}/v1/completions", json={
                "model": MODEL, "prompt": "x", "max_tokens": 2, "guided_regex": f"flood{i}[a-z]+"})
                for i in range(20)]
            time.sleep(0.5)
            t0 = time.monotonic()
            theirs = other.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                                "guided_regex": "another[0-9]"})
            waited = time.monotonic() - t0
            worst = 0.0
            for path in ("/health", "/v1/models") * 3:
                t1 = time.monotonic()
                assert httpx.get(f"{base}{path}", timeout=10).status_code == 200
                worst = max(worst, time.monotonic() - t1)
            return [f.result() for f in futs], theirs, waited, worst
    (rs, theirs, waited, worst), gap = beside_timed_bystander(app, base, alone, flood)
    codes = sorted(r.status_code for r in rs)
    assert codes.count(200) == 4 and codes.count(429) == 16, codes
    busy = next(r for r in rs if r.status_code == 429)
    assert int(busy.headers["retry-after"]) >= 1 and busy.json()["error"]["code"] == "rate_limit_exceeded"
    assert theirs.status_code == 200 and waited < 1.0, (theirs.text, waited)
    print("another client's constraint answered in", waited, "health/models worst", worst, "gap", gap)
    assert worst < 0.5 and gap < 1.0, (worst, gap)
    other.close()
    pool.close()


def test_an_abandoned_request_takes_its_compilation_out_of_the_queue(hostile_app, monkeypatch):
    import time
    app, base, _ = hostile_app
    _slow_compiles(monkeypatch, app, 1.5)
    q = app.state.server.grammars.queue()
    cancelled, compiled = q.counters["cancelled"], q.counters["compiled"]
    busy = [threading.Thread(target=_post, args=(base, "/v1/completions", {
        "model": MODEL, "prompt": "x", "max_tokens": 2, "guided_regex": f"busy{i}"})) for i in range(2)]
    for th in busy:
        th.start()
    time.sleep(0.3)                                    # both compilers busy: the next one queues
    with pytest.raises(httpx.TimeoutException):
        _post(base, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                        "guided_regex": "abandoned"}, timeout=0.5)
    for th in busy:
        th.join(30)
    deadline = time.monotonic() + 5
    while q.counters["cancelled"] == cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert q.counters["cancelled"] == cancelled + 1 and q.counters["compiled"] == compiled + 2
    assert q.pending == 0 and engine_idle(app) == (0, 0, 0, 0)


# =========================================================================== unicode edges


_ODD = {"nul": "\u0000" * 8, "combining": "e" + "\u0301" * 300, "zwj": "\U0001F469\u200d\U0001F467" * 20,
        "rtl": "\u202eabc\u2066d\u2069", "nonchar": "\uffff\U0010ffff" * 8, "dotted_i": "\u0130" * 40,
        "replacement": "\ufffd" * 8, "separators": "\u2028\u2029\x85"}


def _unicode_edges(vocab: int) -> list[tuple[str, dict]]:
    """(path, body) pairs: odd characters in prompts, messages and stop strings over random
    (temperature 1.5) outputs whose byte tokens leave partial UTF-8 to the detokenizer, streamed
    with logprobs; every token id echoed; unicode in constraints, a `$ref` index written with a
    non-ASCII digit, a tool call's arguments escaping a lone surrogate."""
    out = []
    for i, (k, v) in enumerate(_ODD.items()):
        out.append(("/v1/completions", {"model": MODEL, "prompt": v, "max_tokens": 24, "temperature": 1.5,
                                        "seed": i, "stop": [v[:3], "\ufffd"], "logprobs": 2,
                                        "stream": bool(i % 2), "include_stop_str_in_output": bool(i % 3)}))
        out.append(("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": v}],
                                             "max_tokens": 24, "temperature": 1.5, "seed": i,
                                             "stop": [v[-2:]], "stream": not i % 2}))
    for lo in range(0, vocab, 128):                       # every token id, echoed with its logprob
        out.append(("/v1/completions", {"model": MODEL, "prompt": list(range(lo, min(lo + 128, vocab))),
                                        "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}))
    for rx in (".{1,10}", "[\U0001F600-\U0001F64F]{2,4}", "e\u0301+", "[\u0000-\U0010ffff]{4}"):
        out.append(("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 12, "guided_regex": rx,
                                        "temperature": 1.0, "seed": 1}))
    out.append(("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 8, "temperature": 1.0,
                                    "guided_choice": ["\u00e9", "e\u0301", "\U0001F600", "\u0000"]}))
    out.append(("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 8, "guided_json": {
        "type": "object", "properties": {"\u00e9\u0301": {"type": "string"}, "\u0000": {"type": "boolean"}},
        "required": ["\u00e9\u0301"]}}))
    return out


def test_unicode_edges_beside_a_bystander_are_never_a_5xx(hostile_app):
    """The unicode edge payloads (`_unicode_edges`), four at a time beside the bystander: no 5xx,
    no error event in a stream, the bystander identical, its gap bounded, the KV blocks back to 0."""
    from concurrent.futures import ThreadPoolExecutor
    app, base, alone = hostile_app

    def send(item):
        path, body = item
        return _post(base, path, json.dumps(body, ensure_ascii=False).encode())

    def hostile():
        with ThreadPoolExecutor(4) as ex:
            return list(ex.map(send, _unicode_edges(app.state.server.vocab_size)))
    rs = beside_bystander(app, base, alone, hostile)
    def failed(r) -> bool:
        return r.status_code not in (200, 400) or (
            r.status_code == 200 and ('"error": {' in r.text or '"error":{' in r.text))
    bad = [(r.status_code, r.text[:200]) for r in rs if failed(r)]
    assert not bad and sum(r.status_code == 200 for r in rs) >= 20, bad


def test_a_ref_index_in_a_non_ascii_digit_is_not_a_500(hostile_app):
    """`#/anyOf/²`: "²" is a digit to str.isdigit but not to int(); the schema walk treats it as
    the name it is (no such member), and the request is answered, not a 500."""
    app, base, alone = hostile_app
    schema = {"anyOf": [{"type": "string"}], "$ref": "#/anyOf/\u00b2"}
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_json": schema}),
                       ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "messages": [
                           {"role": "user", "content": "x"}], "structured_outputs": {"json": schema}})):
        r = beside_bystander(app, base, alone, lambda: _post(base, path, body))
        assert r.status_code in (200, 400), r.text


def test_tool_arguments_escaping_a_lone_surrogate_are_400_naming_messages(hostile_app):
    """A tool call's JSON arguments are unescaped into the prompt: `"\\ud800"` there becomes a lone
    surrogate, which no tokenizer can encode: a 400 naming `messages`, not a 500."""
    app, base, alone = hostile_app
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "f", "arguments": '{"a": "\\ud800"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    r = beside_bystander(app, base, alone, lambda: _post(
        base, "/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "messages": msgs}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "surrogate" in r.json()["error"]["message"]
