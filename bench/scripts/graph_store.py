"""What the graph store gives: the decode step's graphs loaded whole by a new process, and the
step's time per token from a loaded graph against the same graph compiled lazily.

    .venv/bin/python bench/scripts/graph_store.py [--cache DIR] [--context 512] [--rounds 7] [--json out.json]

1. `cedlm warmup` twice in a new process each, with TORCHINDUCTOR_CACHE_DIR and CEDLM_CACHE_DIR
   under --cache (default: a fresh temporary directory, so the first run compiles and saves,
   the second loads): wall seconds of each command and the seconds of each graph as it reports
   them.
2. In this process, on the same caches: the shipped model's batch-1 graph loaded from the store
   (`CompiledDecode`) and the same step compiled lazily (`compile_step`, torch.compile as without
   the store), one sequence of --context tokens, --rounds rounds of 40 steps alternating between
   the two; median milliseconds per round and the median of per-round ratios (stored / lazy).
Prints a table and one JSON line (stable keys: "warmup_s", "warmup_graph_s", "ms_per_token",
"ratio_stored_over_lazy").
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def warmup_runs(env: dict) -> tuple[list[float], list[dict]]:
    walls, graphs = [], []
    for _ in range(2):
        t0 = time.monotonic()
        out = subprocess.run([str(ROOT / ".venv/bin/cedlm"), "warmup"], env=env, cwd=ROOT,
                             capture_output=True, text=True, check=True).stderr
        walls.append(round(time.monotonic() - t0, 1))
        graphs.append({m.group(1): float(m.group(2))
                       for m in re.finditer(r"warmup: (decode graph for batch [^:]+): ([\d.]+) s", out)})
    return walls, graphs


def step_ab(context: int, rounds: int) -> dict:
    import torch
    from cedlm.engine.args import EngineArgs
    from cedlm.engine.llm import LLM
    from cedlm.model.compiled_step import CompiledDecode, compile_step, graph_name
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model = LLM(model=None, args=EngineArgs(decode_step="static")).engine.model
    stored = CompiledDecode(model, "compiled")
    st = model.new_state()
    model.prefill(torch.randint(5, 4000, (context,), generator=torch.Generator().manual_seed(0)), st)
    lazy = compile_step(model.device, one_row_products=True)

    def args():
        a, _ = stored._inputs(torch.tensor([7]), [st])
        return stored.shape_for([st], None), a

    shapes, a = args()
    stored.forward(torch.tensor([7]), [st])          # loads (or compiles and saves) its graph
    lazy(shapes, *a)                                  # compiles lazily (inductor's cache helps)
    graph = graph_name(1, shapes.flat)
    per = {"stored": [], "lazy": []}
    for _ in range(rounds):
        for name in per:
            ts = []
            for _ in range(40):
                shapes, a = args()
                t0 = time.perf_counter()
                if name == "stored":
                    stored.fn(shapes, *a, graph=graph)
                else:
                    lazy(shapes, *a)
                ts.append(time.perf_counter() - t0)
            per[name].append(statistics.median(ts) * 1e3)
    return {"ms_per_token": {k: round(statistics.median(v), 2) for k, v in per.items()},
            "ratio_stored_over_lazy": round(statistics.median(
                [s / l for s, l in zip(per["stored"], per["lazy"])]), 3),
            "stored_source": stored.fn.last}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", default=None, help="directory for both caches (default: a fresh temporary one)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    cache = Path(a.cache or tempfile.mkdtemp(prefix="cedlm-graph-store-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
    os.environ["CEDLM_CACHE_DIR"] = str(cache / "cache")
    walls, graphs = warmup_runs(dict(os.environ))
    res = {"cache": str(cache), "warmup_s": walls, "warmup_graph_s": graphs, **step_ab(a.context, a.rounds)}
    print("| run | cedlm warmup, wall s | graphs, s |\n|---|---|---|")
    for name, w, g in zip(("first", "second"), walls, graphs):
        print(f"| {name} | {w} | {' + '.join(str(v) for v in g.values())} |")
    print(f"\nstep at {a.context} tokens, batch 1: stored {res['ms_per_token']['stored']} ms, lazy "
          f"{res['ms_per_token']['lazy']} ms, stored / lazy {res['ratio_stored_over_lazy']}")
    print(json.dumps(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
