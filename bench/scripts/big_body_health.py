"""/health latency and a bystander's stream while big request bodies arrive.

    .venv/bin/python bench/scripts/big_body_health.py --bodies 3 --mib 7.9

Serves `small` (1 torch thread, prompt limit 65,536 tokens) on a loopback port, starts a greedy
bystander stream, then posts `--bodies` completions requests at once, each a prompt of about
`--mib` MiB of English-like text, while /health is polled every 50 ms. Prints one JSON line:
the big requests' status codes and seconds, the worst and median /health latency, and the
bystander's longest gap between two events.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bodies", type=int, default=3)
    ap.add_argument("--mib", type=float, default=7.9)
    ap.add_argument("--text", choices=("words", "letters"), default="words")
    a = ap.parse_args()
    import httpx

    from cedlm.engine.llm import LLM
    from cedlm.server.app import create_app
    from test_server import serve
    llm = LLM("small", num_threads=1, max_model_len=65536, kv_budget_bytes=64 << 20)
    app = create_app(llm, served_model_name="m")
    n = int(a.mib * (1 << 20))
    unit = "the quick brown fox jumps over the lazy dog 12345, " if a.text == "words" else "a"
    text = (unit * (n // len(unit) + 1))[:n]
    with serve(app) as base:
        gaps, res, health = [], [], []
        stop = threading.Event()

        def bystander():
            last = time.perf_counter()
            with httpx.stream("POST", f"{base}/v1/completions", timeout=600,
                              json={"model": "m", "prompt": "bystander", "max_tokens": 4000, "stream": True,
                                    "ignore_eos": True, "temperature": 0}) as r:
                for _ in r.iter_lines():
                    now = time.perf_counter()
                    gaps.append(now - last)
                    last = now
                    if stop.is_set():
                        break

        def big():
            t = time.perf_counter()
            r = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": text, "max_tokens": 1},
                           timeout=600)
            res.append((r.status_code, round(time.perf_counter() - t, 2), r.text[:120]))
        by = threading.Thread(target=bystander, daemon=True)
        by.start()
        time.sleep(2)
        gaps.clear()
        ths = [threading.Thread(target=big) for _ in range(a.bodies)]
        for th in ths:
            th.start()
        while any(th.is_alive() for th in ths):
            t = time.perf_counter()
            httpx.get(f"{base}/health", timeout=600)
            health.append(time.perf_counter() - t)
            time.sleep(0.05)
        stop.set()
        print(json.dumps({"bodies": a.bodies, "mib": a.mib, "text": a.text, "big": res,
                          "health_worst_s": round(max(health), 3),
                          "health_median_s": round(statistics.median(health), 3),
                          "bystander_longest_gap_s": round(max(gaps), 3) if gaps else None}))


if __name__ == "__main__":
    main()
