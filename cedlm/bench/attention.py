"""Figure: attention over the packed KV bytes vs attention over the same keys already in fp32.

One decode step's sparse attention of one layer (one query row per sequence; the shipped model's
shapes, cedlm/assets/model/config.json: H = 4 heads, hd = 128, a 64-row window, k = index_topk = 64
selected entries, and larger k), over keys stored as the cache stores them: the window as
window_fp8 rows of the sequences' rings, the selected entries as kv_fp4 rows of a store of
`4 k` rows, picked by index. Three ways, timed in ONE run, their repeats interleaved round-robin
(medians reported), each producing the same output to float32 rounding:

* `packed_s`: `attend_packed` (cedlm/kernels/csrc/attend_packed.h) reading the FP8 window rows and
  the selected FP4 rows by index, decoded tile by tile inside the attention loop: today's fast path;
* `fp32_s`: `attend_sparse` (csrc/attend.h) over the same keys already held in fp32 (window
  [B, 64, hd], selected [B, 1, k, hd]): what attention costs when the compression is free;
* `decode_then_attend_s`: decode the window and gather + decode the selected rows to fp32, then
  `attend_sparse`: the path before the packed kernel.

Also `packed_over_fp32_same_kernel`: `attend_packed` reading fp32 rows by index (the same loop
without the decode), the cost of the decode alone. The target is `ratio` = packed_s / fp32_s
<= 1.2 (the compression costs no time) at every row. One thread unless --threads says otherwise.
"""
from __future__ import annotations

import torch

from cedlm.bench.common import Ctx, md_table, measure_interleaved, plt, save_plot, stats, target

NAME = "attn_packed"
TITLE = "Attention over packed KV bytes vs over fp32"
HEADS, HEAD_DIM, WINDOW = 4, 128, 64
TARGET = 1.2
CPU_ONLY = ("it times the C++ attention kernels (attend_packed, attend_sparse in "
            "cedlm/kernels/csrc), which run on the CPU only")


def _case(B: int, k: int, g: torch.Generator) -> dict:
    """The inputs of one row: packed stores and indices, and the same keys decoded to fp32."""
    from cedlm.kernels import decode, encode
    from cedlm.kernels.attention import PackedKeys
    R = 4 * k
    crows = encode(torch.randn(R, HEAD_DIM, generator=g), "kv_fp4")
    wrows = encode(torch.randn(B * WINDOW, HEAD_DIM, generator=g), "window_fp8")
    win = PackedKeys(wrows, torch.arange(B * WINDOW).view(B, WINDOW), "window_fp8", HEAD_DIM)
    comp = PackedKeys(crows, torch.randint(0, R, (B, 1, k), generator=g), "kv_fp4", HEAD_DIM)
    cf = decode(crows, "kv_fp4", HEAD_DIM)
    return {"q": torch.randn(B, 1, HEADS, HEAD_DIM, generator=g), "win": win, "comp": comp,
            "win_f32": win.decoded().contiguous(), "comp_f32": comp.decoded().contiguous(),
            "comp_f32_rows": cf,
            "win_valid": torch.ones(B, 1, WINDOW, dtype=torch.bool),
            "comp_valid": torch.ones(B, 1, k, dtype=torch.bool),
            "sink": torch.randn(HEADS, generator=g)}


def run(ctx: Ctx) -> dict:
    from cedlm.kernels import decode, gate
    from cedlm.kernels import attention as ka
    prev = gate.set_reference_kernels(False)
    try:
        if gate.ext_op("attend_packed") is None:
            return {"skipped": f"compiled kernels unavailable: {gate.compiled_status()}",
                    "config": {}, "rows": [], "target": target("packed / fp32", "<=", TARGET, None)}
        return _measure(ctx, ka, decode, gate)
    finally:
        gate.set_reference_kernels(prev)


def _measure(ctx: Ctx, ka, decode, gate) -> dict:
    shapes = [(1, 64), (8, 64), (1, 512), (8, 512), (1, 2048)]
    if ctx.quick:
        shapes = [(1, 64), (8, 64), (1, 512)]
    reps, warm = ctx.size(301, 31), 5
    scale = HEAD_DIM ** -0.5
    op = gate.ext_op("attend_packed")
    g = torch.Generator().manual_seed(ctx.seed)
    rows = []
    for B, k in shapes:
        c = _case(B, k, g)
        q, wv, cv, sink = c["q"], c["win_valid"], c["comp_valid"], c["sink"]
        win, comp = c["win"], c["comp"]
        wf32 = c["win_f32"].view(B * WINDOW, HEAD_DIM)
        fns = {
            "packed": lambda: ka.attend_packed(q, win, wv, comp, cv, sink, scale),
            "fp32": lambda: ka.attend_sparse(q, c["win_f32"], wv, c["comp_f32"], cv, sink, scale),
            "decode_then_attend": lambda: ka.attend_sparse(
                q, decode(win.rows, "window_fp8", HEAD_DIM).view(B, WINDOW, HEAD_DIM), wv,
                decode(comp.rows[comp.index], "kv_fp4", HEAD_DIM), cv, sink, scale),
            "same_kernel_fp32": lambda: op(q, wf32, win.index, wv, -1, 0, c["comp_f32_rows"],
                                           comp.index, cv, -1, 0, sink, scale),
        }
        outs = {n: f() for n, f in fns.items()}
        ref = outs["fp32"]
        err = max(float((o - ref).abs().max()) for o in outs.values()) / float(ref.abs().max())
        t = {n: stats(ts) for n, ts in measure_interleaved(fns, reps, warm).items()}
        m = {n: v["median_s"] for n, v in t.items()}
        rows.append({
            "batch": B, "k": k, "window": WINDOW, "heads": HEADS, "head_dim": HEAD_DIM,
            "packed_s": m["packed"], "fp32_s": m["fp32"],
            "decode_then_attend_s": m["decode_then_attend"],
            "same_kernel_fp32_s": m["same_kernel_fp32"],
            "ratio": m["packed"] / m["fp32"],
            "decode_then_attend_over_fp32": m["decode_then_attend"] / m["fp32"],
            "packed_over_fp32_same_kernel": m["packed"] / m["same_kernel_fp32"],
            "max_rel_diff": err,
            "spread": max(v["spread"] for v in t.values()),
            "runs_s": {n: v["runs_s"] for n, v in t.items()},
        })
        ctx.log(f"  B={B} k={k}: packed {m['packed'] * 1e6:.1f} us, fp32 {m['fp32'] * 1e6:.1f} us, "
                f"decode+attend {m['decode_then_attend'] * 1e6:.1f} us, same kernel fp32 "
                f"{m['same_kernel_fp32'] * 1e6:.1f} us: ratio {m['packed'] / m['fp32']:.3f}")
    worst = max(rows, key=lambda r: r["ratio"])
    return {
        "config": {"heads": HEADS, "head_dim": HEAD_DIM, "window": WINDOW, "queries_per_sequence": 1,
                   "selected_store_rows": "4 k", "repeats": reps, "warmup": warm,
                   "threads": torch.get_num_threads(),
                   "clock": "wall (time.perf_counter), repeats interleaved round-robin"},
        "rows": rows,
        "target": target("attention time over packed bytes / over the same keys in fp32 (worst row)",
                         "<=", TARGET, worst["ratio"],
                         note=f"worst: batch {worst['batch']}, k {worst['k']}"),
        "notes": [
            f"Worst row: batch {worst['batch']}, k = {worst['k']}: packed / fp32 "
            f"{worst['ratio']:.3f}; decode-then-attend / fp32 there "
            f"{worst['decode_then_attend_over_fp32']:.3f}.",
            "Outputs of the three ways agree to float32 rounding on the bench data: max "
            f"|difference| / max |output| {max(r['max_rel_diff'] for r in rows):.1e} "
            "(tests/test_attend_packed.py states the tolerance).",
        ],
    }


def table(res: dict) -> str:
    body = [[r["batch"], r["k"], r["packed_s"] * 1e6, r["fp32_s"] * 1e6,
             r["decode_then_attend_s"] * 1e6, r["same_kernel_fp32_s"] * 1e6,
             f"**{r['ratio']:.3f}**", f"{r['decode_then_attend_over_fp32']:.3f}",
             f"{r['packed_over_fp32_same_kernel']:.3f}", f"{r['spread']:.2f}"] for r in res["rows"]]
    return md_table(["batch", "k selected", "packed us", "fp32 us", "decode + attend us",
                     "same kernel on fp32 us", "packed / fp32", "decode + attend / fp32",
                     "packed / same kernel fp32", "spread"], body)


def plot(res: dict, path) -> bool:
    pyplot = plt()
    if pyplot is None:
        return False
    fig, ax = pyplot.subplots(figsize=(8, 4))
    rows = res["rows"]
    labels = [f"B={r['batch']}\nk={r['k']}" for r in rows]
    xs = range(len(rows))
    w = 0.27
    for off, key, color, label in ((-w, "fp32_s", "#888888", "attend_sparse over fp32 keys"),
                                   (0, "packed_s", "#4477aa", "attend_packed over packed bytes"),
                                   (w, "decode_then_attend_s", "#cc8844", "decode, then attend")):
        ax.bar([x + off for x in xs], [r[key] * 1e6 for r in rows], w, color=color, label=label)
    for x, r in zip(xs, rows):
        ax.text(x, r["packed_s"] * 1e6, f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), labels)
    ax.set_yscale("log")
    ax.set_ylabel("microseconds per call (log)")
    ax.set_title(f"Sparse attention, one decode step (target: packed <= {TARGET}x fp32)")
    ax.legend(fontsize=8)
    return save_plot(pyplot, fig, path)
