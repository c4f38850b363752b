"""A greedy bystander's longest gap and /health's worst latency while requests full of large images arrive.

    .venv/bin/python bench/scripts/image_stalls.py --requests 3 --images 16 --side 6300
    .venv/bin/python bench/scripts/image_stalls.py --requests 3 --images 16 --side 2000

Serves a tiny random-weight vision model (the `tiny` preset with a one-layer ViT, as
tests/test_vision_server.py) in this process on a loopback port, streams a 64-token greedy
bystander alone, then again while `--requests` chat requests at once each carry `--images` PNG
images of `--side` x `--side` pixels (a flat field with a few noise tiles: a small body that
decodes to side^2 x 3 bytes), with /health polled
every 50 ms. Prints one JSON line: the image requests' status codes and seconds, the
bystander's longest gap alone and beside them, whether its text was identical, /health worst,
peak RSS (MiB) and KV blocks in use after.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import resource
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

BYSTANDER = {"model": "m", "prompt": "The bystander says", "max_tokens": 64, "temperature": 0,
             "ignore_eos": True, "stream": True}


def stream(c, base) -> tuple[str, float]:
    parts, last, gap = [], None, 0.0
    with c.stream("POST", f"{base}/v1/completions", json=BYSTANDER) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                now = time.monotonic()
                gap = max(gap, now - last) if last is not None else gap
                last = now
                parts.extend(ch["text"] for ch in json.loads(line[6:])["choices"])
    return "".join(parts), gap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--side", type=int, default=6300)
    a = ap.parse_args()
    import httpx
    import numpy as np
    from PIL import Image

    from cedlm.server.app import create_app
    from test_server import serve
    from tests.test_vision_server import _llm
    rng = np.random.default_rng(0)
    tile = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    im = Image.new("RGB", (a.side, a.side), (40, 90, 200))
    for y in range(0, a.side, 512):               # a few noisy tiles on a flat field: small, real work
        im.paste(tile, (y % (a.side - 64), y))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}]
             + [{"type": "image_url", "image_url": {"url": url}}] * a.images}]
    llm = _llm()
    app = create_app(llm, served_model_name="m", max_body_bytes=1 << 30)
    with serve(app) as base:
        c = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=a.requests + 4))
        alone, gap_alone = stream(c, base)
        worst, stop = [0.0], threading.Event()

        def poll():
            h = httpx.Client(timeout=60)
            while not stop.is_set():
                t0 = time.monotonic()
                h.get(f"{base}/health")
                worst[0] = max(worst[0], time.monotonic() - t0)
                time.sleep(0.05)
        poller = threading.Thread(target=poll)
        poller.start()
        got: dict = {}
        by = threading.Thread(target=lambda: got.setdefault("b", stream(c, base)))
        by.start()
        time.sleep(0.3)

        def one():
            t0 = time.monotonic()
            r = c.post(f"{base}/v1/chat/completions", json={"model": "m", "messages": msgs, "max_tokens": 2})
            return r.status_code, round(time.monotonic() - t0, 2), r.json().get("error", {}).get("message", "")[:120]
        with ThreadPoolExecutor(a.requests) as ex:
            res = list(ex.map(lambda _: one(), range(a.requests)))
        by.join(600)
        stop.set()
        poller.join(60)
        text, gap = got["b"]
        kv = app.state.worker.call(lambda e: e.pool.num_used).result(10)
        print(json.dumps({"requests": a.requests, "images": a.images, "side": a.side,
                          "png_mib": round(len(buf.getvalue()) / 2**20, 1),
                          "codes": dict(Counter(r[0] for r in res)), "seconds": [r[1] for r in res],
                          "message": res[0][2], "bystander_identical": text == alone,
                          "gap_alone_s": round(gap_alone, 3), "gap_s": round(gap, 3),
                          "health_worst_s": round(worst[0], 3),
                          "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                          "kv_blocks_after": kv}))


if __name__ == "__main__":
    main()
