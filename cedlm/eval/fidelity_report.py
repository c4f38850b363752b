"""FIDELITY.md and its plots from the rows of `cedlm eval ablate` (see ablate.py)."""
from __future__ import annotations

import os
from pathlib import Path

from cedlm.data.retrieval import KINDS

GOAL_KL, GOAL_PPL = 0.01, 1.0          # nats; percent


def _window_bytes(cfg, r: dict) -> str:
    """Window rings of one sequence (fixed, not per token) under the row's config."""
    from cedlm.kv_layout import KVLayout
    return f"{KVLayout.from_config(cfg.replace(**r['overrides'])).window_bytes_per_sequence:,}"


def _kl(v: float) -> str:
    """0 when exactly 0; else two significant digits (float rounding can leave |KL| ~ 1e-9 < 0)."""
    return "0" if v == 0 else f"{v:.1e}"


def _fmt_retrieval(r: dict, lengths: list[int]) -> list[str]:
    return [f"{r['retrieval'][str(L)]:.2f}" if str(L) in r["retrieval"] else "–" for L in lengths]


def _config(r: dict) -> str:
    o = dict(r["overrides"])
    parts = []
    for key, short in (("main_kv_format", "kv"), ("index_kv_format", "idx"), ("window_kv_format", "win"),
                       ("index_topk", "topk"), ("candidate_topk_blocks", "pool"), ("sliding_window", "window")):
        if key in o:
            v = o[key]
            parts.append(f"{short}={'all' if isinstance(v, int) and v >= 1 << 20 else v}")
    if r["prefill"] != "full":
        parts.append(f"prefill={r['prefill']}")
    if r["restore"]:
        parts.append(f"restore={r['restore']}")
    if r["indexer"] == "swapped":
        parts.append("indexer=init")
    return ", ".join(parts) or "model's own config"


def _kinds_text(meta: dict) -> str:
    names = {"passkey": "passkey", "kv": "key-value"}
    return " / ".join(names[k] for k in meta.get("retrieval_kinds", KINDS))


def write_report(out: Path, meta: dict, rows: list[dict], cfg, not_measured, report: Path | None = None,
                 notes: str = "") -> Path:
    """Plots into `out`; the markdown to `report` (default OUT/FIDELITY.md), linking them."""
    path = Path(report) if report else out / "FIDELITY.md"
    rel = Path(os.path.relpath(out, path.parent))
    lengths = sorted({int(L) for r in rows for L in r["retrieval"]} | set(meta["retrieval_lengths"]))
    head = ["group", "row", "configuration", "KL (nats)", "Δppl %", "top-1", *[f"retr@{L}" for L in lengths],
            "B/token", "window B/seq", "within goal"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ok = r["kl"] <= GOAL_KL and abs(r["d_ppl_pct"]) <= GOAL_PPL
        lines.append("| " + " | ".join([r.get("group", ""), r["name"], _config(r), _kl(r["kl"]),
                                        f"{r['d_ppl_pct']:+.2f}", f"{r['top1']:.3f}",
                                        *_fmt_retrieval(r, lengths), f"{r['bytes_per_token']:.0f}",
                                        _window_bytes(cfg, r),
                                        "yes" if ok else "**no**"]) + " |")
    for name, why, *layout in not_measured:          # an optional config transform: its KV bytes
        cells = [""] * (len(head) - 3)
        if layout:
            from cedlm.kv_layout import KVLayout
            kv = KVLayout.from_config(layout[0](cfg))
            cells[-3:-1] = [f"{float(kv.bytes_per_token):.0f}", f"{kv.window_bytes_per_sequence:,}"]
        lines.append(f"| – | {name} | not measured: {why} | " + " | ".join(cells) + " |")
    detail = ["| row | " + " | ".join(f"answer NLL@{L} | token acc@{L}" for L in lengths) + " |",
              "|---|" + "---|---|" * len(lengths)]
    for r in rows:
        cells = []
        for L in lengths:
            k = str(L)
            cells += ([f"{r['answer_nll'][k]:.3f}", f"{r['answer_token_acc'][k]:.3f}"]
                      if k in r.get("answer_nll", {}) else ["–", "–"])
        detail.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    ref = next((r for r in rows if r["name"] == "reference"), rows[0])
    n_text = ", ".join(f"{v} × {L} tokens" for L, v in ref["text_samples"].items())
    n_retr = ", ".join(f"{v} at {L}" for L, v in meta["retrieval_samples"].items())
    text = f"""# Fidelity: what each compression costs, one switch at a time

Model: `{meta['model']}` ({cfg.num_hidden_layers} layers, window {cfg.sliding_window},
index_topk {cfg.index_topk}, candidate pool {cfg.candidate_topk_blocks} blocks of
{cfg.candidate_block_size}, main KV {cfg.main_kv_format}, index keys {cfg.index_kv_format},
window {cfg.window_kv_format}).

Reference: the same weights with main KV, window and index keys in BF16, full prefill and dense
attention over every visible compressed entry. Each row changes the listed fields of the
reference (or, for the "shipped" rows, runs the model's own config) and is compared with it on the
same tokens. All runs use the inference path (byte caches).

- **KL**: mean KL(p_ref ‖ p_row) of the next-token distributions over the last {meta['tail']} tokens
  (at most a quarter of the sequence) of {n_text} from the validation split; **Δppl**:
  perplexity of the same tokens against the reference's ({ref['ref_ppl']:.2f});
  **top-1**: share of those tokens whose argmax equals the reference's.
- **retr@L**: share of {_kinds_text(meta)} items answered exactly (teacher-forced argmax on every
  answer token) in L-token contexts of real text; records sit at depths 5–75 % of the context,
  i.e. beyond the {cfg.sliding_window}-token window. Samples: {n_retr} ("–": not run at that
  length, see below).
- **B/token**: KV bytes per token of the row's configuration (`cedlm.kv_layout.KVLayout`: main KV
  and index-key entries); **window B/seq**: the window rings of one sequence, a fixed cost.
- **within goal**: KL ≤ {GOAL_KL} nats and |Δppl| ≤ {GOAL_PPL} %.
- The reference row is the reference's own logits (KL 0 by definition); that two runs of one
  configuration give exactly KL 0 is checked by `tests/test_indexer_distill.py`.

{chr(10).join(lines)}

Retrieval in detail (the same items, graded): mean NLL (nats) of the answer tokens under teacher
forcing and the share of answer tokens that are the argmax. Lower NLL with the same weights means
the configuration brings more of the record back into reach of the query.

{chr(10).join(detail)}

![KL and perplexity change per row]({(rel / 'fidelity_kl.png').as_posix()})

![retrieval accuracy per context length]({(rel / 'fidelity_retrieval.png').as_posix()})

Reproduce: `{meta['command']}` ({meta['wall_s'] / 60:.0f} min on {meta['threads']} thread(s)).
{notes}"""
    plots(out, rows, lengths)
    path.write_text(text)
    return path


def plots(out: Path, rows: list[dict], lengths: list[int]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [r["name"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, max(4, 0.32 * len(rows) + 1)), dpi=100, sharey=True)
    y = range(len(rows))
    a1.barh(y, [max(r["kl"], 1e-6) for r in rows], color="tab:blue")
    a1.axvline(GOAL_KL, color="tab:red", linestyle="--", linewidth=1, label=f"goal {GOAL_KL} nats")
    a1.set(xscale="log", xlabel="KL vs reference (nats/token, log; 0 drawn at 1e-6)")
    a1.set_yticks(list(y), names, fontsize=7)
    a1.invert_yaxis()
    a1.legend(fontsize=7)
    a2.barh(y, [r["d_ppl_pct"] for r in rows], color="tab:orange")
    for g in (-GOAL_PPL, GOAL_PPL):
        a2.axvline(g, color="tab:red", linestyle="--", linewidth=1)
    a2.set(xlabel="Δ perplexity vs reference (%)")
    for ax in (a1, a2):
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(out / "fidelity_kl.png")
    plt.close(fig)

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    for r in rows:
        if not ("shipped" in r["name"] or "initialisation" in r["name"] or r["name"] == "reference"
                or "index keys FP4" in r["name"]):
            continue
        pts = [(L, r["retrieval"][str(L)]) for L in lengths if str(L) in r["retrieval"]]
        nll = [(L, r["answer_nll"][str(L)]) for L in lengths if str(L) in r.get("answer_nll", {})]
        if pts:
            ax.plot(*zip(*pts), "o-", label=r["name"])
            bx.plot(*zip(*nll), "o-", label=r["name"])
    ax.set(xscale="log", xlabel="context length (tokens)", ylabel="exact answers", ylim=(-0.05, 1.05),
           title="passkey / key-value retrieval beyond the window")
    bx.set(xscale="log", xlabel="context length (tokens)", ylabel="answer NLL (nats/token)",
           title="answer tokens under teacher forcing")
    for a in (ax, bx):
        a.set_xticks(lengths, [str(L) for L in lengths])
        a.minorticks_off()
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "fidelity_retrieval.png")
    plt.close(fig)
