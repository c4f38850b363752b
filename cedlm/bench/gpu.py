"""The GPU figure set: one phase per process, then one JSON and one table.

`bench/scripts/gpu_check.sh` runs each phase under its own timeout and records how it ended; a
phase is

    python -m cedlm.bench.gpu PHASE --out DIR [--profile gpu|cpu-smoke] [--device D] [--timeout-s N]

    exact      CPU vs device: codec bytes (kv_fp4, index_fp4, window_fp8, v4_fp8) and model logits
               (gpu_exact.py)
    capacity   sequences of small40 vs small40-v4flash in a 40 GiB KV budget at 32k and 128k,
               counted from live device allocations (gpu_capacity.py)
    decode     decode tokens/s at batch 1, 8, 64 and contexts 512 .. 32k, CED vs the HF Llama of
               equal parameters (gpu_decode.py)
    assemble   DIR/parts/*.json + DIR/phases.tsv (the script's record of each phase) + the test
               phases' JUnit XML -> DIR/gpu_check.json and DIR/gpu_check.md (printed)

A figure phase writes DIR/parts/PHASE.json: its device, start and end times and its result, or
its error; the decode phase rewrites it after every cell, so a phase killed by its timeout keeps
what it measured. Sizes come from a profile: `gpu` (the figures as the issue states them) or
`cpu-smoke` (tiny sizes: the whole path on the CPU in seconds, for the tests).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback
from pathlib import Path

from cedlm.bench.common import GIB, MIB, md_table

SCHEMA = 1
FIGURE_PHASES = ("exact", "capacity", "decode")
TEST_PHASES = ("tests_golden", "tests", "tests_compiled")
PHASE_ORDER = ("exact", "capacity", "tests_golden", "tests", "decode", "tests_compiled")
DECODE_MARGIN_S = 25          # of the decode phase's timeout: imports, model build, the last cell
PROFILES = {
    "gpu": {
        "exact": {"codecs": {"rows": 4096}, "logits": {"presets": ("tiny", "small"), "tokens": 128,
                                                       "decode_steps": 4}},
        "capacity": {"budget_bytes": 40 * GIB, "contexts": (32768, 131072), "probe_blocks": 1024},
        "decode": {"batches": (1, 8, 64), "contexts": (512, 2048, 8192, 32768), "new_tokens": 16,
                   "repeats": 3, "cell_cap_s": 20.0, "preset": "small",
                   "memory_cap_bytes": 64 * GIB},
    },
    "cpu-smoke": {
        "exact": {"codecs": {"rows": 64}, "logits": {"presets": ("tiny",), "tokens": 24,
                                                     "decode_steps": 2}},
        "capacity": {"budget_bytes": 64 * MIB, "contexts": (1024, 4096), "probe_blocks": 8},
        "decode": {"batches": (1, 2), "contexts": (32,), "new_tokens": 2, "repeats": 2,
                   "cell_cap_s": 5.0, "preset": "tiny", "decode_step": "static",
                   "memory_cap_bytes": 1 * GIB},
    },
}


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _write(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    tmp.replace(path)


# ============================================================================ figure phases
def run_phase(phase: str, out: Path, profile: str = "gpu", device: str | None = None,
              timeout_s: float | None = None, decode_step: str | None = None, log=print) -> int:
    """Run one figure phase and write out/parts/PHASE.json; 0 when it succeeded, else 1."""
    import torch
    from cedlm.bench.gpu_common import device_info
    from cedlm.util import resolve_device
    if phase not in FIGURE_PHASES:
        raise ValueError(f"phase: {phase!r} is not one of {FIGURE_PHASES}")
    if profile not in PROFILES:
        raise ValueError(f"profile: {profile!r} is not one of {sorted(PROFILES)}")
    dev = resolve_device(device, "--device")
    sizes = PROFILES[profile][phase]
    path = out / "parts" / f"{phase}.json"
    part = {"phase": phase, "profile": profile, "device": device_info(dev), "started_at": now(),
            "timeout_s": timeout_s, "sizes": sizes, "status": "running"}
    _write(path, part)
    t0 = time.perf_counter()
    ok = True
    with torch.no_grad():
        try:
            if phase == "exact":
                part["result"], ok = _exact(dev, sizes, log)
            elif phase == "capacity":
                from cedlm.bench.gpu_capacity import capacity
                part["result"] = capacity(dev, log=log, on_row=_keeper(part, path), **sizes)
            else:
                ok = _decode(dev, sizes, part, path, timeout_s, decode_step, log)
        except Exception as e:
            traceback.print_exc()
            part["error"] = f"{type(e).__name__}: {e}"
            part["traceback"] = traceback.format_exc()[-4000:]
            ok = False
    part.update(status="done" if ok else "failed", finished_at=now(),
                elapsed_s=time.perf_counter() - t0)
    if dev.type == "cuda":
        try:
            part["peak_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(dev)
        except Exception as e:               # a device in an error state: keep the result
            part["peak_memory_allocated_bytes"] = f"unavailable ({type(e).__name__}: {e})"
    _write(path, part)
    return 0 if ok else 1


def _exact(dev, sizes: dict, log) -> tuple[dict, bool]:
    """Both halves of the exactness figure, each recorded even when the other raises."""
    from cedlm.bench import gpu_exact
    res, ok = {}, True
    for name, fn in (("codecs", gpu_exact.codecs), ("logits", gpu_exact.logits)):
        try:
            kw = dict(sizes[name])
            if name == "logits":
                kw["log"] = log
            res[name] = fn(dev, **kw)
        except Exception as e:
            traceback.print_exc()
            res[name] = {"error": f"{type(e).__name__}: {e}"}
            ok = False
    return res, ok


def _decode(dev, sizes: dict, part: dict, path: Path, timeout_s, decode_step, log) -> bool:
    from cedlm.bench.gpu_decode import decode_throughput
    kw = dict(sizes)
    if decode_step is not None:
        kw["decode_step"] = decode_step
    budget = 150.0 if timeout_s is None else max(5.0, timeout_s - DECODE_MARGIN_S)
    part["result"] = decode_throughput(dev, budget_s=budget, log=log, on_row=_keeper(part, path), **kw)
    return True


def _keeper(part: dict, path: Path):
    """A figure's `on_row`: the result so far into the part, the part to disk."""
    def keep(res):
        part["result"] = res
        _write(path, part)
    return keep


# ============================================================================ assemble
def read_phases(path: Path) -> dict:
    """The script's record (one line per phase: name, rc or "skipped", wall s, timeout s,
    reason) -> {name: {status, rc, wall_s, timeout_s, reason}}."""
    out = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        f = line.split("\t")
        if len(f) < 4:
            continue
        name, rc, wall, limit = f[:4]
        reason = f[4] if len(f) > 4 else ""
        if rc == "skipped":
            status, code = "skipped", None
        else:
            code = int(rc)
            status = ("ok" if code == 0 else "timed_out" if code in (124, 137)
                      else "no_tests" if code == 5 and name in TEST_PHASES else "failed")
        out[name] = {"status": status, "rc": code, "wall_s": float(wall), "timeout_s": float(limit),
                     "reason": reason or None, "log": f"logs/{name}.log"}
    return out


def read_pytest_log(path: Path) -> dict | None:
    """Counts from a verbose pytest log, for a run killed before it wrote its JUnit XML; the test
    that was running when it was killed is `unfinished`."""
    import re
    if not path.exists():
        return None
    out = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [],
           "skip_reasons": {}, "unfinished": None, "from": "log (no JUnit XML: the run was cut)"}
    key = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped",
           "XFAIL": "passed", "XPASS": "passed"}
    for line in path.read_text(errors="replace").splitlines():
        m = re.match(r"^(tests/\S+::\S+)\s*(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)?", line)
        if not m:
            continue
        if m.group(2) is None:
            out["unfinished"] = m.group(1)
            continue
        out["tests"] += 1
        out[key[m.group(2)]] += 1
        if m.group(2) in ("FAILED", "ERROR"):
            out["failures"].append(m.group(1))
        out["unfinished"] = None
    return out


def read_junit(path: Path) -> dict | None:
    """Counts and the failing / skipped tests of a pytest JUnit XML file, or None."""
    import xml.etree.ElementTree as ET
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        return {"error": f"unreadable JUnit XML: {e}"}
    out = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [],
           "skip_reasons": {}}
    for case in root.iter("testcase"):
        out["tests"] += 1
        cid = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None:
            out["failed"] += 1
            out["failures"].append(cid)
        elif case.find("error") is not None:
            out["errors"] += 1
            out["failures"].append(cid)
        elif (s := case.find("skipped")) is not None:
            out["skipped"] += 1
            why = (s.get("message") or "")[:200]
            out["skip_reasons"][why] = out["skip_reasons"].get(why, 0) + 1
        else:
            out["passed"] += 1
    return out


def assemble(out: Path, profile: str, budget_s: float | None = None,
             started: float | None = None) -> dict:
    """Merge what the phases left into out/gpu_check.json and out/gpu_check.md."""
    from cedlm.bench.common import env_block
    phases = read_phases(out / "phases.tsv")
    for name in PHASE_ORDER:
        phases.setdefault(name, {"status": "not_run", "rc": None, "wall_s": 0.0, "timeout_s": None,
                                 "reason": "not selected (GPU_CHECK_PHASES)", "log": None})
    figures, device = {}, None
    for name in FIGURE_PHASES:
        p = out / "parts" / f"{name}.json"
        if p.exists():
            part = json.loads(p.read_text())
            figures[name] = part
            device = device or part.get("device")
            if part.get("status") == "running" and phases[name]["status"] == "ok":
                phases[name]["status"] = "failed"
    tests = {name: read_junit(out / f"{name}.xml") or read_pytest_log(out / "logs" / f"{name}.log")
             for name in TEST_PHASES}
    if device is None:
        device = _device_now()
    ok = all(p["status"] in ("ok", "no_tests") for p in phases.values() if p["status"] != "not_run")
    res = {"schema": SCHEMA, "name": "gpu_check", "profile": profile, "ok": ok,
           "started_at": (datetime.datetime.fromtimestamp(started, datetime.timezone.utc)
                          .isoformat(timespec="seconds") if started else None),
           "finished_at": now(), "wall_s": time.time() - started if started else None,
           "budget_s": budget_s, "device": device, "env": {**env_block(), "packages": packages()},
           "phases": {k: phases[k] for k in sorted(phases, key=_order)},
           "tests": tests, "checks": checks(figures, tests), "figures": figures}
    _write(out / "gpu_check.json", res)
    (out / "gpu_check.md").write_text(report(res) + "\n")
    return res


def checks(figures: dict, tests: dict) -> dict:
    """The verdicts in one place (None: not measured): codec bytes identical, logits within the
    golden bounds, the capacity ratio against the seeds' ~4x, decode cells by status, test
    failures."""
    def res(name):
        return (figures.get(name) or {}).get("result") or {}
    ex, cap, dec = res("exact"), res("capacity"), res("decode")
    cells = [c.get("status") for r in dec.get("rows", []) for c in (r.get("ced", {}), r.get("hf", {}))]
    return {"codecs_identical": (ex.get("codecs") or {}).get("identical"),
            "logits_within_tolerance": (ex.get("logits") or {}).get("within_tolerance"),
            "capacity_ratio_worst": (cap.get("target") or {}).get("measured"),
            "capacity_ratio_met": (cap.get("target") or {}).get("met"),
            "decode_cells": {k: cells.count(k) for k in ("measured", "skipped", "failed")},
            "tests_failed": {k: (t["failed"] + t["errors"] if t and "failed" in t else None)
                             for k, t in tests.items()}}


def packages() -> dict:
    """Versions of what the phases lean on (None: not installed)."""
    import importlib.metadata as md
    out = {}
    for name in ("torch", "transformers", "triton", "numpy", "safetensors"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def _order(name: str) -> int:
    return PHASE_ORDER.index(name) if name in PHASE_ORDER else len(PHASE_ORDER)


def _device_now() -> dict:
    from cedlm.bench.gpu_common import device_info
    from cedlm.util import resolve_device
    try:
        return device_info(resolve_device(None))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def report(res: dict) -> str:
    """The human table: device, phases, tests, then each figure's table (or its error)."""
    from cedlm.bench import gpu_capacity, gpu_decode, gpu_exact
    d = res["device"] or {}
    lines = [f"# GPU check ({res['profile']}): {'all phases ok' if res['ok'] else 'SOME PHASES FAILED'}",
             "", f"Device: {d.get('description') or d.get('device')} (torch {d.get('torch')}, "
                 f"CUDA {d.get('torch_cuda')}); started {res['started_at']}, finished "
                 f"{res['finished_at']}, {res['wall_s'] or 0:.0f} s of a {res['budget_s'] or 0:.0f} s budget.", ""]
    body = [[k, p["status"], p["rc"] if p["rc"] is not None else "", f"{p['wall_s']:.1f}",
             p["timeout_s"] if p["timeout_s"] is not None else "", p["reason"] or ""]
            for k, p in res["phases"].items()]
    lines += [md_table(["phase", "status", "rc", "wall s", "timeout s", "note"], body), ""]
    lines += ["Checks: " + ", ".join(f"{k} {v}" for k, v in res["checks"].items()), ""]
    for name, t in res["tests"].items():
        if t and "error" not in t:
            lines.append(f"{name}: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, "
                         f"{t['skipped']} skipped" + (f"; failing: {', '.join(t['failures'][:20])}"
                                                      if t["failures"] else "")
                         + (f"; cut while running {t['unfinished']}" if t.get("unfinished") else ""))
    for name, mod in (("exact", gpu_exact), ("capacity", gpu_capacity), ("decode", gpu_decode)):
        part = res["figures"].get(name)
        lines += ["", f"## {name}", ""]
        if part is None:
            lines.append("no result (the phase did not run or did not start)")
            continue
        if part.get("error"):
            lines.append(f"FAILED: {part['error']}")
        if part.get("result"):
            try:
                lines.append(mod.table(part["result"]))
            except Exception as e:               # a table must not lose the JSON
                lines.append(f"(table failed: {type(e).__name__}: {e}; see gpu_check.json)")
    return "\n".join(lines)


# ============================================================================ command line
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cedlm.bench.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=FIGURE_PHASES + ("assemble",))
    p.add_argument("--out", type=Path, required=True, metavar="DIR")
    p.add_argument("--profile", default="gpu", choices=sorted(PROFILES))
    p.add_argument("--device", default=None, help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="the phase's timeout (the decode figure budgets its cells within it)")
    p.add_argument("--decode-step", default=None,
                   help="decode figure: the CED decode step mode (default: the engine's)")
    p.add_argument("--budget-s", type=float, default=None, help="assemble: the script's budget")
    p.add_argument("--started", type=float, default=None, help="assemble: the script's start (epoch s)")
    a = p.parse_args(argv)
    if a.phase == "assemble":
        res = assemble(a.out, a.profile, a.budget_s, a.started)
        print(report(res), flush=True)
        print(f"\nJSON: {a.out / 'gpu_check.json'}  table: {a.out / 'gpu_check.md'}")
        return 0 if res["ok"] else 1
    try:
        return run_phase(a.phase, a.out, a.profile, a.device, a.timeout_s, a.decode_step,
                         log=lambda s: print(s, flush=True))
    except ValueError as e:
        print(f"gpu: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
