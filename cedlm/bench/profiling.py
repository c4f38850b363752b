"""Where the time goes: a cProfile of one call, summarised for BENCHMARKS.md.

Two views of the same run: cedlm functions by cumulative time (which component: indexer scoring,
top-k, MoE, mHC, attention, byte decode ...) and leaf calls by own time (which torch op or Python
function actually burns the cycles). Percentages are of the profiled call's wall time.
"""
from __future__ import annotations

import cProfile
import pstats
import time


def _name(func) -> str:
    path, line, fn = func
    if path == "~":
        return fn                                  # a builtin: "<built-in method torch.einsum>"
    parts = path.replace("\\", "/").split("/")
    if "cedlm" in parts:
        path = "/".join(parts[parts.index("cedlm"):])
    else:
        path = "/".join(parts[-2:])
    return f"{path}:{line}({fn})"


def _is_cedlm(func) -> bool:
    path = func[0].replace("\\", "/")
    return "/cedlm/" in path and "/cedlm/bench/" not in path


def _attributed(entries: dict) -> dict:
    """Own time of every call attributed to the nearest cedlm function up the call graph (torch
    ops and library helpers are charged to the cedlm code that called them, split by the share of
    time each caller spent in them); None collects what no cedlm function called."""
    memo: dict = {}

    def share(f, depth=0):
        if f in memo:
            return memo[f]
        if _is_cedlm(f):
            memo[f] = {f: 1.0}
            return memo[f]
        memo[f] = {None: 1.0}                       # guards recursion cycles
        callers = entries.get(f, (0, 0, 0, 0, {}))[4]
        tot = sum(v[-1] for v in callers.values())
        if depth > 12 or not callers or tot <= 0:
            return memo[f]
        out: dict = {}
        for c, v in callers.items():
            for k, x in share(c, depth + 1).items():
                out[k] = out.get(k, 0.0) + x * v[-1] / tot
        memo[f] = out
        return out

    agg: dict = {}
    for f, (cc, nc, tt, ct, callers) in entries.items():
        for k, x in share(f).items():
            agg[k] = agg.get(k, 0.0) + tt * x
    return agg


def profile_call(fn, top: int = 12) -> dict:
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    fn()
    prof.disable()
    total = time.perf_counter() - t0
    st = pstats.Stats(prof)
    entries = st.stats                             # func -> (cc, nc, tt, ct, callers)
    cum = sorted(((ct, f) for f, (cc, nc, tt, ct, _) in entries.items() if "/cedlm/" in f[0]
                  .replace("\\", "/")), reverse=True)
    own = sorted(((tt, f, nc) for f, (cc, nc, tt, ct, _) in entries.items()), reverse=True)
    cum = [(ct, f) for ct, f in cum if _is_cedlm(f) and ct < 0.995 * total]
    by_f = _attributed(entries)
    attr = sorted(((t, f) for f, t in by_f.items()), key=lambda x: -x[0])
    mods: dict = {}
    for f, t in by_f.items():
        m = "(outside cedlm)" if f is None else _name(f).split(":")[0]
        mods[m] = mods.get(m, 0.0) + t
    return {
        "wall_s": total,
        "by_module": [{"module": m, "s": t, "pct": 100 * t / total}
                      for m, t in sorted(mods.items(), key=lambda x: -x[1])],
        "by_function": [{"function": "(outside cedlm)" if f is None else _name(f), "s": t,
                         "pct": 100 * t / total} for t, f in attr[:top]],
        "cumulative": [{"function": _name(f), "s": ct, "pct": 100 * ct / total} for ct, f in cum[:top]],
        "own": [{"function": _name(f), "s": tt, "pct": 100 * tt / total, "calls": nc}
                for tt, f, nc in own[:top]],
    }


def profile_md(prof: dict, label: str) -> str:
    lines = [f"Profile of {label} (cProfile, {prof['wall_s']:.2f} s wall, profiler overhead "
             "included). Time of each cedlm module and function, including the torch ops it "
             "calls:", "", "| cedlm module | s | % |", "|---|---|---|"]
    lines += [f"| `{e['module']}` | {e['s']:.2f} | {e['pct']:.0f}% |" for e in prof["by_module"][:8]]
    lines += ["", "| cedlm function | s | % |", "|---|---|---|"]
    lines += [f"| `{e['function']}` | {e['s']:.2f} | {e['pct']:.0f}% |" for e in prof["by_function"][:10]]
    lines += ["", "Heaviest leaf calls (own time):", "",
              "| leaf call | calls | s | % |", "|---|---|---|---|"]
    lines += [f"| `{e['function']}` | {e['calls']:,} | {e['s']:.2f} | {e['pct']:.0f}% |"
              for e in prof["own"][:8]]
    return "\n".join(lines)
