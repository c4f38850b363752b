"""Figure: torch ops and Python calls per decoded token, eager step against compiled step.

What one decoded token costs the interpreter: the eager reference step (`CEDModel.decode`)
against the compiled static step (`cedlm/model/compiled_step.py`, the engine's default).

For each path, at batch 1 on a state of `context` tokens (built directly, as the decode figure
does): `torch.profiler` over n steps counts the ops it records, split into top-level ops (no
parent op: what the Python side dispatches) and all ops (nested ones included: what runs inside
an op, a custom op's own aten calls, the compiled graph's extern kernels); cProfile counts the
Python function calls per token; the step time is the median of interleaved repeats. The
compiled step's graph shows up as a few records ("Torch-Compiled Region", "## Call
CompiledFxGraph ##") with its extern kernels (matrix products, cedlm custom ops) nested inside;
its fused C++ loops are not ops and are not counted. Targets: top-level ops per token
<= 200 (eager: 3,585), all ops <= 500 (eager: 9,044).
"""
from __future__ import annotations

import cProfile
import pstats
from collections import Counter

import torch

from cedlm.bench.common import (Ctx, ced_decode_fn, md_table, measure_interleaved, plt, save_plot,
                               stats, synth_ced_state, target)

NAME = "step_ops"
TITLE = "Interpreter cost of a decoded token: torch ops and Python calls"
CPU_ONLY = ("it counts the CPU profiler's ops and the Python calls of the CPU compiled step "
            "(inductor's C++ graph) against its targets; on a GPU the step replays a captured "
            "CUDA graph (its time is the decode and peer figures')")


def _count_ops(fn, n: int) -> dict:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            fn()
    events = [e for e in prof.events() if not e.name.startswith("ProfilerStep")]
    top = [e for e in events if e.cpu_parent is None]
    names = Counter(e.name for e in top)
    return {"top_level_ops_per_token": len(top) / n, "all_ops_per_token": len(events) / n,
            "top_level_names": dict(names.most_common(12))}


def _count_calls(fn, n: int) -> float:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    return pstats.Stats(pr).total_calls / n


def run(ctx: Ctx) -> dict:
    context = ctx.size(512, 512)
    steps, warm, n = ctx.size(21, 5), ctx.size(3, 1), ctx.size(5, 2)
    ced = ctx.ced()
    mode = ctx.engine_options.get("decode_step") or None
    paths = {"eager": ced.decode, "compiled": ced_decode_fn(ced, mode)}
    if getattr(paths["compiled"], "mode", "eager") == "eager":
        return {"skipped": "step_ops: the decode step is eager here (--decode-step eager or "
                           "CEDLM_REFERENCE_KERNELS=1): nothing to compare"}
    states = {k: synth_ced_state(ced, context, seed=ctx.seed) for k in paths}
    fns = {k: (lambda f=f, st=states[k]: f([7], [st])) for k, f in paths.items()}
    for f in fns.values():                       # compile (and warm) before anything is counted
        f()
    times = measure_interleaved(fns, steps, warm)
    rows = []
    for k, f in fns.items():
        row = {"path": k, **_count_ops(f, n), "python_calls_per_token": _count_calls(f, n),
               **{f"step_{a}": b for a, b in stats(times[k]).items() if a in ("median_s", "spread")}}
        rows.append(row)
        ctx.log(f"  {k}: {row['top_level_ops_per_token']:.0f} top-level ops, {row['all_ops_per_token']:.0f} "
                f"ops, {row['python_calls_per_token']:.0f} Python calls per token, "
                f"{row['step_median_s'] * 1e3:.2f} ms")
    e, c = rows
    comp = paths["compiled"]
    return {
        "config": {"context": context, "batch": 1, "steps": steps, "profiled_steps": n,
                   "decode_step": comp.mode, "weights": "random (seeded), CED-small config"},
        "rows": rows,
        "speedup": e["step_median_s"] / c["step_median_s"],
        "compile_s": dict(comp.compile_s),
        "targets": {
            "top_level": target("top-level torch ops per decoded token (compiled step)", "<=", 200,
                                c["top_level_ops_per_token"]),
            "all_ops": target("all torch ops per decoded token, nested included (compiled step)", "<=",
                              500, c["all_ops_per_token"]),
        },
        "target": target("top-level torch ops per decoded token (compiled step)", "<=", 200,
                         c["top_level_ops_per_token"]),
    }


def table(res: dict) -> str:
    body = [[r["path"], f"{r['top_level_ops_per_token']:.0f}", f"{r['all_ops_per_token']:.0f}",
             f"{r['python_calls_per_token']:.0f}", f"{r['step_median_s'] * 1e3:.2f}"] for r in res["rows"]]
    t = md_table(["decode step", "top-level ops / token", "all ops / token", "Python calls / token",
                  "ms / token (median)"], body)
    comp = res.get("compile_s") or {}
    t += (f"\n\nCompiled / eager step time: {1 / res['speedup']:.2f} ({res['speedup']:.2f}x faster) at "
          f"{res['config']['context']} tokens, batch 1"
          + "".join(f"; compile (or cache load) of the graph for batch {g}: {v:.1f} s" for g, v in comp.items()))
    t += "\n\nTop-level ops of the compiled step: " + ", ".join(
        f"{k} x{v / res['config']['profiled_steps']:.0f}" for k, v in res["rows"][1]["top_level_names"].items())
    return t


def plot(res: dict, path) -> bool:
    pyplot = plt()
    if pyplot is None:
        return False
    rows = res["rows"]
    fig, ax = pyplot.subplots(figsize=(7, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["top_level_ops_per_token"] for r in rows], 0.4, label="top-level ops")
    ax.bar([x + 0.2 for x in xs], [r["all_ops_per_token"] for r in rows], 0.4, label="all ops")
    ax.set_xticks(list(xs), [r["path"] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("per decoded token")
    ax.set_title("Torch ops per decoded token")
    ax.legend()
    return save_plot(pyplot, fig, path)
