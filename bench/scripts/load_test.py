"""Load test of `cedlm serve` over loopback: streaming bystanders, disconnects, and a
long-prompt tenant. Bounded in count and time; never leaves 127.0.0.1.

    .venv/bin/python bench/scripts/load_test.py                     # ~2-4 min on a 2-core CPU
    .venv/bin/python bench/scripts/load_test.py --clients 16 --no-baseline   # a quick look

It starts `cedlm serve --model tiny` (random weights: the text is gibberish, the work is real) on a
free loopback port, waits until no graph compiles in the background (`compile_wait_s`: the phases
time the settled step), then runs, after one warm-up request:

- `short_behind_long`: on the idle server, one short streaming request sent 0.5 s after a
  `--long-tokens` prompt (finding 8 on its own): both times to first token;

and then one or two phases, each with `--clients` streaming completion clients (distinct prompts, `ignore_eos`, `--max-tokens` each) arriving spread over `--ramp`
seconds, of which a seeded `--disconnect` fraction close the connection after
`--disconnect-after` tokens:

- `baseline` (unless --no-baseline): the bystanders alone;
- `long_tenant`: the same bystanders while one tenant sends prompts of `--long-tokens` tokens back
  to back (up to `--long-requests`), the first one just before the bystanders start;
- `hostile` (with `--hostile N`): the same bystanders while N hostile clients send the requests of
  `HOSTILE` back to back (malformed, deep or oversized bodies, refused constraints, a heavy regex,
  odd unicode, a 6-way constrained burst, streams dropped mid-way, a body that trickles in): each
  must be answered below 500 (or, for the dropped ones, not at all), and every bystander served.

Reported per phase (JSON on stdout and in --out): bystander time to first token and total time
(median / p95 / max, over the clients that stayed), errors (HTTP errors, error events, streams that
end without a finish reason or with fewer tokens than asked) for the clients that stayed and for
those that disconnected, the long tenant's latencies, and the KV blocks in use (from /metrics)
before the phase and after it (polled until back to the baseline or `--settle` seconds).
Exit status 1 when a client that stayed saw an error or the KV blocks did not return to baseline.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"                                   # loopback only, never anything else
MODEL = "cedlm-tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "cedlm.cli", "serve", "--model", "tiny", "--host", HOST,
           "--port", str(port), "--served-model-name", MODEL, "--threads", "1",
           "--max-num-seqs", str(args.max_num_seqs), "--max-waiting", str(args.max_waiting),
           "--queue-timeout", str(args.queue_timeout), "--log-level", "warning", *args.serve_args.split()]
    log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL
    return subprocess.Popen(cmd, cwd=args.server_cwd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the server was not ready within {timeout:g} s")


def wait_compiled(base: str, timeout: float) -> float:
    """Wait until no graph compiles in the background (the phases time the server's settled step,
    not one sharing the machine with its compiler); the seconds waited."""
    t0 = time.monotonic()
    while httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0].get("compiling"):
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"the server was still compiling after {timeout:g} s")
        time.sleep(1.0)
    return time.monotonic() - t0


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for ln in text.splitlines():
        if ln.startswith(name + " ") or ln.startswith(name + "{"):
            return float(ln.rsplit(" ", 1)[1])
    raise KeyError(name)


def settle(base: str, baseline: float, timeout: float) -> tuple[float, float]:
    """Poll cedlm_kv_blocks_in_use until it is back to baseline; (value, seconds waited)."""
    t0 = time.monotonic()
    while True:
        v = metric(base, "cedlm_kv_blocks_in_use")
        if v <= baseline or time.monotonic() - t0 > timeout:
            return v, time.monotonic() - t0
        time.sleep(0.25)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = max(0, min(len(xs) - 1, int(round(q * (len(xs) - 1)))))
    return round(xs[k], 3)


def summary(xs: list[float]) -> dict:
    return {"n": len(xs), "median": round(statistics.median(xs), 3) if xs else None,
            "p95": pct(xs, 0.95), "max": round(max(xs), 3) if xs else None}


async def stream_one(http: httpx.AsyncClient, base: str, prompt: str, max_tokens: int,
                     disconnect_after: int | None, timeout: float) -> dict:
    """One streaming completion. Returns {ttft, total, tokens, error, disconnected}."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    res = {"ttft": None, "total": None, "tokens": 0, "error": None, "disconnected": False}
    finish, usage, chunks = None, None, 0
    try:
        async with asyncio.timeout(timeout):
            async with http.stream("POST", f"{base}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    res["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return res
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    ev = json.loads(data)
                    if "error" in ev:
                        res["error"] = f"error event: {ev['error']}"
                        return res
                    if ev.get("usage"):
                        usage = ev["usage"]
                    for ch in ev.get("choices") or []:
                        if ch.get("text"):
                            chunks += 1
                            if res["ttft"] is None:
                                res["ttft"] = time.monotonic() - t0
                        finish = ch.get("finish_reason") or finish
                    if disconnect_after is not None and chunks >= disconnect_after:
                        res["disconnected"] = True        # leaving the block closes the connection
                        res["total"] = time.monotonic() - t0
                        res["tokens"] = chunks
                        return res
    except TimeoutError:
        res["error"] = f"timed out after {timeout:g} s"
        return res
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res["error"] = f"{type(e).__name__}: {e}"
        return res
    res["total"] = time.monotonic() - t0
    res["tokens"] = (usage or {}).get("completion_tokens", chunks)
    if finish is None:
        res["error"] = "the stream ended without a finish_reason"
    elif res["tokens"] != max_tokens:
        res["error"] = f"{res['tokens']} tokens of {max_tokens}"
    return res


def count_tokens(base: str, text: str) -> int:
    return httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": text}, timeout=60).json()["count"]


def long_prompt(base: str, tokens: int, salt: int) -> tuple[str, int]:
    """A text of at most `tokens` prompt tokens (sized with /tokenize), distinct per salt; and
    its token count."""
    words = [f"w{(salt * 7919 + i * 104729) % 99991}" for i in range(tokens)]
    keep = len(words)
    while True:
        text = " ".join(words[:keep])
        n = count_tokens(base, text)
        if n <= tokens:
            return text, n
        keep = max(1, int(keep * tokens / n) - 2)


def _deep(n: int) -> str:
    return '{"a":' * n + "1" + "}" * n


# (label, path, body: a JSON value or raw text, how the client behaves: "send" | "drop" | "trickle")
HOSTILE: list[tuple[str, str, object, str]] = [
    ("invalid_json", "/v1/completions", '{"model": "%s", "prompt": ' % MODEL, "send"),
    ("deep_json", "/v1/completions", '{"model":"%s","prompt":"x","x":' % MODEL + _deep(150) + "}", "send"),
    ("deep_guided_json", "/v1/completions", {"model": MODEL, "prompt": "x", "guided_json": _deep(150)}, "send"),
    ("many_containers", "/v1/chat/completions", '{"model":"%s","messages":[' % MODEL + ",".join(["{}"] * 120_000) + "]}", "send"),
    ("lone_surrogate_key", "/v1/completions", '{"model":"%s","prompt":"x","\\ud800":1}' % MODEL, "send"),
    ("logit_bias_4001_digits", "/v1/completions", '{"model":"%s","prompt":"x","logit_bias":{"1":' % MODEL + "9" * 4001 + "}}", "send"),
    ("temperature_1e30", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 1e30}, "send"),
    ("n_over_share", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 64, "max_tokens": 2}, "send"),
    ("max_tokens_huge", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**9}, "send"),
    ("repetition_bound", "/v1/completions", {"model": MODEL, "prompt": "x", "guided_regex": "((a{60}){60}){60}"}, "send"),
    ("heavy_regex", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 8,
                                         "guided_regex": "((a{40}){40}){40}"}, "send"),
    ("contradiction", "/v1/completions", {"model": MODEL, "prompt": "x", "allowed_token_ids": [0],
                                           "guided_regex": "abc"}, "send"),
    ("ref_non_ascii_digit", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_json": {
        "anyOf": [{"type": "string"}], "$ref": "#/anyOf/\u00b2"}}, "send"),
    ("tool_args_surrogate", "/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": "\\ud800"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"}]}, "send"),
    ("unicode_stop_random", "/v1/completions", {"model": MODEL, "prompt": "e\u0301" * 50, "max_tokens": 24,
                                                 "temperature": 1.5, "stop": ["\ufffd", "\u0301"], "logprobs": 2,
                                                 "stream": True}, "send"),
    ("echo_every_id", "/v1/completions", {"model": MODEL, "prompt": list(range(512)), "echo": True,   # tiny's
                                           "logprobs": 1, "max_tokens": 1}, "send"),
    ("unserved_route", "/v1/embeddings", {"model": MODEL, "input": "x"}, "send"),
    ("constrained_dropped", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 64, "stream": True,
                                                 "guided_regex": "[a-z ]{10,200}"}, "drop"),
    ("plain_dropped", "/v1/chat/completions", {"model": MODEL, "max_tokens": 64, "stream": True,
                                                "messages": [{"role": "user", "content": "x"}]}, "drop"),
    ("trickled_body", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}, "trickle"),
    ("constrained_burst", "/v1/completions", {"model": MODEL, "prompt": "Letters:", "max_tokens": 12,
                                               "guided_regex": "[a-z]{3,9}( [a-z]{3,9}){0,5}"}, "burst"),
]


async def hostile_one(http: httpx.AsyncClient, base: str, item, timeout: float) -> list[int | str]:
    """Send one HOSTILE item; its status codes ("dropped" for a stream closed after 2 events)."""
    label, path, body, how = item
    raw = body.encode() if isinstance(body, str) else json.dumps(body, ensure_ascii=False).encode()
    headers = {"content-type": "application/json"}
    try:
        async with asyncio.timeout(timeout):
            if how == "burst":                              # six at once
                rs = await asyncio.gather(*(http.post(f"{base}{path}", content=raw, headers=headers)
                                            for _ in range(6)))
                return [r.status_code for r in rs]
            if how == "trickle":                            # 1 byte a second: past the body deadline
                async def gen():
                    for b in raw:
                        yield bytes([b])
                        await asyncio.sleep(1.0)
                try:
                    r = await http.post(f"{base}{path}", content=gen(), headers=headers)
                    return [r.status_code]
                except httpx.HTTPError:
                    return ["trickle_cut"]
            if how == "drop":
                async with http.stream("POST", f"{base}{path}", content=raw, headers=headers) as r:
                    n = 0
                    async for line in r.aiter_lines():
                        n += line.startswith("data: ")
                        if n >= 2:
                            return ["dropped"]
                    return [r.status_code]
            r = await http.post(f"{base}{path}", content=raw, headers=headers)
            return [r.status_code]
    except TimeoutError:
        return ["timeout"]
    except httpx.HTTPError as e:
        return [type(e).__name__]


async def run_phase(args, base: str, name: str, with_long: bool) -> dict:
    rng = random.Random(args.seed)
    n = args.clients
    leaving = set(rng.sample(range(n), round(args.disconnect * n)))
    starts = sorted(rng.uniform(0, args.ramp) for _ in range(n))
    longs = [long_prompt(base, args.long_tokens, 1000 + i) for i in range(args.long_requests)] if with_long else []
    blocks0 = metric(base, "cedlm_kv_blocks_in_use")
    disc0 = metric(base, "cedlm_client_disconnects_total")
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=0)
    stop_long = asyncio.Event()
    long_res: list[dict] = []
    hostile_codes: list[tuple[str, int | str]] = []
    with_hostile = name == "hostile"

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.client_timeout)) as http:
        async def bystander(i: int) -> dict:
            await asyncio.sleep(starts[i])
            prompt = f"client {i} of {name}: tell me a story about the number {i * 37 % 101}."
            r = await stream_one(http, base, prompt, args.max_tokens,
                                 args.disconnect_after if i in leaving else None, args.client_timeout)
            return {**r, "client": i, "leaves": i in leaving}

        async def tenant() -> None:
            for p, _ in longs:
                if stop_long.is_set():
                    break
                r = await stream_one(http, base, p, args.long_max_tokens, None, args.client_timeout)
                long_res.append(r)

        async def hostile(k: int) -> None:
            i = k
            while not stop_long.is_set():
                item = HOSTILE[i % len(HOSTILE)]
                i += args.hostile
                for code in await hostile_one(http, base, item, args.client_timeout):
                    hostile_codes.append((item[0], code))

        t0 = time.monotonic()
        ten = asyncio.create_task(tenant()) if with_long else None
        hos = [asyncio.create_task(hostile(k)) for k in range(args.hostile)] if with_hostile else []
        if with_long:
            await asyncio.sleep(0.5)                       # its prefill is under way first
        results = await asyncio.gather(*(bystander(i) for i in range(n)))
        bystanders_s = time.monotonic() - t0
        stop_long.set()                                    # no new long prompt; let the last finish
        if ten is not None:
            await ten
        for h in hos:
            await h
        wall = time.monotonic() - t0

    blocks1, waited = settle(base, blocks0, args.settle)
    stayed = [r for r in results if not r["leaves"]]
    left = [r for r in results if r["leaves"]]
    out = {
        "phase": name,
        "clients": n, "clients_disconnecting": len(left), "max_tokens": args.max_tokens,
        "wall_s": round(wall, 2), "bystanders_wall_s": round(bystanders_s, 2),
        "bystander_ttft_s": summary([r["ttft"] for r in stayed if r["ttft"] is not None]),
        "bystander_total_s": summary([r["total"] for r in stayed if r["total"] is not None and not r["error"]]),
        "disconnecting_ttft_s": summary([r["ttft"] for r in left if r["ttft"] is not None]),
        "errors_stayed": sum(1 for r in stayed if r["error"]),
        "errors_disconnecting": sum(1 for r in left if r["error"]),
        "error_samples": sorted({r["error"] for r in results if r["error"]})[:5],
        "disconnected": sum(1 for r in left if r["disconnected"]),
        "server_disconnects_counted": metric(base, "cedlm_client_disconnects_total") - disc0,
        "kv_blocks_in_use_before": blocks0, "kv_blocks_in_use_after": blocks1,
        "kv_settle_s": round(waited, 2),
    }
    if with_hostile:
        codes: dict[str, dict] = {}
        for label, code in hostile_codes:
            codes.setdefault(label, {})[str(code)] = codes.get(label, {}).get(str(code), 0) + 1
        fives = [(label, c) for label, c in hostile_codes        # a 5xx, a timeout, a broken connection
                 if (isinstance(c, int) and c >= 500) or (isinstance(c, str) and c not in ("dropped", "trickle_cut"))]
        out["hostile"] = {"clients": args.hostile, "requests": len(hostile_codes), "codes": codes,
                          "errors": len(fives), "error_samples": fives[:5]}
    if with_long:
        out["long_tenant"] = {
            "prompt_tokens": [k for _, k in longs[:len(long_res)]], "requests": len(long_res),
            "errors": sum(1 for r in long_res if r["error"]),
            "ttft_s": summary([r["ttft"] for r in long_res if r["ttft"] is not None]),
            "total_s": summary([r["total"] for r in long_res if r["total"] is not None]),
        }
    return out


async def short_behind_long(args, base: str) -> dict:
    """Finding 8 on its own: a short request sent while a long prompt is being prefilled, on an
    idle server. Its time to first token against the long prompt's."""
    text, n = long_prompt(base, args.long_tokens, 999)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.client_timeout)) as http:
        long_task = asyncio.create_task(stream_one(http, base, text, 2, None, args.client_timeout))
        await asyncio.sleep(0.5)                           # the long prefill is under way
        short = await stream_one(http, base, "a short question behind a long prompt", 4, None,
                                 args.client_timeout)
        long = await long_task
    blocks, _ = settle(base, 0, args.settle)
    return {"phase": "short_behind_long", "long_prompt_tokens": n,
            "short_ttft_s": round(short["ttft"], 3) if short["ttft"] else None,
            "short_total_s": round(short["total"], 3) if short["total"] else None,
            "long_ttft_s": round(long["ttft"], 3) if long["ttft"] else None,
            "errors": [r["error"] for r in (short, long) if r["error"]],
            "kv_blocks_in_use_after": blocks}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--disconnect", type=float, default=0.2, help="fraction that disconnect mid-stream")
    p.add_argument("--disconnect-after", type=int, default=4, help="tokens a leaving client reads first")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ramp", type=float, default=10.0, help="seconds over which the clients arrive")
    p.add_argument("--long-tokens", type=int, default=3800, help="prompt tokens of the long tenant "
                                                                "(tiny's context is 4096)")
    p.add_argument("--long-max-tokens", type=int, default=8)
    p.add_argument("--long-requests", type=int, default=8, help="most long prompts the tenant sends")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-waiting", type=int, default=128)
    p.add_argument("--queue-timeout", type=float, default=120.0)
    p.add_argument("--client-timeout", type=float, default=180.0, help="per request, seconds")
    p.add_argument("--settle", type=float, default=30.0, help="seconds to wait for KV back to baseline")
    p.add_argument("--max-seconds", type=float, default=300.0, help="the whole run, seconds")
    p.add_argument("--no-baseline", action="store_true", help="skip the bystanders-alone phase")
    p.add_argument("--hostile", type=int, default=0, help="hostile clients: run the `hostile` phase "
                   "(instead of `short_behind_long` and `long_tenant`)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="", help="more `cedlm serve` flags, e.g. "
                   "'--max-prefills-while-decoding 64'")
    p.add_argument("--server-log", default=None, help="file for the server's output")
    p.add_argument("--server-cwd", default=str(ROOT),
                   help="the checkout whose cedlm serves (default this one; another, to compare)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "load_test.json"))
    args = p.parse_args()

    port = free_port()
    base = f"http://{HOST}:{port}"
    proc = start_server(args, port)
    phases = []

    def _alarm(*_):
        raise TimeoutError(f"the load test ran past --max-seconds {args.max_seconds:g}")

    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(int(args.max_seconds))
    try:
        wait_ready(base, proc)
        compile_wait = wait_compiled(base, 1800.0)
        signal.alarm(int(args.max_seconds))          # the phases' time limit starts now
        asyncio.run(stream_one_warmup(base))
        if not args.hostile:
            phases.append(asyncio.run(short_behind_long(args, base)))
        if not args.no_baseline:
            phases.append(asyncio.run(run_phase(args, base, "baseline", with_long=False)))
        if args.hostile:
            phases.append(asyncio.run(run_phase(args, base, "hostile", with_long=False)))
        else:
            phases.append(asyncio.run(run_phase(args, base, "long_tenant", with_long=True)))
        health = httpx.get(f"{base}/health", timeout=10).json()
    finally:
        signal.alarm(0)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    report = {"command": " ".join(["python", *sys.argv]), "server_cwd": args.server_cwd,
              "server": {"model": "tiny", "max_num_seqs": args.max_num_seqs, "threads": 1,
                         "max_waiting": args.max_waiting, "queue_timeout": args.queue_timeout},
              "compile_wait_s": round(compile_wait, 1), "health_after": health, "phases": phases}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    bad = [ph["phase"] for ph in phases
           if ph.get("errors_stayed") or ph.get("errors") or ph.get("long_tenant", {}).get("errors")
           or ph.get("hostile", {}).get("errors")
           or ph["kv_blocks_in_use_after"] > ph.get("kv_blocks_in_use_before", 0)]
    if bad:
        print(f"FAILED: errors or KV blocks not back to baseline in {bad}", file=sys.stderr)
        return 1
    return 0


async def stream_one_warmup(base: str) -> None:
    """One short request first, so that one-time costs do not count as bystander latency."""
    async with httpx.AsyncClient() as http:
        r = await stream_one(http, base, "warm up", 2, None, 120)
        if r["error"]:
            raise SystemExit(f"warm-up request failed: {r['error']}")


if __name__ == "__main__":
    sys.exit(main())
