"""Figure 2: sequences that fit a fixed KV budget at 4k and 32k context.

CED-small vs its same-size V4-Flash-style baseline (CSA ratio 4 + HCA ratio 128, v4_fp8 main KV,
every compressed layer its own KV source) vs the decoder-only BF16 baseline.

Per sequence at context C (C a multiple of 128, so no block is partly used):
* CED and the V4-style baseline: ceil(C / block_tokens) blocks of the engine's paged pool
  (bytes_per_block of the live BlockPool, block_tokens 128 for both) + the window rings of every
  layer (a live SequenceState's ring tensors) + the largest compressor pending state (measured
  live: a 127-token prefill leaves r - 1 pending rows on every ratio-r source). The count is then
  checked on the real allocator: an Engine with that budget (less the compressor states, which
  the engine does not reserve) and max_num_seqs = S must hand out S x blocks blocks.
* the decoder-only BF16 baseline: DecoderOnlyState bytes per token (after a real prefill) x C; no windows.
Cross-checks: SequenceState growth over a real 512-token prefill, and cedlm.plan.sequence_bytes
(which also counts DSpark rings that cedlm does not build: subtracted).
"""
from __future__ import annotations

import torch

from cedlm.bench.common import GIB, Ctx, md_table, plt, save_plot, target

NAME = "capacity"
TITLE = "Sequences that fit a fixed KV budget"
BLOCK = 128


def _paged_model(ctx, model, budget: int, contexts, ids_short, ids_odd):
    from cedlm.cache.block_pool import BlockPool, BlockTable
    from cedlm.engine.engine import Engine
    from cedlm.plan import kv_bytes_per_token, sequence_bytes, window_bytes_per_sequence
    cfg = model.cfg
    probe = BlockPool(model.kv_layout, 1, BLOCK, device=model.device)
    bpb = probe.bytes_per_block
    st = model.new_state()
    window = st.nbytes()["window"]
    model.prefill(ids_odd, st, "bounded")
    comp = st.nbytes()["compressor_state"]
    st = model.new_state()
    model.prefill(ids_short, st, "bounded", chunk_size=256)
    nb = st.nbytes()
    grow_bpt = (nb["main_kv"] + nb["index_keys"]) / len(ids_short)
    win_plan = window_bytes_per_sequence(cfg)
    assert window == win_plan["window"], (window, win_plan)
    assert comp == win_plan["compressor_state"], (comp, win_plan)
    assert grow_bpt == kv_bytes_per_token(cfg)["total"]
    out = []
    for C in contexts:
        blocks = -(-C // BLOCK)
        per_seq = blocks * bpb + window + comp
        S = budget // per_seq
        # the real allocator: the engine sizes its pool from the budget and max_num_seqs
        eng = Engine(model, None, ctx.engine_config("capacity", kv_budget_bytes=budget - S * comp,
                                                    max_num_seqs=S, block_tokens=BLOCK,
                                                    enable_prefix_cache=False))
        tables = [BlockTable(eng.pool) for _ in range(S)]
        for t in tables:
            t.ensure(blocks)                      # raises NoFreeBlocks if S did not fit
        fits_one_more = (budget - (S + 1) * (window + comp)) // bpb >= (S + 1) * blocks
        assert not fits_one_more
        allocated = eng.pool.num_used * bpb + S * (window + comp)
        for t in tables:
            t.free()
        del eng, tables
        plan_seq = sequence_bytes(cfg, C) - win_plan["dspark_window"]
        grow_seq = int(grow_bpt * C) + window + comp
        assert per_seq == plan_seq == grow_seq, (per_seq, plan_seq, grow_seq)
        out.append({"context": C, "bytes_per_sequence": per_seq, "sequences": S,
                    "global_kv_bytes": blocks * bpb, "window_bytes": window,
                    "compressor_state_bytes": comp, "allocated_bytes": allocated,
                    "plan_bytes_per_sequence": plan_seq, "kv_bytes_per_token": bpb / BLOCK})
    return out


def run(ctx: Ctx) -> dict:
    from cedlm.plan import sequence_bytes
    from cedlm.config import ModelConfig
    budget = int(ctx.size(1.0, 0.25) * GIB)
    contexts = [4096, 32768]
    g = torch.Generator().manual_seed(ctx.seed)
    ids_short = torch.randint(0, 4096, (512,), generator=g, device="cpu")      # token ids: host
    ids_odd = torch.randint(0, 4096, (127,), generator=g, device="cpu")
    models = {"CED-small": ctx.ced(), "V4-Flash-style baseline": ctx.v4(),
              "CED-small40": ctx.preset_model("small40"),
              "V4-Flash-small40": ctx.preset_model("small40-v4flash")}
    # the 40-layer pair cross-checks allocation against shorter real prefills in quick mode
    short40, odd40 = ids_short[: ctx.size(512, 128)], ids_odd       # 127: a full ratio-128 pending group
    res = {name: _paged_model(ctx, m, budget, contexts, *((short40, odd40) if "40" in name else (ids_short, ids_odd)))
           for name, m in models.items()}
    tw = ctx.decoder_only()
    ts = tw.new_state()
    tw.prefill(ids_short, ts)
    bpt = ts.nbytes() // len(ids_short)
    assert bpt == tw.kv_bytes_per_token
    res["decoder-only BF16 baseline"] = [{"context": C, "bytes_per_sequence": bpt * C, "sequences": budget // (bpt * C),
                         "global_kv_bytes": bpt * C, "window_bytes": 0, "compressor_state_bytes": 0,
                         "allocated_bytes": (budget // (bpt * C)) * bpt * C,
                         "plan_bytes_per_sequence": tw.kv_bytes_per_token * C,
                         "kv_bytes_per_token": bpt} for C in contexts]
    rows = []
    for name, rs in res.items():
        for r in rs:
            rows.append({"model": name, **r})
    ratios = {}
    for i, C in enumerate(contexts):
        c, v, t = (res[k][i]["sequences"]
                   for k in ("CED-small", "V4-Flash-style baseline", "decoder-only BF16 baseline"))
        ratios[str(C)] = {"vs_v4_style": c / v if v else None, "vs_decoder_only": c / t if t else None,
                          "bytes_ratio_vs_v4_style": res["V4-Flash-style baseline"][i]["bytes_per_sequence"]
                          / res["CED-small"][i]["bytes_per_sequence"]}
    # the official configs, planner only (bytes per sequence; no model is built)
    official = []
    for C in contexts + [131072, 1048576]:
        a = sequence_bytes(ModelConfig.preset("deepseek-v4.1-flash"), C)
        b = sequence_bytes(ModelConfig.preset("deepseek-v4-flash"), C)
        official.append({"context": C, "v41_bytes_per_sequence": a, "v4_flash_bytes_per_sequence": b,
                         "ratio": b / a})
    ratios40 = {str(C): {"vs_v4_flash": res["CED-small40"][i]["sequences"] / res["V4-Flash-small40"][i]["sequences"],
                         "bytes_ratio_vs_v4_flash": res["V4-Flash-small40"][i]["bytes_per_sequence"]
                         / res["CED-small40"][i]["bytes_per_sequence"]}
                for i, C in enumerate(contexts)}
    worst = min(r["vs_v4_flash"] for r in ratios40.values())
    return {
        "config": {"budget_bytes": budget, "contexts": contexts, "block_tokens": BLOCK,
                   "device": str(ctx.device)},
        "rows": rows,
        "ratios": ratios,
        "ratios_small40": ratios40,
        "official_planner": official,
        "target": target("sequences CED-small40 / V4-Flash-small40, official schedules at small "
                         "width (worst of 4k, 32k)", ">=", 3.9, worst),
        "notes": [
            "Formula == allocation is asserted for every paged row (planner sequence_bytes less "
            "DSpark rings == pool blocks + live window rings + live max compressor state == "
            "SequenceState growth).",
            "The V4-style baseline's compressor state is cedlm's (non-overlapping groups): up to 127 "
            "fp32 rows of kv and gate per HCA layer; V4's overlapping compressor holds more.",
        ],
    }


def table(res: dict) -> str:
    body = [[r["model"], r["context"], r["kv_bytes_per_token"], r["bytes_per_sequence"],
             r["window_bytes"] + r["compressor_state_bytes"], r["sequences"]] for r in res["rows"]]
    t = md_table(["model", "context", "KV B/token", "B/sequence", "fixed B/sequence (windows + "
                  "compressor)", "sequences"], body)
    body2 = [[C, f"{r['vs_v4_style']:.2f}x", f"{r['bytes_ratio_vs_v4_style']:.2f}x",
              f"{r['vs_decoder_only']:.1f}x"] for C, r in res["ratios"].items()]
    t += "\n\n" + md_table(["context", "CED / V4-style (sequences)", "V4-style / CED (bytes per seq)",
                            "CED / decoder-only BF16 baseline (sequences)"], body2)
    body4 = [[C, f"{r['vs_v4_flash']:.2f}x", f"{r['bytes_ratio_vs_v4_flash']:.2f}x"]
             for C, r in res["ratios_small40"].items()]
    t += "\n\nOfficial 40-layer V4.1 schedule vs V4-Flash's 43-layer schedule, both at small width:\n\n"
    t += md_table(["context", "CED-small40 / V4-Flash-small40 (sequences)", "bytes per seq ratio"], body4)
    body3 = [[r["context"], r["v41_bytes_per_sequence"], r["v4_flash_bytes_per_sequence"],
              f"{r['ratio']:.2f}x"] for r in res["official_planner"]]
    t += "\n\nOfficial configs (planner only, KV + window + DSpark rings + compressor state):\n\n"
    t += md_table(["context", "V4.1-Flash B/sequence", "V4-Flash B/sequence", "V4-Flash / V4.1"], body3)
    return t


def plot(res: dict, path) -> bool:
    pyplot = plt()
    if pyplot is None:
        return False
    models = list(dict.fromkeys(r["model"] for r in res["rows"]))
    ctxs = res["config"]["contexts"]
    fig, ax = pyplot.subplots(figsize=(8, 4.5))
    w = 0.8 / len(models)
    for i, m in enumerate(models):
        vals = [next(r["sequences"] for r in res["rows"] if r["model"] == m and r["context"] == C)
                for C in ctxs]
        xs = [j + i * w for j in range(len(ctxs))]
        ax.bar(xs, vals, w, label=m)
        for x, v in zip(xs, vals):
            ax.text(x, v, f"{v:,}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks([j + w * (len(models) - 1) / 2 for j in range(len(ctxs))],
                  [f"{C // 1024}k context" for C in ctxs])
    ax.set_yscale("log")
    ax.set_ylabel("sequences that fit (log)")
    ax.set_title(f"Sequences in a {res['config']['budget_bytes'] / GIB:g} GiB KV budget (small presets)")
    ax.legend()
    return save_plot(pyplot, fig, path)
