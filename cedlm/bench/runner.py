"""Run figures: time each, attach the environment and the device, write JSON + PNG, print the
table, update BENCHMARKS.md.

A figure runs on the run's device (`Ctx.device`). A figure that measures the CPU by nature (its
C++ kernels, the host's memory) sets `CPU_ONLY` to the reason; on another device it is not run
but recorded as skipped with that reason (`skip_reason`), in its JSON, the printed table and
BENCHMARKS.md."""
from __future__ import annotations

import contextlib
import time
import traceback
from pathlib import Path

import torch

from cedlm.bench import (attention, capacity, decode, dspark, formats, kv_bytes, peer, prefill, resume,
                         step_ops)
from cedlm.bench.common import SCHEMA, Ctx, env_block, write_json
from cedlm.bench.report import update_md

FIGURES = {m.NAME: m for m in (kv_bytes, capacity, prefill, decode, step_ops, resume, formats, attention, peer,
                                dspark)}


def select(only: str | None) -> list[str]:
    if not only:
        return list(FIGURES)
    names = [n.strip() for n in only.split(",") if n.strip()]
    bad = [n for n in names if n not in FIGURES]
    if bad:
        raise ValueError(f"--only: unknown figure(s) {bad}; choose from {list(FIGURES)}")
    return [n for n in FIGURES if n in names]


def skip_reason(mod, device: torch.device) -> str | None:
    """Why figure `mod` does not run on `device` (None: it runs). Only the CPU runs a figure with
    `CPU_ONLY` set."""
    reason = getattr(mod, "CPU_ONLY", None)
    if reason is None or torch.device(device).type == "cpu":
        return None
    return f"{mod.NAME} skipped on {torch.device(device)}: {reason}"


def plan(names: list[str], device: torch.device) -> dict:
    """Figure name -> None (runs on `device`) or the reason it is skipped there."""
    return {name: skip_reason(FIGURES[name], device) for name in names}


def run_figures(names: list[str], ctx: Ctx, md_path: Path | None) -> list[dict]:
    torch.set_num_threads(ctx.threads)
    ctx.out.mkdir(parents=True, exist_ok=True)
    done = []
    for name in names:
        mod = FIGURES[name]
        ctx.log(f"== {name}: {mod.TITLE} ({'quick' if ctx.quick else 'full'} sizes, "
                f"{torch.get_num_threads()} thread(s), {ctx.device})")
        env = env_block(ctx.device)
        t0 = time.perf_counter()
        why = skip_reason(mod, ctx.device)
        try:
            if why is not None:
                res = {"skipped": why, "skip_reason": mod.CPU_ONLY, "config": {}, "rows": [],
                       "target": {"metric": "", "op": "==", "value": True, "measured": None,
                                  "met": None, "note": why}}
            else:
                # A CPU-only figure's tensors are host tensors by nature: under a default device
                # other than the CPU (the tests' implicit-device guard) the figure runs in
                # `with torch.device("cpu")`. Only then: torch.compile cannot trace under that
                # device mode, so the compiled decode step would fall back to the static one.
                host = (torch.device("cpu") if getattr(mod, "CPU_ONLY", None)
                        and torch.get_default_device().type != "cpu" else contextlib.nullcontext())
                with torch.no_grad(), host:
                    res = mod.run(ctx)
        except Exception as e:                      # record the failure, go on with the rest
            traceback.print_exc()
            res = {"error": f"{type(e).__name__}: {e}", "config": {}, "rows": [],
                   "target": {"metric": "", "op": "==", "value": True, "measured": None,
                              "met": None, "note": "the figure failed"}}
        res = {"name": name, "title": mod.TITLE, "schema": SCHEMA, "quick": ctx.quick,
               "device": str(ctx.device), "env": env, **res, "elapsed_s": time.perf_counter() - t0}
        res["plot"] = None
        if not res.get("error") and not res.get("skipped"):
            png = ctx.out / f"{name}.png"
            try:
                if mod.plot(res, png):
                    res["plot"] = png.name
            except Exception as e:                  # a plot must not lose the numbers
                res.setdefault("notes", []).append(f"plot failed: {type(e).__name__}: {e}")
        write_json(ctx.out, name, res)
        if res.get("error"):
            ctx.log(f"   FAILED: {res['error']}")
        elif res.get("skipped"):
            ctx.log(f"   {res['skipped']}")
        else:
            ctx.log(mod.table(res))
            t = res.get("targets") or {"": res["target"]}
            for k, tt in t.items():
                ctx.log(f"   target{' ' + k if k else ''}: {tt['metric']} {tt['op']} {tt['value']}; "
                        f"measured {tt['measured']}; met: {tt['met']}")
        ctx.log(f"   ({res['elapsed_s']:.1f} s)\n")
        if md_path is not None:
            update_md(md_path, ctx.out, [(res, mod)], FIGURES)
        done.append(res)
    return done
