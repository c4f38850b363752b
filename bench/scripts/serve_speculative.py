"""DSpark through the server, as a new user would try it: `cedlm serve` with and without
`--speculative`, N concurrent streaming completions, greedy.

    .venv/bin/python bench/scripts/serve_speculative.py --streams 8 --rounds 2 --out bench/results/serve_speculative.json

Each round starts the shipped model's server once plain and once with `--speculative`
(`--speculative-threshold` and `--speculative-policy` as given), one after the other on a free
loopback port (the order alternates per round, so drift on a shared machine falls on both), waits
until no graph is compiling in the background, one warm-up request each, then
`--streams` streaming `/v1/completions` at once: distinct openings of held-out corpus documents
(`data/corpus/val.txt`; `cedlm data prepare`), `--prompt-tokens` tokens each, temperature 0,
`ignore_eos`, `--max-tokens` new tokens. Measured per server: the wall time from the first request
sent to the last stream done, and the completion tokens (from each stream's usage); throughput =
tokens / wall; also the median time to first token and the median per-stream decode speed
((tokens - 1) / (done - first token)). The speed-up is speculative / plain throughput, per round
and in total; every speculative reply must equal the plain one (greedy), else exit status 1.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test import HOST, free_port, wait_compiled, wait_ready  # noqa: E402

from cedlm.bench.common import git_commit  # noqa: E402

MODEL = "cedlm"


def prompts(n: int, tokens: int) -> list[str]:
    """Openings of n held-out documents, about `tokens` tokens each (the shipped tokenizer)."""
    from cedlm.engine.loader import DEFAULT_MODEL
    from cedlm.text.documents import iter_documents
    from cedlm.text.tokenizer import load_tokenizer
    val = ROOT / "data" / "corpus" / "val.txt"
    if not val.exists():
        raise SystemExit(f"{val}: absent; run `cedlm data prepare` first")
    tok = load_tokenizer(DEFAULT_MODEL)
    out = []
    for doc in iter_documents(val):
        ids = tok.encode(doc)
        if len(ids) >= tokens + 8:
            out.append(tok.decode(ids[:tokens]))
        if len(out) == n:
            return out
    raise SystemExit(f"{val}: fewer than {n} documents of {tokens + 8} tokens")


def start(port: int, speculative: bool, args) -> subprocess.Popen:
    cmd = [str(Path(sys.executable).with_name("cedlm")), "serve", "--host", HOST, "--port", str(port),
           "--served-model-name", MODEL, "--threads", "1", "--max-num-seqs", str(max(args.streams, 1)),
           "--log-level", "warning"]
    if speculative:
        cmd += ["--speculative", "--speculative-threshold", str(args.threshold),
                "--speculative-policy", args.speculative_policy]
    if args.decode_step:
        cmd += ["--decode-step", args.decode_step]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)


async def one(http: httpx.AsyncClient, base: str, prompt: str, max_tokens: int, t_start: float) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    text, first, usage = [], None, None
    async with http.stream("POST", f"{base}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise SystemExit(f"error event: {ev['error']}")
            usage = ev.get("usage") or usage
            for ch in ev.get("choices") or []:
                if ch.get("text"):
                    first = first or time.monotonic()
                    text.append(ch["text"])
    done = time.monotonic()
    n = usage["completion_tokens"]
    return {"text": "".join(text), "tokens": n, "ttft": first - t_start,
            "decode_tps": (n - 1) / max(done - first, 1e-9), "done": done}


async def measure(base: str, ps: list[str], max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as http:
        await one(http, base, ps[0], 4, time.monotonic())                       # warm-up
        t0 = time.monotonic()
        res = await asyncio.gather(*(one(http, base, p, max_tokens, t0) for p in ps))
    wall = max(r["done"] for r in res) - t0
    tokens = sum(r["tokens"] for r in res)
    return {"wall_s": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall, 3),
            "ttft_median_s": round(statistics.median(r["ttft"] for r in res), 3),
            "stream_decode_tps_median": round(statistics.median(r["decode_tps"] for r in res), 3),
            "texts": [r["text"] for r in res]}


def serve_and_measure(speculative: bool, ps: list[str], args) -> dict:
    port = free_port()
    proc = start(port, speculative, args)
    try:
        base = f"http://{HOST}:{port}"
        wait_ready(base, proc, timeout=args.ready_timeout)
        wait_compiled(base, args.ready_timeout)       # graphs building in the background: timed after
        out = asyncio.run(measure(base, ps, args.max_tokens))
        out["decode_step"] = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0].get("decode_step")
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threshold", type=float, default=0.0)
    ap.add_argument("--speculative-policy", default="adaptive", choices=("adaptive", "always"),
                    help="the speculative server's policy (default adaptive, the engine's default)")
    ap.add_argument("--decode-step", default=None, help="the servers' --decode-step (default: theirs)")
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    load = os.getloadavg()
    ps = prompts(a.streams, a.prompt_tokens)
    rounds, identical = [], True
    for k in range(a.rounds):
        got = {}
        for spec in ((False, True) if k % 2 == 0 else (True, False)):
            got[spec] = serve_and_measure(spec, ps, a)
            print(f"round {k + 1}: {'speculative' if spec else 'plain      '} {got[spec]['tokens_per_s']:.1f} tok/s "
                  f"({got[spec]['tokens']} tokens in {got[spec]['wall_s']:.1f} s)", flush=True)
        identical &= got[True]["texts"] == got[False]["texts"]
        rounds.append({"plain": {k2: v for k2, v in got[False].items() if k2 != "texts"},
                       "speculative": {k2: v for k2, v in got[True].items() if k2 != "texts"},
                       "speedup": round(got[True]["tokens_per_s"] / got[False]["tokens_per_s"], 3)})
    tot = {s: sum(r[s]["tokens"] for r in rounds) / sum(r[s]["wall_s"] for r in rounds)
           for s in ("plain", "speculative")}
    out = {"streams": a.streams, "rounds": rounds, "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens,
           "threshold": a.threshold, "speculative_policy": a.speculative_policy, "threads": 1,
           "speedup": round(tot["speculative"] / tot["plain"], 3),
           "speedup_by_round": [r["speedup"] for r in rounds], "identical": identical,
           "load_at_start": [round(x, 2) for x in load],
           "command": " ".join([".venv/bin/python", "bench/scripts/serve_speculative.py", *(argv or sys.argv[1:])]),
           "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
           **dict(zip(("git_commit", "git_dirty"), git_commit()))}
    print(f"{a.streams} streams: speculative / plain throughput {out['speedup']:.2f}x "
          f"(rounds {', '.join(f'{x:.2f}x' for x in out['speedup_by_round'])}); replies identical: {identical}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
