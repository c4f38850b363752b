"""Many connections trickling their request bodies into `cedlm serve`, beside a streaming bystander.

    .venv/bin/python bench/scripts/slow_bodies.py --connections 2000
    .venv/bin/python bench/scripts/slow_bodies.py --connections 18000 --seconds 60

Starts `cedlm serve --model tiny` (1 torch thread, `--decode-step static` unless `--decode-step`)
on a free loopback port (waiting until no graph compiles in the background), then opens `--connections` TCP connections over `--ramp` seconds. Each
sends the headers of a JSON POST to /v1/completions announcing a 4 KiB body, then one byte of it
every `--interval` seconds; when the server closes it (the body deadline: a 408), it connects
again, until `--seconds` have passed. Meanwhile a process of its own streams greedy 64-token
bystanders back to back (the longest gap between two tokens, whether each text equals the
first one's) and polls /health and /v1/models every 50 ms. The connections stay under the
process's file limit (`ulimit -n`) on both sides.

Prints one JSON line: connections open at the peak, 408 answers and other closes, connect errors,
the bystander runs, their longest gap and how many were identical, /health and /v1/models worst,
the server's peak RSS, its KV blocks in use after, and its garbage collections of 10 ms or more
while the connections trickled (count and longest by generation; `gen2` are the full passes),
timed by a `gc.callbacks` hook the server starts with.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test import HOST, free_port, wait_compiled, wait_ready  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = "cedlm-tiny"

# `cedlm serve` with a `gc.callbacks` hook: every garbage collection of 10 ms or more is appended to
# the file argv[1] (wall time, generation, seconds, objects collected); argv[2:] are serve's arguments
SERVER = r"""
import gc, runpy, sys, time
log = open(sys.argv[1], "a", buffering=1)
began = {}

def timed(phase, info):
    if phase == "start":
        began["t"] = time.perf_counter()
    elif "t" in began:
        took = time.perf_counter() - began.pop("t")
        if took >= 0.01:
            log.write(f"{time.time():.3f} {info['generation']} {took:.4f} {info['collected']}\n")

gc.callbacks.append(timed)
sys.argv = ["cedlm", *sys.argv[2:]]
runpy.run_module("cedlm.cli", run_name="__main__")
"""


def collections(path: Path, since: float, until: float) -> dict:
    """The server's collections of 10 ms or more between two wall times: how many and the longest,
    by generation (0, 1: young and middle; 2: full)."""
    out = {}
    for ln in path.read_text().splitlines() if path.exists() else []:
        t, gen, took, _ = ln.split()
        if since <= float(t) <= until:
            g = out.setdefault(f"gen{gen}", {"count": 0, "longest_s": 0.0})
            g["count"] += 1
            g["longest_s"] = round(max(g["longest_s"], float(took)), 3)
    return out


# a process of its own: bystanders back to back and /health, /v1/models polled; stops when a line
# arrives on its stdin and prints what it saw
WATCHER = r"""
import json, sys, threading, time
import httpx
base, model = sys.argv[1], sys.argv[2]
stop = threading.Event()
worst = {"/health": 0.0, "/v1/models": 0.0}
errors = []
runs = []
body = {"model": model, "prompt": "The bystander says", "max_tokens": 64, "temperature": 0,
        "ignore_eos": True, "stream": True}

def poll():
    with httpx.Client(timeout=120) as c:
        while not stop.is_set():
            for path in worst:
                t0 = time.monotonic()
                try:
                    code = c.get(base + path).status_code
                    if code != 200:
                        errors.append(f"{path}: {code}")
                except httpx.HTTPError as e:
                    errors.append(f"{path}: {type(e).__name__}")
                worst[path] = max(worst[path], time.monotonic() - t0)
            time.sleep(0.05)

def bystanders():
    with httpx.Client(timeout=300) as c:
        while not stop.is_set():
            parts, last, gap = [], None, 0.0
            try:
                with c.stream("POST", base + "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            now = time.monotonic()
                            gap = gap if last is None else max(gap, now - last)
                            last = now
                            parts.extend(ch["text"] for ch in json.loads(line[6:])["choices"])
                runs.append(("".join(parts), gap))
            except httpx.HTTPError as e:
                errors.append(f"bystander: {type(e).__name__}")

threads = [threading.Thread(target=poll), threading.Thread(target=bystanders)]
for t in threads:
    t.start()
sys.stdin.readline()
stop.set()
for t in threads:
    t.join(300)
first = runs[0][0] if runs else None
print(json.dumps({"worst": worst, "errors": errors[:10], "n_errors": len(errors), "runs": len(runs),
                  "identical": sum(t == first for t, _ in runs),
                  "gap": max((g for _, g in runs), default=None)}))
"""


def peak_rss_mib(pid: int) -> float | None:
    try:
        for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
            if ln.startswith("VmHWM:"):
                return round(int(ln.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


async def slow_client(port: int, deadline: float, interval: float, stats: dict) -> None:
    """One connection slot: trickle a body, reconnect when the server closes, until the deadline."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            f"Content-Length: 4096\r\n\r\n").encode()
    while time.monotonic() < deadline:
        try:
            reader, writer = await asyncio.open_connection(HOST, port)
        except OSError:
            stats["connect_errors"] += 1
            await asyncio.sleep(1.0)
            continue
        stats["open"] += 1
        stats["peak_open"] = max(stats["peak_open"], stats["open"])
        try:
            writer.write(head)
            await writer.drain()
            answer = asyncio.ensure_future(reader.read(200))
            while time.monotonic() < deadline and not answer.done():
                writer.write(b" ")
                await writer.drain()
                await asyncio.wait([answer], timeout=interval)
            if answer.done():
                got = answer.result()
                stats["answered_408" if b" 408 " in got[:20] else "closed_other"] += 1
            else:
                answer.cancel()
        except (OSError, asyncio.IncompleteReadError):
            stats["closed_other"] += 1
        finally:
            stats["open"] -= 1
            writer.close()


async def trickle(port: int, n: int, ramp: float, seconds: float, interval: float) -> dict:
    stats = {"open": 0, "peak_open": 0, "answered_408": 0, "closed_other": 0, "connect_errors": 0}
    deadline = time.monotonic() + seconds
    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(slow_client(port, deadline, interval, stats)))
        if ramp:
            await asyncio.sleep(ramp / n)
    await asyncio.gather(*tasks)
    stats.pop("open")
    return stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=2000)
    ap.add_argument("--ramp", type=float, default=10.0, help="seconds over which they connect")
    ap.add_argument("--seconds", type=float, default=40.0, help="how long they keep trickling")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between two bytes")
    ap.add_argument("--decode-step", default="static")
    ap.add_argument("--http", default="auto", help="the server's HTTP parser (cedlm serve --http)")
    ap.add_argument("--loop", default="auto", help="the server's event loop (cedlm serve --loop)")
    a = ap.parse_args()
    import httpx
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if a.connections > hard - 200:
        raise SystemExit(f"--connections {a.connections}: the file limit is {hard} (ulimit -n)")
    port = free_port()
    base = f"http://{HOST}:{port}"
    scratch = Path(tempfile.mkdtemp(prefix="slow_bodies."))
    gc_log = scratch / "gc.log"
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(gc_log), "serve", "--model", "tiny", "--host", HOST, "--port", str(port),
         "--served-model-name", MODEL, "--threads", "1", "--decode-step", a.decode_step, "--log-level", "warning",
         "--http", a.http, "--loop", a.loop],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})      # (the raised file limit is inherited)
    try:
        wait_ready(base, server, timeout=300)
        wait_compiled(base, 1800)                 # graphs compiling in the background: measured after
        httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "warm up", "max_tokens": 2},
                   timeout=120)                   # the engine switches to a built graph at a step
        card = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]
        watcher = subprocess.Popen([sys.executable, "-c", WATCHER, base, MODEL], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        time.sleep(2.0)                           # its first bystander alone
        since = time.time()
        stats = asyncio.run(trickle(port, a.connections, a.ramp, a.seconds, a.interval))
        until = time.time()
        seen = json.loads(watcher.communicate("stop\n", timeout=600)[0])
        kv = None
        for ln in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
            if ln.startswith("cedlm_kv_blocks_in_use"):
                kv = float(ln.rsplit(" ", 1)[1])
        print(json.dumps({"connections": a.connections, "seconds": a.seconds, "interval_s": a.interval,
                          "http": a.http, "loop": a.loop, "decode_step": card.get("decode_step"),
                          **stats, "bystander_runs": seen["runs"], "bystanders_identical": seen["identical"],
                          "bystander_longest_gap_s": None if seen["gap"] is None else round(seen["gap"], 3),
                          "health_worst_s": round(seen["worst"]["/health"], 3),
                          "models_worst_s": round(seen["worst"]["/v1/models"], 3),
                          "watcher_errors": seen["n_errors"], "watcher_error_samples": seen["errors"],
                          "server_peak_rss_mib": peak_rss_mib(server.pid), "kv_blocks_in_use_after": kv,
                          "server_collections_over_10ms": collections(gc_log, since, until)}))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
