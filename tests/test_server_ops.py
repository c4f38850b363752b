"""Operating the server: requests as load tools send them (guidellm's streaming usage),
latency histograms, request ids and logs, clear errors for routes cedlm does not serve, the
version, and the chat page.

The server runs in-process on the `tiny` preset (random weights), as in tests/test_server.py.
"""
from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from test_server import MODEL, make_app, serve  # noqa: E402  (the server tests' helpers)


@pytest.fixture(scope="module")
def ops_app():
    app = make_app(max_num_seqs=4, log_interval=0.3)      # a throughput line every 0.3 s while busy
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


# --------------------------------------------------------------------------- 3. latency histograms

HISTOGRAMS = ("cedlm_time_to_first_token_seconds", "cedlm_time_per_output_token_seconds",
              "cedlm_e2e_request_latency_seconds", "cedlm_request_queue_time_seconds",
              "cedlm_request_prefill_time_seconds", "cedlm_request_decode_time_seconds",
              "cedlm_request_prompt_tokens", "cedlm_request_generation_tokens")


def histograms(base: str) -> dict[str, tuple[float, float]]:
    """(count, sum) of each histogram, read with prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        if fam.type == "histogram":
            vals = {s.name: s.value for s in fam.samples if s.labels.get("model_name") == MODEL}
            out[fam.name] = (vals.get(fam.name + "_count", 0.0), vals.get(fam.name + "_sum", 0.0))
        elif fam.name == "cedlm_request_success":
            for smp in fam.samples:
                if smp.name.endswith("_total"):
                    out[f"success:{smp.labels['finished_reason']}"] = (smp.value, smp.value)
    return out


def test_latency_histograms_move_with_requests(ops_app):
    base = ops_app[1]
    before = histograms(base)
    for i in range(2):
        r = httpx.post(base + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": f"histogram {i} " * 8, "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200, r.text
    after = histograms(base)
    for name in HISTOGRAMS:
        assert after[name][0] - before.get(name, (0, 0))[0] == 2, (name, before.get(name), after[name])
    grew = {k: after[k][1] - before.get(k, (0, 0))[1] for k in HISTOGRAMS}
    assert grew["cedlm_request_generation_tokens"] == 10
    assert grew["cedlm_request_prompt_tokens"] >= 2 * 8
    e2e, ttft, tpot = (grew[f"cedlm_{k}"] for k in ("e2e_request_latency_seconds",
                                                    "time_to_first_token_seconds",
                                                    "time_per_output_token_seconds"))
    assert 0 < ttft <= e2e and 0 < tpot <= e2e, grew
    assert after["success:length"][0] - before.get("success:length", (0, 0))[0] == 2
    print("histogram sums of two 5-token requests:", json.dumps({k: round(v, 4) for k, v in grew.items()}))


# --------------------------------------------------------------------------- 4. request ids and logs


def test_request_id_echoed_generated_and_validated(ops_app):
    base = ops_app[1]
    body = {"model": MODEL, "prompt": "id", "max_tokens": 1}
    r = httpx.post(base + "/v1/completions", json=body, headers={"x-request-id": "trace-42.a"}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42.a"
    assert r.json()["id"].startswith("cmpl-trace-42.a-")                  # the engine id carries it
    r = httpx.post(base + "/v1/completions", json=body, timeout=60)
    rid = r.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid) and r.json()["id"] == f"cmpl-{rid}"
    for bad in ("x" * 129, "has space", "tab\tinside"):
        r = httpx.post(base + "/v1/completions", json=body, headers={"x-request-id": bad}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-id", r.text
    r = httpx.get(base + "/v1/nothing", headers={"x-request-id": "probe-1"})     # errors carry it too
    assert r.status_code == 404 and r.headers["x-request-id"] == "probe-1"


def test_per_request_and_throughput_log_lines(ops_app, caplog):
    base = ops_app[1]
    caplog.set_level(logging.INFO, logger="cedlm.server")
    r = httpx.post(base + "/v1/chat/completions", headers={"x-request-id": "log-me"}, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "log this"}], "max_tokens": 4,
        "ignore_eos": True})
    assert r.status_code == 200
    deadline = time.monotonic() + 5                  # the throughput line comes within 0.3 s
    while time.monotonic() < deadline and not all(any(w in m for m in caplog.messages)
                                                  for w in ("Avg prompt throughput", "log-me")):
        time.sleep(0.05)
    line = next(m for m in caplog.messages if "log-me" in m and "finished" in m)
    assert re.search(r"request chatcmpl-log-me-[0-9a-f]{8} finished: prompt_tokens=\d+ cached_tokens=\d+ "
                     r"output_tokens=4 ttft=[0-9.]+s total=[0-9.]+s finish_reason=length", line), line
    tput = next(m for m in caplog.messages if "Avg prompt throughput" in m)
    assert re.search(r"Avg generation throughput: [0-9.]+ tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, "
                     r"KV cache usage: [0-9.]+%, Prefix cache hit rate: [0-9.]+%", tput), tput


def test_throughput_line_only_while_busy():
    from cedlm.server.tracing import ThroughputLog

    class W:
        snapshot = {"counters": {"prompt_tokens": 0, "generation_tokens": 0}, "running": 0, "waiting": 0,
                    "kv": {"blocks_total": 10, "blocks_in_use": 0}}
    w = W()
    t = ThroughputLog(w, interval=10)
    assert t.tick() is None                       # the first tick only sets the baseline
    assert t.tick() is None                       # idle: no line
    w.snapshot = {**W.snapshot, "counters": {"prompt_tokens": 100, "generation_tokens": 20}, "running": 1,
                  "kv": {"blocks_total": 10, "blocks_in_use": 5}}
    line = t.tick()
    assert line is not None and "Running: 1 reqs" in line and "KV cache usage: 50.0%" in line


# --------------------------------------------------------------------------- 5. unsupported routes, version


@pytest.mark.parametrize("path,words", [("/v1/embeddings", "embedding"), ("/v1/responses/resp_1", "not stored"),
                                        ("/v1/audio/transcriptions", "audio"), ("/v1/moderations", "moderation"),
                                        ("/v1/images/generations", "image generation")])
def test_unsupported_routes_answer_a_clear_404(ops_app, path, words):
    r = httpx.post(ops_app[1] + path, json={"model": MODEL, "input": "hi"})
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "unsupported_endpoint"
    assert err["type"] == "not_found_error"
    assert words in err["message"] and "not served by cedlm" in err["message"]
    assert "POST /v1/chat/completions" in err["message"]                  # says what it serves


def test_openai_client_embeddings_error_is_clear(ops_app):
    openai = pytest.importorskip("openai")
    from test_server import client
    with pytest.raises(openai.APIStatusError) as ei:
        client(ops_app[1]).embeddings.create(model=MODEL, input="hello")
    assert ei.value.status_code == 404 and "embedding" in ei.value.message
    assert isinstance(ei.value, openai.NotFoundError)


def test_unknown_and_wrong_method_routes(ops_app):
    base = ops_app[1]
    r = httpx.get(base + "/v1/nothing")
    assert r.status_code == 404 and "cedlm serves" in r.json()["error"]["message"]
    r = httpx.get(base + "/v1/chat/completions")
    assert r.status_code == 405 and "POST" in r.headers["allow"], r.text


def test_version_route_and_cli(ops_app):
    from cedlm import __version__
    assert httpx.get(ops_app[1] + "/version").json() == {"version": __version__}
    for argv in (["--version"], ["serve", "--version"]):
        out = subprocess.run([sys.executable, "-m", "cedlm.cli", *argv], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == f"cedlm {__version__}", out


# --------------------------------------------------------------------------- 6. the chat page


def test_chat_page_served_and_self_contained(ops_app):
    r = httpx.get(ops_app[1] + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    assert "/v1/chat/completions" in html and "reasoning_content" in html
    for field in ("max_tokens", "temperature", "effort", "api_key"):
        assert f'id="{field}"' in html
    # nothing from elsewhere: no external scripts, styles, images, fonts or fetches
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html, flags=re.I)
    assert not re.search(r"""@import|url\(\s*["']?(https?:)?//|fetch\(\s*["'`]https?:""", html, flags=re.I)
    assert "http://" not in html and "https://" not in html


def test_chat_page_needs_no_key_but_the_api_does():
    from test_server import make_app as mk
    app = mk(api_key="sekret", log_interval=None)
    with serve(app) as base:
        assert httpx.get(base + "/").status_code == 200
        assert httpx.get(base + "/v1/models").status_code == 401
        assert httpx.get(base + "/v1/models", headers={"authorization": "Bearer sekret"}).status_code == 200


# The page's own script, run by node against the live server with a minimal stand-in for the DOM
# (no browser here): type a message, submit, wait for the streamed reply.
_NODE_HARNESS = r"""
const [BASE, PAGE, EFFORT] = process.argv.slice(2);
class El {
  constructor(tag) { this.tag = tag; this.value = ""; this.textContent = ""; this.children = [];
                     this.listeners = {}; this.hidden = false; this.files = []; this.className = "";
                     this.dataset = {}; this.style = {}; this.attrs = {}; this.classes = new Set();
                     this.classList = { add: (...c) => c.forEach((x) => this.classes.add(x)),
                                        remove: (...c) => c.forEach((x) => this.classes.delete(x)),
                                        contains: (c) => this.classes.has(c),
                                        toggle: (c, on) => ((on ?? !this.classes.has(c))
                                          ? this.classes.add(c) : this.classes.delete(c)) }; }
  set innerHTML(v) { if (v === "") this.children = []; else this.inner = v; }
  get innerHTML() { return this.inner || ""; }
  appendChild(c) { this.children.push(c); c.parentNode = this;
                   if (this.id === "model" && !this.value) this.value = c.value; return c; }
  append(...cs) { for (const c of cs) this.appendChild(c); }
  prepend(...cs) { this.children.unshift(...cs); }
  insertBefore(c) { this.children.unshift(c); return c; }
  removeChild(c) { this.children = this.children.filter((x) => x !== c); return c; }
  remove() { if (this.parentNode) this.parentNode.removeChild(this); }
  replaceChildren(...cs) { this.children = []; this.append(...cs); }
  setAttribute(k, v) { this.attrs[k] = v; }
  getAttribute(k) { return this.attrs[k] ?? null; }
  removeAttribute(k) { delete this.attrs[k]; }
  addEventListener(type, fn) { this.listeners[type] = fn; }
  querySelector() { return this.pre || (this.pre = new El("pre")); }
  querySelectorAll() { return []; }
  scrollIntoView() {}
  focus() {}
  requestSubmit() { this.listeners.submit({ preventDefault() {} }); }
}
const els = {};
globalThis.document = {
  getElementById: (id) => els[id] || (els[id] = Object.assign(new El("input"), { id })),
  createElement: (tag) => new El(tag), createTextNode: (t) => ({ text: t }) };
globalThis.localStorage = { getItem: () => null, setItem() {} };
const realFetch = globalThis.fetch;
globalThis.fetch = (url, opts) => realFetch(BASE + url, opts);
const $ = (id) => document.getElementById(id);
$("max_tokens").value = "8"; $("temperature").value = "0"; $("effort").value = EFFORT;
eval(require("fs").readFileSync(PAGE, "utf8"));
(async () => {
  for (let i = 0; i < 200 && !$("model").value; i++) await new Promise((r) => setTimeout(r, 25));
  $("input").value = "Say hello.";
  $("form").requestSubmit();
  for (let i = 0; i < 2400 && $("send").textContent !== "Stop"; i++) await new Promise((r) => setTimeout(r, 5));
  for (let i = 0; i < 2400 && $("send").textContent === "Stop"; i++) await new Promise((r) => setTimeout(r, 25));
  const out = $("log").children[$("log").children.length - 1];
  const [details, answer, stats] = out.children;
  // the answer as streamed (the page draws it as markdown and keeps the raw text beside it)
  console.log(JSON.stringify({ model: $("model").value, answer: answer.dataset.raw, stats: stats.textContent,
                               reasoning: details.querySelector("pre").textContent,
                               error: out.classes.has("error"), reasoningShown: !details.hidden }));
})();
"""


@pytest.mark.parametrize("effort", ["none", "high"])
def test_chat_page_script_streams_a_reply(ops_app, tmp_path, effort):
    """The page's script (run by node, a stand-in DOM) sends a message and shows the streamed
    reply: the same answer and reasoning a non-streaming greedy request returns, with the token
    count and finish."""
    import shutil
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    base = ops_app[1]
    html = httpx.get(base + "/").text
    page = tmp_path / "page.js"
    page.write_text(re.search(r"<script>(.*)</script>", html, flags=re.S).group(1), encoding="utf-8")
    harness = tmp_path / "harness.js"
    harness.write_text(_NODE_HARNESS, encoding="utf-8")
    out = subprocess.run([node, str(harness), base, str(page), effort], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    want = httpx.post(base + "/v1/chat/completions", timeout=60, json={
        "model": got["model"], "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
        "temperature": 0, "reasoning_effort": effort}).json()
    print("chat page via node:", got)
    assert not got["error"], got
    msg = want["choices"][0]["message"]
    assert got["model"] == MODEL and got["answer"] == (msg.get("content") or "")
    assert got["reasoningShown"] == bool(msg.get("reasoning_content"))
    assert got["reasoning"] == (msg.get("reasoning_content") or "")
    assert f"finish: {want['choices'][0]['finish_reason']}" in got["stats"], got
    if want["usage"]["completion_tokens"] > 1 and got["answer"]:
        assert re.search(r"\d+ tokens, [0-9.]+ tokens/s, first token [0-9.]+ s", got["stats"]), got
