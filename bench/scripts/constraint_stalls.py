"""A greedy bystander's longest gap and /health's worst latency while hostile constrained requests run.

    .venv/bin/python bench/scripts/constraint_stalls.py --case masks --requests 6
    .venv/bin/python bench/scripts/constraint_stalls.py --case masks --requests 6 --on-engine-thread
    .venv/bin/python bench/scripts/constraint_stalls.py --case compiles --requests 50
    .venv/bin/python bench/scripts/constraint_stalls.py --case plain --requests 6 --max-prefills-while-decoding 64

Serves `tiny` (1 torch thread, 8 sequence slots) in this process (its clients share one connection
pool: a client per request spent seconds of this process's time making SSL contexts) on a loopback port, streams a greedy (`--bystander-tokens`, 64)
bystander alone, then again while the hostile requests run, with /health and /v1/models polled
every 50 ms from another process. Cases:

- `masks`: `--requests` constrained requests at once whose grammar masks are slow
  (`--mask-delay` seconds added to each mask, or a real regex with `--regex`); with
  `--on-engine-thread` the engine waits for every mask (as when masks were computed on its
  thread).
- `compiles`: `--requests` distinct constraints at once from one client, each taking
  `--compile-delay` seconds longer to compile, then one constraint from another client (another
  loopback address): how long it waited, how many of the flood were 429.
- `plain`: `--requests` unconstrained streaming requests at once (12 greedy tokens each).

`--max-prefills-while-decoding N` sets the scheduler's bound on prefill chunks per step beside
decoding (64: no bound for these bursts). Prints one JSON line: the bystander's longest gap alone
and beside them, whether its text was identical, /health and /v1/models worst, the hostile
requests' status codes (and, for `masks` and `plain`, their time to first token and total, median
and worst, streamed), the engine's longest step, KV blocks in use after.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

BYSTANDER = {"model": "m", "prompt": "The bystander says", "max_tokens": 64, "temperature": 0,
             "ignore_eos": True, "stream": True}


def stream(httpx, base, body=BYSTANDER) -> tuple[str, float]:
    parts, last, gap = [], None, 0.0
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                now = time.monotonic()
                gap = max(gap, now - last) if last is not None else gap
                last = now
                parts.extend(c["text"] for c in json.loads(line[6:])["choices"])
    return "".join(parts), gap


# /health and /v1/models polled every 50 ms from a process of its own (a poller thread in this
# process measured its own waits for the GIL beside the server's threads: up to 0.4 s more);
# prints the worst of each when a line arrives on its stdin
POLLER = """
import json, sys, threading, time
import httpx
base, worst, stop = sys.argv[1], {"/health": 0.0, "/v1/models": 0.0}, threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
with httpx.Client(timeout=60) as c:
    while not stop.is_set():
        for path in worst:
            t0 = time.monotonic()
            c.get(base + path)
            worst[path] = max(worst[path], time.monotonic() - t0)
        time.sleep(0.05)
print(json.dumps(worst))
"""


def timed(client, base, body) -> tuple[int, float | None, float]:
    """Stream one request: (status, seconds to its first token, seconds in all)."""
    t0, first = time.monotonic(), None
    with client.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                first = time.monotonic() - t0
        return r.status_code, first, time.monotonic() - t0


def spread(xs) -> dict:
    xs = sorted(x for x in xs if x is not None)
    return {"median": round(xs[len(xs) // 2], 3), "max": round(xs[-1], 3)} if xs else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=("masks", "compiles", "plain"), default="masks")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--mask-delay", type=float, default=1.0)
    ap.add_argument("--regex", default=None, help="a real regex instead of the added mask delay")
    ap.add_argument("--compile-delay", type=float, default=5.0)
    ap.add_argument("--on-engine-thread", action="store_true")
    ap.add_argument("--decode-step", default=None, help="compiled (the CPU default: its graphs are "
                    "built before measuring), static, eager")
    ap.add_argument("--bystander-tokens", type=int, default=64,
                    help="the bystander's length (the compiled step is faster: 256 keeps it running "
                    "while the hostile requests arrive)")
    ap.add_argument("--max-prefills-while-decoding", type=int, default=None,
                    help="the scheduler's bound (default: the engine's)")
    a = ap.parse_args()
    import httpx

    from cedlm.engine import engine as engine_mod
    from cedlm.engine.llm import LLM
    from cedlm.server.app import create_app
    from cedlm.server.constrain import GrammarProcessor
    import os
    env = os.environ.get("CEDLM_DECODE_STEP")
    from test_server import serve              # (its conftest import sets the suite's static step)
    if env is None:
        os.environ.pop("CEDLM_DECODE_STEP", None)
    bound = {} if a.max_prefills_while_decoding is None else {
        "max_prefills_while_decoding": a.max_prefills_while_decoding}
    llm = LLM("tiny", num_threads=1, kv_budget_bytes=32 << 20, max_num_seqs=8, replay_mode="exact",
              decode_step=a.decode_step, **bound)
    if llm.engine.decoder.mode == "compiled":
        llm.engine.warm_up()                      # the compiled graphs in use before anything is measured
    app = create_app(llm, served_model_name="m")
    steps: list[float] = []                       # the engine's step times while the hostile run
    step_ = llm.engine.step

    def timed_step():
        t0 = time.perf_counter()
        try:
            return step_()
        finally:
            steps.append(time.perf_counter() - t0)
    llm.engine.step = timed_step
    if a.on_engine_thread:
        engine_mod.MASK_WAIT_S = 600.0
    if a.case == "masks" and a.regex is None:
        compute = GrammarProcessor._compute

        def slow(self, span):
            if span:
                time.sleep(a.mask_delay)
            return compute(self, span)
        GrammarProcessor._compute = slow
    with serve(app) as base:
        if a.case == "compiles":
            pool = app.state.server.grammars.pool()
            compile_ = pool.compile

            def slow_compile(param, kind, value):
                if str(value).startswith("flood"):
                    time.sleep(a.compile_delay)
                return compile_(param, kind, value)
            pool.compile = slow_compile
        by_body = {**BYSTANDER, "max_tokens": a.bystander_tokens}
        alone, gap_alone = stream(httpx, base, by_body)
        other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=600)
        other_alone = None
        if a.case == "compiles":                  # its normal time (a constraint of its own, compiled)
            t0 = time.monotonic()
            other.post(f"{base}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2,
                                                        "guided_regex": "alone[0-9]"})
            other_alone = round(time.monotonic() - t0, 3)
        got: dict = {}
        poller = subprocess.Popen([sys.executable, "-c", POLLER, base], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        by = threading.Thread(target=lambda: got.setdefault("b", stream(httpx, base, by_body)))
        steps.clear()
        by.start()
        time.sleep(0.3)
        out: dict = {"case": a.case, "requests": a.requests, "decode_step": llm.engine.decoder.mode,
                     "max_prefills_while_decoding": llm.engine.scheduler.max_prefills_while_decoding}
        flood = httpx.Client(limits=httpx.Limits(max_connections=a.requests + 4), timeout=600)
        with ThreadPoolExecutor(a.requests) as ex:
            if a.case in ("masks", "plain"):
                body = {"model": "m", "prompt": "Letters:", "max_tokens": 12, "temperature": 0}
                if a.case == "masks":
                    body["guided_regex"] = a.regex or "[a-z]{3,9}( [a-z]{3,9}){0,5}"
                    out.update(mask_delay=None if a.regex else a.mask_delay, regex=a.regex,
                               on_engine_thread=a.on_engine_thread)
                futs = [ex.submit(timed, flood, base, body) for _ in range(a.requests)]
                res = [f.result() for f in futs]
                out.update(ttft_s=spread(r[1] for r in res), total_s=spread(r[2] for r in res))
                codes = Counter(r[0] for r in res)
            else:
                futs = [ex.submit(flood.post, f"{base}/v1/completions",
                                  json={"model": "m", "prompt": "x", "max_tokens": 2, "guided_regex": f"flood{i}[a-z]+"})
                        for i in range(a.requests)]
                time.sleep(0.5)
                t0 = time.monotonic()
                r = other.post(f"{base}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2,
                                                                "guided_regex": "another[0-9]"})
                out.update(another_client_status=r.status_code, another_client_s=round(time.monotonic() - t0, 3),
                           another_client_alone_s=other_alone,
                           compile_delay=a.compile_delay)
                codes = Counter(f.result().status_code for f in futs)
        by.join(600)
        worst = json.loads(poller.communicate("stop\n", timeout=120)[0])
        text, gap = got["b"]
        kv = app.state.worker.call(lambda e: e.pool.num_used).result(10)
        out.update(codes=dict(codes), bystander_identical=text == alone, gap_alone_s=round(gap_alone, 3),
                   gap_s=round(gap, 3), health_worst_s=round(worst["/health"], 3),
                   models_worst_s=round(worst["/v1/models"], 3),
                   longest_step_s=round(max(steps, default=0.0), 3), kv_blocks_after=kv)
        print(json.dumps(out))


if __name__ == "__main__":
    main()
