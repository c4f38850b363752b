"""BENCHMARKS.md writer: one generated block per figure between markers, plus a summary table.

Generated blocks sit between `<!-- bench:NAME:start -->` and `<!-- bench:NAME:end -->`; text
outside the markers (the analysis written by people) is kept when a figure is re-run. A missing
file is created with the static introduction and the JSON key reference.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from cedlm.bench.profiling import profile_md

INTRO = """# Benchmarks

`cedlm bench` measures what the V4.1 design choices buy, each figure as a ratio of two
measurements taken in the same run on the same machine (medians of repeated runs,
`time.perf_counter`, after warm-up), and writes `bench/results/<name>.json`, a plot
`bench/results/<name>.png` and its section below. Models are the small presets with random
weights (seeded): the benchmarks time work and count bytes, neither depends on trained values.
Byte counts are asserted equal to the planner's formulas (`cedlm.plan`).

Reproduce everything (about 10 minutes with the default single thread on this 2-core machine):

    cedlm bench                          # full sizes, --threads 1, results in bench/results
    cedlm bench --only decode,resume     # some figures
    cedlm bench --quick                  # small sizes: a smoke test (results in bench/results/quick)

Options: `--device auto|cpu|cuda|cuda:N` (default auto: CUDA when available, else the CPU; the
figures that measure the CPU by nature are skipped on a GPU with their reason), `--threads N`
(torch intra-op threads, default 1), `--out DIR`, `--md PATH`,
`--install-peer` (pip-install transformers for the peer figure when it is absent; without it
the figure is skipped with a message and nothing is installed), `--no-profile`.

The machine is shared: absolute times move with load, the ratios much less. Each JSON records the
environment (`env`), and each timing its spread ((max - min) / median over the repeats).
"""

KEYS = """## JSON keys

Every `bench/results/<name>.json` has these top-level keys (stable; `schema` is bumped if they
change):

| key | meaning |
|---|---|
| `name`, `title`, `schema` | figure id (`kv_bytes`, `capacity`, `prefill`, `decode`, `resume`, `formats`, `peer`, `dspark`), title, schema version (1) |
| `quick` | true for `--quick` sizes |
| `device` | the device the figure ran on (`cpu`, `cuda:0`; `--device`) |
| `env` | `torch`, `python`, `threads`, `cpu` (/proc/cpuinfo model name), `cpu_count`, `platform`, `date` (UTC ISO), `git_commit`, `git_dirty`, `loadavg_at_start`, `device`, `device_description` (GPU name and memory) |
| `config` | the figure's sizes and settings |
| `rows` | the measurements, one object per table row (keys below) |
| `target` | `metric`, `op` (`<=`, `>=`, `==`), `value`, `measured`, `met` (null when not measured), `note` |
| `notes` | strings: assumptions and side results |
| `profile` | present when a target was missed: cProfile summaries (`wall_s`, `cumulative`, `own`) |
| `skipped` | present (a message) when the figure could not run (peer without transformers, a CPU-only figure on a GPU) |
| `skip_reason` | present when a CPU-only figure was skipped on a GPU: why it measures the CPU by nature |
| `elapsed_s`, `plot` | the figure's run time and its PNG file name |

Row keys by figure:

* `kv_bytes`: `model`, `source`, `bytes_per_token`, `formula_bytes_per_token`, `x_v41`, `x_ced_small`; also `formula_equals_allocation`.
* `capacity`: `model`, `context`, `bytes_per_sequence`, `sequences`, `global_kv_bytes`, `window_bytes`, `compressor_state_bytes`, `allocated_bytes`, `plan_bytes_per_sequence`, `kv_bytes_per_token`; also `ratios` (per context: `vs_v4_style`, `vs_decoder_only`, `bytes_ratio_vs_v4_style`) `ratios_small40` (per context: `vs_v4_flash`, `bytes_ratio_vs_v4_flash`: the `small40` preset, official 40-layer V4.1 schedule, against `small40-v4flash`, V4-Flash's 43-layer schedule, both at small width) and `official_planner`.
* `prefill`: `model` (`decoder_only`, `ced_bounded`, `ced_exact`), `prompt_tokens`, `median_s`, `min_s`, `max_s`, `n`, `spread`, `tokens_per_s`, `ratio_vs_decoder_only` (rows for each prompt length); also `runs_s` (per length, per mode) and `targets` (per length).
* `decode`: `context`, `ced_median_s`, `decoder_only_median_s`, `ced_spread`, `decoder_only_spread`, `ced_runs_s`, `decoder_only_runs_s`, `ced_over_decoder_only`, `ced_vs_first`, `decoder_only_vs_first`; also `crosscheck` (really prefilled vs built-directly state at the smallest context).
* `step_ops`: `path` (`eager`, `compiled`), `top_level_ops_per_token`, `all_ops_per_token`, `top_level_names`, `python_calls_per_token`, `step_median_s`, `step_spread`; also `speedup` (eager / compiled step time), `compile_s`, `targets` (`top_level`, `all_ops`).
* `resume`: `rows`: `store`, `context`, `bytes`, `bytes_per_token`, `ced_over_this`; `timing`: `method` (`restore_bounded`, `restore_exact`, `store_read`, `reprefill`), `context`, `replayed_tokens`, `median_s`, `min_s`, `max_s`, `n`, `spread`, `speedup_vs_reprefill`; `targets` (`bytes`, `resume`) `ratios_small40` (per context: `vs_v4_flash`, `bytes_ratio_vs_v4_flash`: the `small40` preset, official 40-layer V4.1 schedule, against `small40-v4flash`, V4-Flash's 43-layer schedule, both at small width) and `official_planner`.
* `formats`: `format`, `dim`, `entries`, `encoded_bytes`, `input_bytes`, `encode_s`, `decode_s`, `memcpy_s`, `memcpy_input_s`, `codec_gbps`, `memcpy_gbps`, `ratio`, `ratio_vs_input_memcpy`, `spread`, `v41`.
* `peer`: `batch`, `context`, `new_tokens`, `ced_s`, `hf_s`, `ced_tokens_per_s`, `hf_tokens_per_s`, `ratio`, `spread`, `llamacpp_f32_tokens_per_s`, `llamacpp_f16_tokens_per_s`, `ratio_vs_llamacpp_f32`, `ratio_vs_llamacpp_f16`, `ced_bandwidth_fraction`, `llamacpp_f32_bandwidth_fraction`, `llamacpp_f16_bandwidth_fraction` (None where llama.cpp did not run: batch > 1, or not installed). Rows per (`context`, `batch`), each with its `target` and `met`; `targets` per context, `vs_llamacpp_f32_<context>` and `bandwidth_fraction`; `ttft` (`prompt_tokens`, `batch`, `ced_s`, `hf_s`, `ced_over_hf`, `spread`, `ced_mode`): first-token latency of one prompt.
* `dspark`: `batch`, `config` (`plain`, `dspark_adaptive`, `dspark_block`, `dspark_scheduled`), `decode_s`, `decode_tokens`, `tokens_per_s`, `speedup`, `speedup_median`, `rounds`, `identical`; speculative rows also `tokens_per_forward`, `acceptance_by_position`, `verified_tokens`, `accepted_tokens`, `drafted_tokens`, `steps`, `draft_seconds`, `verify_seconds`, `draft_ms_per_step`, `policy`, `speculative_steps`, `plain_steps` (engine steps that speculated / decoded plainly); `targets` (`accepted`, `speedup`, `identical`, `adaptive`).
* `attn_packed`: `batch`, `k`, `window`, `heads`, `head_dim`, `packed_s`, `fp32_s`, `decode_then_attend_s`, `same_kernel_fp32_s`, `ratio` (packed / fp32, the target's metric), `decode_then_attend_over_fp32`, `packed_over_fp32_same_kernel`, `max_rel_diff`, `spread`, `runs_s`.
"""

ORDER = ["kv_bytes", "capacity", "prefill", "decode", "step_ops", "resume", "formats", "attn_packed", "peer",
         "dspark"]


def _marker(name: str, end: bool) -> str:
    return f"<!-- bench:{name}:{'end' if end else 'start'} -->"


def _replace_block(text: str, name: str, body: str, heading: str) -> str:
    start, end = _marker(name, False), _marker(name, True)
    block = f"{start}\n{body.rstrip()}\n{end}"
    pat = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if pat.search(text):
        return pat.sub(lambda _: block, text, count=1)
    keys_at = text.find("## JSON keys")
    section = f"{heading}\n\n{block}\n\n"
    if keys_at >= 0:
        return text[:keys_at] + section + text[keys_at:]
    return text.rstrip() + "\n\n" + section


def _met(t: dict | None) -> str:
    if not t or t.get("met") is None:
        return "not measured"
    return "**met**" if t["met"] else "**missed**"


def _measured(t: dict) -> str:
    m = t.get("measured")
    if isinstance(m, bool) or m is None:
        return str(m)
    return f"{m:.3g}"


def section(res: dict, mod, md_path: Path, out: Path) -> str:
    name = res["name"]
    lines = []
    doc = (mod.__doc__ or "").strip().split("\n", 1)
    lines.append(doc[1].strip() if len(doc) > 1 else "")
    quick = " --quick" if res.get("quick") else ""
    lines += ["", f"Reproduce: `cedlm bench --only {name}{quick}` (JSON: `{_rel(out / (name + '.json'), md_path)}`)."]
    env = res.get("env", {})
    lines += ["", f"Run: {env.get('date')}, commit {str(env.get('git_commit'))[:10]}"
                  f"{' (dirty tree)' if env.get('git_dirty') else ''}, torch {env.get('torch')}, "
                  f"{env.get('threads')} thread(s), {env.get('cpu')} ({env.get('cpu_count')} CPUs), "
                  f"load average at start {env.get('loadavg_at_start')}; "
                  f"{'quick' if res.get('quick') else 'full'} sizes; {res.get('elapsed_s', 0):.0f} s"
                  + (f"; device {env.get('device_description') or res.get('device')}"
                     if res.get("device", "cpu") != "cpu" else "") + ".", ""]
    if res.get("error"):
        lines += [f"**The figure failed:** `{res['error']}`", ""]
    elif res.get("skipped"):
        lines += [f"**Skipped:** {res['skipped']}", ""]
    else:
        lines += [mod.table(res), ""]
        if res.get("plot"):
            lines += [f"![{res['title']}]({_rel(out / res['plot'], md_path)})", ""]
    ts = res.get("targets") or {}
    t = res.get("target")
    if ts:
        for k, tt in ts.items():
            lines.append(f"Target ({k}): {tt['metric']} {tt['op']} {tt['value']:.3g}; measured "
                         f"{_measured(tt)}: {_met(tt)}.")
    elif t:
        lines.append(f"Target: {t['metric']} {t['op']} {t['value'] if isinstance(t['value'], bool) else format(t['value'], '.3g')}; "
                     f"measured {_measured(t)}: {_met(t)}." + (f" ({t['note']})" if t.get("note") else ""))
    for n in res.get("notes", []):
        lines.append(f"\n- {n}")
    for label, prof in (res.get("profile") or {}).items():
        lines += ["", profile_md(prof, label)]
    return "\n".join(lines)


def _rel(p: Path, md_path: Path) -> str:
    return os.path.relpath(Path(p).resolve(), Path(md_path).resolve().parent).replace(os.sep, "/")


def summary(out: Path) -> str:
    rows = ["| figure | target | measured | met | sizes |", "|---|---|---|---|---|"]
    for name in ORDER:
        p = out / f"{name}.json"
        if not p.exists():
            rows.append(f"| {name} | | | not run | |")
            continue
        res = json.loads(p.read_text())
        sizes = "quick" if res.get("quick") else "full"
        if res.get("skipped") or res.get("error"):
            rows.append(f"| {name} | {res.get('target', {}).get('metric', '')} | | "
                        f"{'skipped' if res.get('skipped') else 'failed'} | {sizes} |")
            continue
        ts = res.get("targets") or {"": res["target"]}
        for k, t in ts.items():
            label = f"{name} ({k})" if k else name
            val = t["value"] if isinstance(t["value"], bool) else f"{t['value']:.3g}"
            rows.append(f"| {label} | {t['metric']} {t['op']} {val} | {_measured(t)} | {_met(t)} | {sizes} |")
    return "\n".join(rows)


def skeleton(figures: dict) -> str:
    """A new BENCHMARKS.md: introduction, summary, one empty block per figure, JSON keys."""
    text = INTRO + "\n## Summary\n\n" + f"{_marker('summary', False)}\n{_marker('summary', True)}\n\n"
    for i, (name, mod) in enumerate(figures.items(), 1):
        text += f"## {i}. {mod.TITLE}\n\n{_marker(name, False)}\n_Not run yet._\n{_marker(name, True)}\n\n"
    return text + KEYS


def update_md(md_path: Path, out: Path, results: list[tuple[dict, object]], figures: dict) -> None:
    md_path = Path(md_path)
    text = md_path.read_text() if md_path.exists() else skeleton(figures)
    for res, mod in results:
        idx = ORDER.index(res["name"]) + 1 if res["name"] in ORDER else 0
        text = _replace_block(text, res["name"], section(res, mod, md_path, out),
                              f"## {idx}. {res['title']}")
    text = _replace_block(text, "summary", summary(out), "## Summary")
    md_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = md_path.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, md_path)
