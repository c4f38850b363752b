"""Cold compile time of the plain decode graphs and the compiled step's time per token.

    .venv/bin/python bench/scripts/compile_cost.py [--threads 1] [--context 512] [--json out.json]

With an empty inductor cache (a fresh temporary TORCHINDUCTOR_CACHE_DIR, unless --keep-cache),
the shipped model's decode step is compiled for batch 1 and for batch >= 2 over paged rows
(`CompiledDecode.warm_up`, what `cedlm serve` builds in the background); then one sequence of
--context tokens in the same block pool decodes, and the median milliseconds per token of the compiled step and of the same step
uncompiled are printed as a JSON line: {"compile_s": {graph: s}, "compile_total_s",
"compile_cpu_s" (this process and its compiler processes: the figure a busy machine does not
distort), "ms_per_token": {"compiled", "static"}, "regions"}. The C++ is compiled in this process
(TORCHINDUCTOR_COMPILE_THREADS=1), so its compiler processes' CPU time is counted.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--keep-cache", action="store_true", help="use the usual inductor cache")
    ap.add_argument("--cache-dir", default=None, help="this inductor cache directory (warm)")
    ap.add_argument("--modes", default="compiled,static", help="the steps to time per token")
    ap.add_argument("--batches", default="1,2", help="the graphs to compile: batch 1, batch >= 2")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = a.cache_dir
    elif not a.keep_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="cedlm-compile-cost-")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    import torch
    torch.set_num_threads(a.threads)
    from cedlm.cache.block_pool import BlockPool, BlockTable
    from cedlm.checkpoint import load_model
    from cedlm.model import compiled_step as cs
    from cedlm.model.compiled_step import CompiledDecode

    model = load_model(os.path.join(os.path.dirname(__file__), "../../cedlm/assets/model"))[0]
    step = CompiledDecode(model, "compiled")
    pool = BlockPool(model.kv_layout, 64, 64, device=model.device)      # the engine's paged rows
    t0, c0 = time.perf_counter(), _cpu()
    step.warm_up(tuple(int(b) for b in a.batches.split(",")), rows=lambda: pool.rows(BlockTable(pool)))
    total, cpu = time.perf_counter() - t0, _cpu() - c0
    res = {"compile_s": {k: round(v, 1) for k, v in step.compile_s.items()},
           "compile_total_s": round(total, 1), "compile_cpu_s": round(cpu, 1),
           "opt_level": getattr(cs, "OPT_LEVEL", "O3"), "threads": a.threads, "context": a.context,
           "regions": getattr(cs, "REGIONS", None),
           "kinds": getattr(step.fn, "kinds", None)}
    ms = {}
    for mode in a.modes.split(","):
        st = model.new_state(pool.rows(BlockTable(pool)))
        with torch.no_grad():
            model.prefill(torch.arange(a.context) % 4000 + 10, st)
        run = step if mode == "compiled" else CompiledDecode(model, "static")
        times, tok = [], 11
        for _ in range(a.tokens):
            t = time.perf_counter()
            logits = run([tok], [st])
            times.append((time.perf_counter() - t) * 1000)
            tok = int(logits[0].argmax())
        ms[mode] = round(statistics.median(times[3:]), 3)
    res["ms_per_token"] = ms
    print(json.dumps(res), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
