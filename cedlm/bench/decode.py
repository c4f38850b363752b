"""Figure 4: per-token decode step time vs context length, CED-small vs the decoder-only baseline.

The caches are built directly at each context instead of by prefilling (cedlm.bench.common
synth_*): every source's global KV and index-key rows (valid encodings of random N(0,1) values),
full window rings, random token ids; the decoder-only baseline's BF16 K and V filled with N(0,1). A step's cost
depends on the sizes, not the values; the figure checks that at one small context a really
prefilled state gives the same step time (ratio reported). Batch 1, random weights; each point is
the median of repeated single-token `decode` calls after warm-up steps, the steps of all
contexts and both models taken round-robin (one of each per round), so that a change of load on
the shared machine hits every point alike. Models and caches live on the run's device
(`--device`; a GPU is synchronised around each timed step).
"""
from __future__ import annotations

import functools

import torch

from cedlm.bench.common import (Ctx, ced_decode_fn, md_table, measure, measure_interleaved, plt,
                               save_plot, stats, synth_ced_state, synth_decoder_only_state, target)
from cedlm.bench.profiling import profile_call

NAME = "decode"
TITLE = "Decode step time vs context"


def _steps(step, st, steps: int, warmup: int, device) -> dict:
    tok = [7]
    return stats(measure(lambda: step(tok, [st]), steps, warmup, device=device))


def run(ctx: Ctx) -> dict:
    contexts = ctx.size([1024, 2048, 4096, 8192, 16384, 32768], [512, 1024, 2048])
    steps, warm = ctx.size(21, 3), ctx.size(3, 1)
    ced, decoder_only = ctx.ced(), ctx.decoder_only()
    # every (model, context) state built first, then the steps taken round-robin over them
    states = {(name, C): synth(model, C, seed=ctx.seed + C)
              for C in contexts
              for name, model, synth in (("ced", ced, synth_ced_state),
                                         ("decoder_only", decoder_only, synth_decoder_only_state))}
    # CED decodes through the engine's decode step (compiled by default; --decode-step says)
    ced_step = ced_decode_fn(ced, ctx.engine_options.get("decode_step"))
    steps_of = {"ced": ced_step, "decoder_only": decoder_only.decode}
    fns = {key: functools.partial(steps_of[key[0]], [7], [st]) for key, st in states.items()}
    times = measure_interleaved(fns, steps, warm, device=ctx.device)
    del states, fns
    rows = []
    for C in contexts:
        row = {"context": C}
        for name in ("ced", "decoder_only"):
            s = stats(times[(name, C)])
            row[f"{name}_median_s"], row[f"{name}_spread"] = s["median_s"], s["spread"]
            row[f"{name}_runs_s"] = s["runs_s"]
        row["ced_over_decoder_only"] = row["ced_median_s"] / row["decoder_only_median_s"]
        rows.append(row)
        ctx.log(f"  decode @ {C}: ced {row['ced_median_s'] * 1e3:.1f} ms, "
                f"decoder-only {row['decoder_only_median_s'] * 1e3:.1f} ms")
    base = rows[0]
    for r in rows:
        r["ced_vs_first"] = r["ced_median_s"] / base["ced_median_s"]
        r["decoder_only_vs_first"] = r["decoder_only_median_s"] / base["decoder_only_median_s"]
    # cross-check: a really prefilled state at a small context steps at the same speed
    Cx = contexts[0]
    ids = torch.randint(0, ced.cfg.vocab_size, (Cx,), generator=torch.Generator().manual_seed(ctx.seed),
                        device="cpu")                              # token ids: host
    dev = ctx.device
    st = ced.new_state()
    ced.prefill(ids, st, "bounded", chunk_size=512)
    real_ced = _steps(ced_step, st, steps, warm, dev)
    ts = decoder_only.new_state()
    decoder_only.prefill(ids, ts)
    real_decoder_only = _steps(decoder_only.decode, ts, steps, warm, dev)
    synth_c = _steps(ced_step, synth_ced_state(ced, Cx, seed=1), steps, warm, dev)
    synth_t = _steps(decoder_only.decode, synth_decoder_only_state(decoder_only, Cx, seed=1), steps, warm, dev)
    check = {"context": Cx,
             "ced_real_median_s": real_ced["median_s"], "ced_synth_median_s": synth_c["median_s"],
             "ced_real_over_synth": real_ced["median_s"] / synth_c["median_s"],
             "ced_spread": max(real_ced["spread"], synth_c["spread"]),
             "decoder_only_real_median_s": real_decoder_only["median_s"],
             "decoder_only_synth_median_s": synth_t["median_s"],
             "decoder_only_real_over_synth": real_decoder_only["median_s"] / synth_t["median_s"],
             "decoder_only_spread": max(real_decoder_only["spread"], synth_t["spread"])}
    last = rows[-1]
    out = {
        "config": {"contexts": contexts, "steps": steps, "warmup": warm, "batch": 1,
                   "device": str(ctx.device),
                   "ced_decode_step": ced_step.mode,
                   "caches": "built directly (random values, real sizes); see crosscheck",
                   "weights": "random (seeded)"},
        "rows": rows,
        "crosscheck": check,
        "target": target(f"CED step at {last['context'] // 1024}k / CED step at "
                         f"{base['context'] // 1024 if base['context'] >= 1024 else base['context']}"
                         f"{'k' if base['context'] >= 1024 else ''}", "<=", 1.25, last["ced_vs_first"]),
        "notes": [f"decoder-only step at the largest / smallest context: {last['decoder_only_vs_first']:.2f}x; "
                  f"CED / decoder-only at the largest context: {last['ced_over_decoder_only']:.2f}x"],
    }
    if ctx.profile and not out["target"]["met"]:
        n = ctx.size(5, 2)
        out["profile"] = {}
        for C in (contexts[0], contexts[-1]):
            st = synth_ced_state(ced, C, seed=2)
            ced_step([7], [st])
            out["profile"][f"ced_{C}"] = profile_call(
                lambda: [ced_step([7], [st]) for _ in range(n)])
            out["profile"][f"ced_{C}"]["steps"] = n
            del st
    return out


def table(res: dict) -> str:
    body = [[r["context"], r["ced_median_s"] * 1e3, f"{r['ced_vs_first']:.2f}x", r["decoder_only_median_s"] * 1e3,
             f"{r['decoder_only_vs_first']:.2f}x", f"{r['ced_over_decoder_only']:.2f}"] for r in res["rows"]]
    t = md_table(["context", "CED ms/token", "CED vs first", "decoder-only ms/token", "decoder-only vs first",
                  "CED / decoder-only"], body)
    c = res["crosscheck"]
    t += (f"\n\nCross-check at {c['context']:,} tokens (really prefilled / built directly): "
          f"CED {c['ced_real_median_s'] * 1e3:.1f} / {c['ced_synth_median_s'] * 1e3:.1f} ms "
          f"({c['ced_real_over_synth']:.2f}x, spread {c['ced_spread']:.2f}); decoder-only "
          f"{c['decoder_only_real_median_s'] * 1e3:.1f} / {c['decoder_only_synth_median_s'] * 1e3:.1f} ms "
          f"({c['decoder_only_real_over_synth']:.2f}x, spread {c['decoder_only_spread']:.2f})")
    return t


def plot(res: dict, path) -> bool:
    pyplot = plt()
    if pyplot is None:
        return False
    xs = [r["context"] for r in res["rows"]]
    fig, ax = pyplot.subplots(figsize=(7, 4.5))
    ax.plot(xs, [r["ced_median_s"] * 1e3 for r in res["rows"]], "o-", label="CED-small")
    ax.plot(xs, [r["decoder_only_median_s"] * 1e3 for r in res["rows"]], "s-", color="#888888",
            label="decoder-only BF16 baseline")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x // 1024}k" if x >= 1024 else str(x) for x in xs])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms per decode step (median, batch 1)")
    ax.set_ylim(bottom=0)
    ax.set_title("Decode step time vs context")
    ax.legend()
    return save_plot(pyplot, fig, path)
