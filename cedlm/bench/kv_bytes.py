"""Figure 1: global KV bytes per token, from configs and from the live allocators.

From configs (cedlm.plan): DeepSeek LLM 67B (BF16 K+V), V3 (BF16 MLA latent), V3.2 (V3 with the
656 B FP8 sparse layout), V4-Flash, V4.1-Flash. Measured on the runnable small presets: the
engine's paged pool (bytes_per_block / block_tokens) and a SequenceState after a real prefill
for CED-small and its V4-Flash-style baseline, and DecoderOnlyState.nbytes() / tokens for the decoder-only
decoder-only BF16 baseline. Every measured number must equal the planner's formula (asserted).
"""
from __future__ import annotations

import torch

from cedlm.bench.common import Ctx, md_table, plt, save_plot, target
from cedlm.config import ModelConfig

NAME = "kv_bytes"
TITLE = "KV bytes per token"

OFFICIAL = [  # (label, preset, which number)
    ("DeepSeek LLM 67B", "deepseek-llm-67b", "total"),
    ("DeepSeek V3 (BF16 MLA latent)", "deepseek-v3", "mla_bf16"),
    ("DeepSeek V3.2 (656 B FP8 sparse)", "deepseek-v3", "total"),
    ("DeepSeek V4-Flash", "deepseek-v4-flash", "total"),
    ("DeepSeek V4.1-Flash", "deepseek-v4.1-flash", "total"),
]


def run(ctx: Ctx) -> dict:
    from cedlm.cache.block_pool import BlockPool
    from cedlm.engine.engine import Engine
    from cedlm.plan import kv_bytes_per_token

    rows = []
    v41 = kv_bytes_per_token(ModelConfig.preset("deepseek-v4.1-flash"))["total"]
    for label, preset, which in OFFICIAL:
        kv = kv_bytes_per_token(ModelConfig.preset(preset))
        b = kv["total"] if which == "total" else kv["alternatives"][which]
        rows.append({"model": label, "source": f"plan ({preset})", "bytes_per_token": b,
                     "formula_bytes_per_token": b, "x_v41": b / v41})

    T = ctx.size(512, 256)                       # a multiple of every compress ratio (<= 128)
    ids = torch.randint(0, 4096, (T,), generator=torch.Generator().manual_seed(ctx.seed), device="cpu")
    measured = []
    # CED-small: the engine's pool and a SequenceState after a real prefill
    ced = ctx.ced()
    f_ced = kv_bytes_per_token(ced.cfg)["total"]
    eng = Engine(ced, None, ctx.engine_config("kv_bytes", kv_budget_bytes=64 << 20, max_num_seqs=1))
    pool_bpt = eng.pool.bytes_per_block / eng.block_tokens
    st = ced.new_state()
    ced.prefill(ids, st, "bounded", chunk_size=256)
    nb = st.nbytes()
    state_bpt = (nb["main_kv"] + nb["index_keys"]) / T
    measured += [("CED-small", "engine pool: bytes_per_block / block_tokens", pool_bpt, f_ced),
                 ("CED-small", f"SequenceState after a {T}-token prefill", state_bpt, f_ced)]
    # V4-Flash-style baseline of small: a paged pool and a SequenceState after a real prefill
    v4 = ctx.v4()
    f_v4 = kv_bytes_per_token(v4.cfg)["total"]
    bt = v4.kv_layout.min_block_tokens
    pool = BlockPool(v4.kv_layout, 1, bt, device=v4.device)
    st4 = v4.new_state()
    v4.prefill(ids, st4, "full", chunk_size=256)
    nb4 = st4.nbytes()
    measured += [("V4-Flash-style baseline (small)", f"BlockPool: bytes_per_block / {bt}",
                  pool.bytes_per_block / bt, f_v4),
                 ("V4-Flash-style baseline (small)", f"SequenceState after a {T}-token prefill",
                  (nb4["main_kv"] + nb4["index_keys"]) / T, f_v4)]
    # decoder-only BF16 baseline
    tw = ctx.decoder_only()
    ts = tw.new_state()
    tw.prefill(ids, ts)
    f_tw = 2 * tw.cfg.n_layers * tw.cfg.head_dim * 2
    measured += [("decoder-only BF16 baseline (small)", f"DecoderOnlyState.nbytes() after a {T}-token prefill",
                  ts.nbytes() / T, f_tw)]
    for model, how, got, formula in measured:
        assert got == formula, f"{model}: allocated {got} B/token != formula {formula} B/token ({how})"
        rows.append({"model": model, "source": how, "bytes_per_token": got,
                     "formula_bytes_per_token": formula, "x_v41": None})
    ced_bpt = f_ced
    for r in rows[len(OFFICIAL):]:
        r["x_ced_small"] = r["bytes_per_token"] / ced_bpt
    return {
        "config": {"prefill_tokens": T, "device": str(ced.device), "window_note": "global KV only: per-sequence window rings "
                   "are fixed-size and reported by the capacity figure"},
        "rows": rows,
        "formula_equals_allocation": True,
        "target": target("allocated B/token == planner formula, every measured row", "==", True,
                         True, "asserted: the run fails otherwise"),
        "notes": [
            "Official rows are planner formulas from each config (cedlm.plan.kv_bytes_per_token); "
            "V3 = the BF16 MLA latent (512+64 dims x 2 B x 61 layers), V3.2 = the same model with "
            "the 656 B FP8 sparse layout.",
            "V4-Flash index keys are assumed FP4 (68 B per 128 dims; the format is unverified).",
            "The V4-Flash-style small baseline stores v4_fp8 entries (FP8 NoPE + BF16 RoPE, 194 B at "
            "head_dim 128 with 64 RoPE dims) on all 10 compressed layers and FP4 index keys on the "
            "5 ratio-4 layers.",
        ],
    }


def table(res: dict) -> str:
    body = [[r["model"], r["source"], r["bytes_per_token"], r["formula_bytes_per_token"],
             "" if r.get("x_v41") is None else f"{r['x_v41']:.2f}x",
             "" if r.get("x_ced_small") is None else f"{r['x_ced_small']:.2f}x"]
            for r in res["rows"]]
    return md_table(["model", "source", "B/token", "formula B/token", "x V4.1", "x CED-small"], body)


def plot(res: dict, path) -> bool:
    pyplot = plt()
    if pyplot is None:
        return False
    rows = res["rows"]
    labels = [r["model"] + ("" if r.get("x_v41") is not None else "\n" + r["source"].split(" after")[0].split(":")[0])
              for r in rows]
    vals = [r["bytes_per_token"] for r in rows]
    colors = ["#888888" if r.get("x_v41") is not None else "#1f77b4" for r in rows]
    fig, ax = pyplot.subplots(figsize=(9, 5))
    y = range(len(rows))
    ax.barh(list(y), vals, color=colors)
    ax.set_xscale("log")
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.invert_yaxis()
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:,.0f}" if v >= 1000 else f" {v:g}", va="center", fontsize=7)
    ax.set_xlabel("global KV bytes per token (log)")
    ax.set_title("KV bytes per token: official configs (grey, planner) and small presets (blue, allocated)")
    return save_plot(pyplot, fig, path)
