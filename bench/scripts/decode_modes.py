"""Milliseconds per decoded token of the shipped model, batch 1, for each decode-step mode.

    .venv/bin/python bench/scripts/decode_modes.py [eager static compiled ...]

A 512-token prompt, greedy, 1 thread. Per run: the time of a 48-token generation minus that of a
1-token generation of the same prompt (both hit the prefix cache after a warm-up), over the 47
extra tokens; the median of 5 runs is printed as one JSON line per mode. Used to compare two
checkouts (run it with PYTHONPATH set to each, alternating) on a noisy shared machine.
"""
import json
import statistics
import sys
import time

import torch


def ms_per_token(mode: str, runs: int = 5, prompt_tokens: int = 512, tokens: int = 48) -> list[float]:
    from cedlm import LLM, SamplingParams
    llm = LLM(max_num_seqs=1, decode_step=mode)
    ids = [(7 * i) % 4000 + 10 for i in range(prompt_tokens)]
    many = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([ids], many)                                     # warm-up (and graphs)
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        llm.generate([ids], one)
        t1 = time.perf_counter()
        llm.generate([ids], many)
        t2 = time.perf_counter()
        out.append(((t2 - t1) - (t1 - t0)) / (tokens - 1) * 1000)
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    for mode in sys.argv[1:] or ["eager", "static", "compiled"]:
        res = ms_per_token(mode)
        print(json.dumps({"mode": mode, "ms_per_token": statistics.median(res), "runs": res}), flush=True)
