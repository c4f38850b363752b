"""Figure 3: prefill time of one long prompt, CED `bounded` and `exact` vs the decoder-only baseline.

Same width, depth, query path and MoE (the baseline of cedlm.model.decoder_only), random weights (timing
does not depend on values). CED prefills in chunks of 512 tokens (the engine's default
`prefill_chunk`: its window attention is computed per chunk); the decoder-only baseline runs its prompt in one
call through fused scaled-dot-product attention (its fastest path). Each mode starts from a fresh
state; medians of repeated runs after one warm-up on a short prompt. Prompts of 8k and 32k tokens
(5 and 2 repeats; `--quick`: 2k), each with its own target in `targets`. Both models run on the
run's device (`--device`; a GPU is synchronised around each timed prefill).
"""
from __future__ import annotations

import torch

from cedlm.bench.common import Ctx, md_table, measure, plt, save_plot, stats, target
from cedlm.bench.profiling import profile_call

NAME = "prefill"
TITLE = "Prefill time of a long prompt"
CHUNK = 512
LENGTHS = [8192, 32768]                 # target: <= 0.55 at 8k and at 32k


def _prompt(ctx: Ctx, vocab: int, S: int) -> torch.Tensor:
    return torch.randint(0, vocab, (S,), generator=torch.Generator().manual_seed(ctx.seed),
                         device="cpu")                          # token ids: host; prefill moves them


def _repeats(ctx: Ctx, S: int) -> int:
    return ctx.size(5 if S <= 8192 else 2, 1)                   # a 32k decoder-only prefill takes minutes


def _one_length(ctx: Ctx, ced, decoder_only, S: int) -> tuple[list, dict, dict]:
    ids = _prompt(ctx, ced.cfg.vocab_size, S)
    calls = {
        "decoder_only": lambda st: decoder_only.prefill(ids, st),
        "ced_bounded": lambda st: ced.prefill(ids, st, "bounded", chunk_size=CHUNK),
        "ced_exact": lambda st: ced.prefill(ids, st, "exact", chunk_size=CHUNK),
    }
    setups = {"decoder_only": decoder_only.new_state, "ced_bounded": ced.new_state, "ced_exact": ced.new_state}
    res = {name: [] for name in calls}
    for _ in range(_repeats(ctx, S)):                            # interleave modes per repeat
        for name, fn in calls.items():
            res[name] += measure(fn, 1, 0, setups[name], device=ctx.device)
            ctx.log(f"  prefill {S} {name}: {res[name][-1]:.2f} s")
    st = {k: stats(v) for k, v in res.items()}
    tw = st["decoder_only"]["median_s"]
    rows = [{"model": k, "prompt_tokens": S, **{x: v[x] for x in ("median_s", "min_s", "max_s", "n",
                                                                 "spread")},
             "tokens_per_s": S / v["median_s"], "ratio_vs_decoder_only": v["median_s"] / tw}
            for k, v in st.items()]
    return rows, res, st


def run(ctx: Ctx) -> dict:
    lengths = ctx.size(LENGTHS, [2048])
    ced, decoder_only = ctx.ced(), ctx.decoder_only()
    warm = _prompt(ctx, ced.cfg.vocab_size, 256)
    ced.prefill(warm, ced.new_state(), "bounded", chunk_size=CHUNK)
    decoder_only.prefill(warm, decoder_only.new_state())
    rows, runs, targets, notes = [], {}, {}, []
    for S in lengths:
        r, res, st = _one_length(ctx, ced, decoder_only, S)
        rows += r
        runs[str(S)] = res
        tw = st["decoder_only"]["median_s"]
        targets[str(S)] = target(f"CED bounded prefill time / decoder-only prefill time at {S:,} tokens",
                                 "<=", 0.55, st["ced_bounded"]["median_s"] / tw)
        notes.append(f"{S:,} tokens: ced_exact / decoder_only = {st['ced_exact']['median_s'] / tw:.3f}")
    worst = max(targets.values(), key=lambda t: t["measured"])
    S0 = lengths[0]
    out = {
        "config": {"prompt_tokens": S0, "lengths": lengths, "repeats": {str(S): _repeats(ctx, S) for S in lengths},
                   "ced_chunk": CHUNK, "device": str(ctx.device),
                   "decoder_rows_bounded": {str(S): ced.decoder_rows(S, "bounded") for S in lengths},
                   "decoder_rows_exact": {str(S): ced.decoder_rows(S, "exact") for S in lengths},
                   "weights": "random (seeded); timing does not depend on values"},
        "rows": rows,
        "runs_s": runs,
        "targets": targets,
        "target": target("CED bounded prefill time / decoder-only prefill time (worst length)", "<=", 0.55,
                         worst["measured"], note=worst["metric"]),
        "notes": notes,
    }
    if ctx.profile and not out["target"]["met"]:
        ids = _prompt(ctx, ced.cfg.vocab_size, S0)
        out["profile"] = {
            "ced_bounded": profile_call(lambda: ced.prefill(ids, ced.new_state(), "bounded",
                                                            chunk_size=CHUNK)),
            "decoder_only": profile_call(lambda: decoder_only.prefill(ids, decoder_only.new_state())),
        }
    return out


def table(res: dict) -> str:
    body = [[r["model"], r["prompt_tokens"], r["median_s"], r["spread"], r["tokens_per_s"],
             f"{r['ratio_vs_decoder_only']:.3f}"] for r in res["rows"]]
    return md_table(["model", "prompt tokens", "median s", "spread", "tokens/s", "time / decoder-only"], body)


def plot(res: dict, path) -> bool:
    pyplot = plt()
    if pyplot is None:
        return False
    lengths = sorted({r["prompt_tokens"] for r in res["rows"]})
    fig, axes = pyplot.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    for ax, S in zip(axes[0], lengths):
        rs = [r for r in res["rows"] if r["prompt_tokens"] == S]
        vals = [r["median_s"] for r in rs]
        ax.bar([r["model"] for r in rs], vals, color=["#888888", "#1f77b4", "#ff7f0e"][: len(rs)])
        for i, (v, r) in enumerate(zip(vals, rs)):
            ax.text(i, v, f"{v:.1f} s\n({r['ratio_vs_decoder_only']:.2f}x)", ha="center", va="bottom",
                    fontsize=8)
        ax.set_ylabel("seconds (median)")
        ax.set_title(f"Prefill of a {S:,}-token prompt")
    return save_plot(pyplot, fig, path)
