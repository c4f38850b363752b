"""A bystander's latency while one request of many prompts runs.

    .venv/bin/python bench/scripts/fair_share.py --shares 4 8

Serves `tiny` (8 sequence slots, 1 torch thread) on a loopback port. For each per-owner share
given (`Scheduler.max_seqs_per_owner`, set on the live scheduler; 8 = no cap: every
slot open to one request), runs a 16-prompt completions request of 24 greedy tokens alone, then again
with a 4-token request sent as soon as the big one runs. Prints one JSON line per share: the big
request's seconds alone and beside the bystander, and the bystander's seconds.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shares", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=24)
    a = ap.parse_args()
    import httpx

    from test_server import MODEL, make_app, serve

    def post(base, body):
        return httpx.post(f"{base}/v1/completions", json=body, timeout=600)

    big = {"model": MODEL, "prompt": [f"prompt number {i} says" for i in range(a.prompts)],
           "max_tokens": a.tokens, "temperature": 0, "ignore_eos": True}
    small = {"model": MODEL, "prompt": "a bystander", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for share in a.shares:
        app = make_app(max_num_seqs=8, max_waiting=32)
        worker = app.state.worker
        with serve(app) as base:
            worker.call(lambda e: setattr(e.scheduler, "max_seqs_per_owner", share)).result(10)
            t0 = time.monotonic()
            post(base, big)
            alone = time.monotonic() - t0
            th = threading.Thread(target=lambda: post(base, big))
            t0 = time.monotonic()
            th.start()
            while not worker.call(lambda e: any(r.owner for r in e.scheduler.active)).result(5):
                time.sleep(0.01)
            t1 = time.monotonic()
            r = post(base, small)
            by = time.monotonic() - t1
            th.join()
            print(json.dumps({"share": share, "big_alone_s": round(alone, 2), "bystander_s": round(by, 2),
                              "big_beside_bystander_s": round(time.monotonic() - t0, 2),
                              "bystander_status": r.status_code}), flush=True)


if __name__ == "__main__":
    main()
