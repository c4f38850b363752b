"""Figure 3: prefill time of one long prompt, CED `bounded` and `exact` vs the decoder-only twin.

Same width, depth, query path and MoE (the twin of cedlm.model.decoder_only), random weights (timing
does not depend on values). CED prefills in chunks of 512 tokens (the engine's default
`prefill_chunk`: its window attention is computed per chunk); the twin runs its prompt in one
call through fused scaled-dot-product attention (its fastest path). Each mode starts from a fresh
state; medians of repeated runs after one warm-up on a short prompt.
"""
from __future__ import annotations

import torch

from cedlm.bench.common import Ctx, md_table, measure, plt, stats, target
from cedlm.bench.profiling import profile_call

NAME = "prefill"
TITLE = "Prefill time of a long prompt"
CHUNK = 512


def run(ctx: Ctx) -> dict:
    S = ctx.size(8192, 2048)
    reps = ctx.size(5, 1)
    ced, twin = ctx.ced(), ctx.twin()
    ids = torch.randint(0, ced.cfg.vocab_size, (S,), generator=torch.Generator().manual_seed(ctx.seed))
    warm = ids[:256]
    ced.prefill(warm, ced.new_state(), "bounded", chunk_size=CHUNK)
    twin.prefill(warm, twin.new_state())
    calls = {
        "twin": lambda st: twin.prefill(ids, st),
        "ced_bounded": lambda st: ced.prefill(ids, st, "bounded", chunk_size=CHUNK),
        "ced_exact": lambda st: ced.prefill(ids, st, "exact", chunk_size=CHUNK),
    }
    setups = {"twin": twin.new_state, "ced_bounded": ced.new_state, "ced_exact": ced.new_state}
    res = {}
    for name in calls:                                           # interleave modes per repeat
        res[name] = []
    for _ in range(reps):
        for name, fn in calls.items():
            res[name] += measure(fn, 1, 0, setups[name])
            ctx.log(f"  prefill {name}: {res[name][-1]:.2f} s")
    st = {k: stats(v) for k, v in res.items()}
    tw = st["twin"]["median_s"]
    rows = [{"model": k, "prompt_tokens": S, **{x: v[x] for x in ("median_s", "min_s", "max_s", "n",
                                                                 "spread")},
             "tokens_per_s": S / v["median_s"], "ratio_vs_twin": v["median_s"] / tw}
            for k, v in st.items()]
    ratio = st["ced_bounded"]["median_s"] / tw
    out = {
        "config": {"prompt_tokens": S, "repeats": reps, "ced_chunk": CHUNK,
                   "decoder_rows_bounded": ced.decoder_rows(S, "bounded"),
                   "decoder_rows_exact": ced.decoder_rows(S, "exact"),
                   "weights": "random (seeded); timing does not depend on values"},
        "rows": rows,
        "runs_s": res,
        "target": target("CED bounded prefill time / twin prefill time", "<=", 0.55, ratio),
        "notes": [f"ced_exact / twin = {st['ced_exact']['median_s'] / tw:.3f}"],
    }
    if ctx.profile and not out["target"]["met"]:
        out["profile"] = {
            "ced_bounded": profile_call(lambda: ced.prefill(ids, ced.new_state(), "bounded",
                                                            chunk_size=CHUNK)),
            "twin": profile_call(lambda: twin.prefill(ids, twin.new_state())),
        }
    return out


def table(res: dict) -> str:
    body = [[r["model"], r["prompt_tokens"], r["median_s"], r["spread"], r["tokens_per_s"],
             f"{r['ratio_vs_twin']:.3f}"] for r in res["rows"]]
    return md_table(["model", "prompt tokens", "median s", "spread", "tokens/s", "time / twin"], body)


def plot(res: dict, path) -> bool:
    pyplot = plt()
    if pyplot is None:
        return False
    fig, ax = pyplot.subplots(figsize=(6, 4))
    names = [r["model"] for r in res["rows"]]
    vals = [r["median_s"] for r in res["rows"]]
    ax.bar(names, vals, color=["#888888", "#1f77b4", "#ff7f0e"][: len(names)])
    for i, (v, r) in enumerate(zip(vals, res["rows"])):
        ax.text(i, v, f"{v:.2f} s\n({r['ratio_vs_twin']:.2f}x)", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"Prefill of a {res['config']['prompt_tokens']:,}-token prompt")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)
    return True
