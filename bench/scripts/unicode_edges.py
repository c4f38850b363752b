"""Odd unicode in every field a client controls, sent to `tiny` beside two greedy bystanders.

    .venv/bin/python bench/scripts/unicode_edges.py                       # the CPU default step
    .venv/bin/python bench/scripts/unicode_edges.py --decode-step static

About 200 payloads (`payloads()`): control characters, combining runs, ZWJ sequences, bidi
overrides, noncharacters, private use, astral planes, lone surrogates escaped in JSON, in
prompts, messages, names, stop strings (over random outputs whose byte tokens leave partial
UTF-8 to the detokenizer), `logit_bias` keys in other digit systems, regexes, choices, JSON
schemas (property names, patterns, `$ref`s), Lark grammars, tools and tool calls, the Responses
API, /tokenize, and every token id of the model echoed and detokenized; `--concurrency` at a time. Two bystanders stream
greedily meanwhile, back to back. The server is `tiny` in this process (helpers of
tests/test_server.py); with the compiled step (the CPU default) the graphs are built before
anything is sent, unless `--no-wait-compile` (then the engine serves on the uncompiled step beside
the compiler, as a freshly started `cedlm serve` does).

Prints one JSON line: status codes, the payloads answered 5xx, the bystander runs and how many
were identical to one alone, their longest gap, the decode step they ran on, the engine's
(blocks in use, active, waiting, requests) afterwards, the background compile's status.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

M = "cedlm-tiny"
WEIRD = {
    "nul": "\u0000" * 40,
    "bom": "\ufeffhello\ufeff",
    "combining": "e" + "\u0301" * 3000,
    "zwj_family": "\U0001F469\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466" * 200,
    "rtl": "\u202eabc\u202d\u2066def\u2069",
    "nonchar": "\uffff\ufffe\U0010ffff\U000fffff" * 50,
    "private": "\ue000\uf8ff" * 100,
    "dotted_i": "\u0130" * 500,
    "ligature": "\ufb01\ufb02\u01c4" * 300,
    "separators": "\r\n\u2028\u2029\x85\x0b\x0c" * 50,
    "cjk_ext": "\U00020000\U0002a6d6\u9fff" * 200,
    "emoji_mod": "\U0001F44B\U0001F3FD" * 300,
    "replacement": "\ufffd" * 300,
    "tags": "\U000E0067\U000E0062\U000E007F" * 100,
    "math": "\U0001D400\U0001D7FF" * 200,
    "mixed_scripts": "Ελληνικά русский עברית العربية हिन्दी ไทย 日本語 한국어",
    "variation": "\u2764\ufe0f\u2764\ufe0e" * 200,
}
RAW = {   # JSON texts with escapes that Python's json cannot produce
    "lone_high": '"\\ud800abc"',
    "lone_low": '"abc\\udc00"',
    "reversed_pair": '"\\udc00\\ud800"',
    "high_at_end": '"abc\\ud83d"',
}
def comp(extra):
    return json.dumps({"model": M, "max_tokens": 24, **extra}, ensure_ascii=False)
def chat(content, extra=None):
    return json.dumps({"model": M, "max_tokens": 24, "messages": [{"role": "user", "content": content}], **(extra or {})}, ensure_ascii=False)
def payloads(vocab: int = 512):
    out = []
    for k, v in WEIRD.items():
        out.append((f"comp-prompt-{k}", "/v1/completions", comp({"prompt": v, "temperature": 1.0, "seed": 1})))
        out.append((f"comp-stop-{k}", "/v1/completions", comp({"prompt": "Hi", "stop": [v[:200]], "temperature": 1.0, "seed": 2, "max_tokens": 48})))
        out.append((f"chat-{k}", "/v1/chat/completions", chat(v, {"temperature": 1.0, "seed": 3})))
        out.append((f"chat-stream-stop-{k}", "/v1/chat/completions", chat(v, {"stream": True, "stop": [v[:5], "\ufffd"], "temperature": 1.0, "seed": 4})))
        out.append((f"tokenize-{k}", "/tokenize", json.dumps({"model": M, "prompt": v}, ensure_ascii=False)))
    for k, v in RAW.items():
        out.append((f"comp-raw-{k}", "/v1/completions", '{"model":"%s","max_tokens":4,"prompt":%s}' % (M, v)))
        out.append((f"comp-raw-stop-{k}", "/v1/completions", '{"model":"%s","max_tokens":4,"prompt":"a","stop":[%s]}' % (M, v)))
        out.append((f"chat-raw-{k}", "/v1/chat/completions", '{"model":"%s","max_tokens":4,"messages":[{"role":"user","content":%s}]}' % (M, v)))
        out.append((f"chat-raw-name-{k}", "/v1/chat/completions", '{"model":"%s","max_tokens":4,"messages":[{"role":"user","name":%s,"content":"x"}]}' % (M, v)))
        out.append((f"regex-raw-{k}", "/v1/completions", '{"model":"%s","max_tokens":4,"prompt":"a","guided_regex":%s}' % (M, v)))
    # stop strings and random (temperature 1) outputs of byte tokens: partial UTF-8 in the detokenizer
    for i, stop in enumerate(["\ufffd", "\u0301", "\U0001F469", "\u0000", "\u0130", " ", "\n", "\ufffd\ufffd"]):
        out.append((f"stop-rand-{i}", "/v1/completions", comp({"prompt": [1, 200, 201, 202], "stop": [stop], "temperature": 1.5, "seed": i, "max_tokens": 64, "logprobs": 3, "include_stop_str_in_output": bool(i % 2)})))
        out.append((f"stop-rand-stream-{i}", "/v1/completions", comp({"prompt": "\u00e9\u0301", "stop": [stop], "temperature": 1.5, "seed": i, "max_tokens": 64, "stream": True, "logprobs": 2, "echo": bool(i % 2)})))
    # byte tokens as prompt ids: every id, in slices, echoed with logprobs
    for lo in range(0, vocab, 128):                      # every token id of the model, in slices
        out.append((f"ids-echo-{lo}", "/v1/completions", comp({"prompt": list(range(lo, min(lo + 128, vocab))),
                                                                "echo": True, "logprobs": 1, "max_tokens": 1,
                                                                "temperature": 0})))
    out.append(("detok-all", "/detokenize", json.dumps({"model": M, "tokens": list(range(vocab))})))
    out.append(("detok-bytes", "/detokenize", json.dumps({"model": M, "tokens": list(range(3, 300))})))
    # logit_bias keys in other digit systems
    for k in ["\u0661\u0662", "\uff11\uff12", "\u00b2", "1\u200b2", "\u0967", " 12 ", "12\u0000"]:
        out.append((f"bias-{ascii(k)}", "/v1/completions", comp({"prompt": "a", "logit_bias": {k: 5}})))
    # constraints with unicode
    for k, rx in {"any": ".{1,10}", "emoji": "[\U0001F600-\U0001F64F]{2,4}", "cjk": "[\u4e00-\u9fff]{3}", "combining": "e\u0301+", "class": "\\p{L}{3}", "nul": "a\u0000b", "full": "[\u0000-\U0010ffff]{4}", "astral": "\U0010ffff{2}"}.items():
        out.append((f"regex-{k}", "/v1/completions", comp({"prompt": "x", "guided_regex": rx, "temperature": 1.0, "seed": 5})))
        out.append((f"regex-stream-{k}", "/v1/chat/completions", chat("x", {"guided_regex": rx, "stream": True, "temperature": 1.0, "seed": 6})))
    for ch in [["\u00e9", "e\u0301", "\U0001F600", "\u0000"], ["\ufffd"], ["\U0010ffff", "\uffff"], ["\u0130", "i\u0307"]]:
        out.append((f"choice-{ascii(ch)[:20]}", "/v1/completions", comp({"prompt": "x", "guided_choice": ch, "temperature": 1.0})))
    schemas = {
        "pattern": {"type": "string", "pattern": "^[\u4e00-\u9fff]{3}$"},
        "enum": {"enum": ["\U0001F600", "\u0000", "\ufffd", "e\u0301"]},
        "propnames": {"type": "object", "properties": {"\u00e9\u0301": {"type": "string"}, "\U0001F469\u200d\U0001F467": {"type": "integer"}, "\u0000": {"type": "boolean"}}, "required": ["\u00e9\u0301", "\u0000"]},
        "ref_unicode_digit": {"anyOf": [{"type": "string"}], "$ref": "#/anyOf/\u00b2"},
        "ref_arabic_digit": {"anyOf": [{"type": "string"}, {"type": "integer"}], "allOf": [{"$ref": "#/anyOf/\u0661"}]},
        "ref_key": {"$defs": {"\u00e9": {"type": "string"}}, "$ref": "#/$defs/\u00e9"},
        "ref_pct": {"$defs": {"a b": {"type": "string"}}, "$ref": "#/$defs/a%20b"},
        "const": {"const": "\u202e\U0001F600"},
        "maxlen": {"type": "string", "minLength": 2, "maxLength": 3},
        "format": {"type": "string", "format": "email"},
    }
    for k, sc in schemas.items():
        out.append((f"json-{k}", "/v1/completions", comp({"prompt": "x", "guided_json": sc, "temperature": 1.0, "seed": 7})))
        out.append((f"rf-{k}", "/v1/chat/completions", chat("x", {"response_format": {"type": "json_schema", "json_schema": {"name": "n\u00e9", "schema": sc}}, "temperature": 1.0, "seed": 8})))
        out.append((f"so-{k}", "/v1/chat/completions", chat("x", {"structured_outputs": {"json": sc}, "temperature": 1.0, "seed": 9})))
    out.append(("rf-name-unicode", "/v1/chat/completions", chat("x", {"response_format": {"type": "json_schema", "json_schema": {"name": "\U0001F600\u0000", "schema": {"type": "object"}}}})))
    for k, g in {"lit": 'start: "\u00e9" | "\U0001F600"', "range": 'start: /[\u0100-\u017f]+/', "nul": 'start: "\\u0000"'}.items():
        out.append((f"lark-{k}", "/v1/completions", comp({"prompt": "x", "guided_grammar": g, "temperature": 1.0})))
    # tools with unicode names/descriptions/arguments
    tool = {"type": "function", "function": {"name": "f\u00e9\U0001F600", "description": "\u202e\u0000", "parameters": {"type": "object", "properties": {"\u0130": {"type": "string"}}}}}
    out.append(("tools-unicode", "/v1/chat/completions", chat("x", {"tools": [tool], "temperature": 1.0})))
    out.append(("tools-choice-unicode", "/v1/chat/completions", chat("x", {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f\u00e9\U0001F600"}}, "temperature": 1.0})))
    out.append(("tools-required", "/v1/chat/completions", chat("x", {"tools": [tool], "tool_choice": "required", "temperature": 1.0, "stream": True})))
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [{"id": "c\u00e9", "type": "function", "function": {"name": "f\u00e9", "arguments": "{\"\u0130\": \"\\ud800\"}"}}]}, {"role": "tool", "tool_call_id": "c\u00e9", "content": "\u0000\ufffd"}]
    out.append(("tool-history", "/v1/chat/completions", json.dumps({"model": M, "max_tokens": 8, "messages": msgs}, ensure_ascii=False)))
    out.append(("tool-history-bad-args", "/v1/chat/completions", json.dumps({"model": M, "max_tokens": 8, "messages": msgs[:1] + [{**msgs[1], "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "\ufffd{\u0000"}}]}]}, ensure_ascii=False)))
    # model names, roles, user, responses api
    out.append(("model-name", "/v1/completions", json.dumps({"model": "cedlm-tiny\u0301", "prompt": "x", "max_tokens": 2}, ensure_ascii=False)))
    out.append(("model-fullwidth", "/v1/completions", json.dumps({"model": "\uff43edlm-tiny", "prompt": "x", "max_tokens": 2}, ensure_ascii=False)))
    out.append(("role-unicode", "/v1/chat/completions", json.dumps({"model": M, "max_tokens": 2, "messages": [{"role": "us\u00e9r", "content": "x"}]}, ensure_ascii=False)))
    out.append(("user-field", "/v1/chat/completions", chat("x", {"user": "\u0000\U0001F600" * 100})))
    out.append(("responses", "/v1/responses", json.dumps({"model": M, "input": WEIRD["combining"][:500] + WEIRD["zwj_family"][:200], "max_output_tokens": 16, "instructions": "\u202e\u0000"}, ensure_ascii=False)))
    out.append(("responses-raw", "/v1/responses", '{"model":"%s","input":"\\ud800","max_output_tokens":4}' % M))
    out.append(("responses-stream", "/v1/responses", json.dumps({"model": M, "input": [{"role": "user", "content": [{"type": "input_text", "text": "\U0001F600\u0301"}]}], "max_output_tokens": 16, "stream": True}, ensure_ascii=False)))
    out.append(("thinking", "/v1/chat/completions", chat("\u0000\ufffd", {"reasoning_effort": "high", "stream": True, "temperature": 1.0, "max_tokens": 48})))
    out.append(("prompt-list-mixed", "/v1/completions", comp({"prompt": ["\u0000", "\U0001F600" * 50, "e\u0301" * 100], "temperature": 1.0})))
    out.append(("suffix", "/v1/completions", comp({"prompt": "x", "suffix": "\U0001F600"})))
    out.append(("n-best-of", "/v1/completions", comp({"prompt": "\U0001F600\u0301", "n": 3, "best_of": 4, "temperature": 1.0, "stop": ["\ufffd"], "logprobs": 2})))
    out.append(("bad-words", "/v1/completions", comp({"prompt": "x", "bad_words": ["\U0001F600", "\ufffd", "\u0000"]})))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode-step", default=None, help="compiled (the CPU default), static, eager")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--no-wait-compile", action="store_true",
                    help="send at once, while the compiled graphs are still being built")
    a = ap.parse_args()
    import httpx
    env = os.environ.get("CEDLM_DECODE_STEP")
    import test_hostile as th                    # (its conftest import sets the suite's static step)
    from test_server import engine_idle, make_app, serve
    if env is None:
        os.environ.pop("CEDLM_DECODE_STEP", None)
    if a.decode_step is not None:
        os.environ["CEDLM_DECODE_STEP"] = a.decode_step
    app = make_app(max_num_seqs=4)
    eng = app.state.engine
    if eng.decoder.mode == "compiled" and not a.no_wait_compile:
        eng.warm_up()
    with serve(app) as base:
        t0 = time.monotonic()
        alone, _ = th._stream_timed(base)
        runs: list = []
        stop = threading.Event()

        def bystander():
            while not stop.is_set():
                step = eng.decoder.active_mode
                try:
                    text, gap = th._stream_timed(base)
                    runs.append((text == alone, round(gap, 3), step))
                except Exception as e:           # noqa: BLE001 - reported
                    runs.append((False, repr(e)[:200], step))
        bys = [threading.Thread(target=bystander) for _ in range(2)]
        for b in bys:
            b.start()
        client = httpx.Client(timeout=120, limits=httpx.Limits(max_connections=a.concurrency + 2))

        def send(item):
            name, path, body = item
            try:
                r = client.post(f"{base}{path}", content=body.encode("utf-8", "surrogatepass"),
                                headers={"content-type": "application/json"})
                return name, r.status_code
            except httpx.HTTPError as e:
                return name, type(e).__name__
        items = payloads(app.state.server.vocab_size)
        codes, fives = collections.Counter(), []
        with ThreadPoolExecutor(a.concurrency) as ex:
            for name, code in ex.map(send, items):
                codes[code] += 1
                if not isinstance(code, int) or code >= 500:
                    fives.append((name, code))
        stop.set()
        for b in bys:
            b.join(300)
        idle = engine_idle(app, 30)
        print(json.dumps({
            "decode_step": eng.decoder.mode, "payloads": len(items), "codes": dict(codes), "failed": fives,
            "bystander_runs": len(runs), "bystanders_identical": sum(r[0] is True for r in runs),
            "bystander_worst_gap_s": max((r[1] for r in runs if isinstance(r[1], float)), default=None),
            "bystander_steps": dict(collections.Counter(r[2] for r in runs)),
            "bystanders_not_identical": [r for r in runs if r[0] is not True][:5],
            "engine_after": idle, "compile": eng.compile_status(),
            "kv": app.state.worker.call(lambda e: {k: e.kv_stats()[k] for k in (
                "blocks_in_use", "blocks_compiling")}).result(10),
            "seconds": round(time.monotonic() - t0, 1)}))


if __name__ == "__main__":
    main()
