"""The joint run's curves across its stages, for the docs: a compact JSONL (every validation step,
and every 10th step, with the keys below) and one plot (validation perplexity, held-out retrieval
answer accuracy, training answer / copy accuracy, indexer recall), stage after stage.

    .venv/bin/python experiments/joint_pretraining/curves.py OUT_DIR RUN_DIR [RUN_DIR ...]
    .venv/bin/python experiments/joint_pretraining/curves.py OUT_DIR --after CURVES.jsonl RUN_DIR ...

Each RUN_DIR is a `cedlm train pretrain` run directory (its `metrics.jsonl`); a later one is a
stage started with `--init-from` the one before, so its steps are drawn after the earlier ones'.
`--after` starts from the rows of an earlier output (the stages trained before a shipped model
whose run directories are gone) and draws the RUN_DIRs after them.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

KEYS = ("step", "tokens", "seq_len", "phase", "lr", "loss", "lm_loss", "kl", "val_ppl",
        "val_retrieval_acc", "val_retrieval_exact", "val_retrieval_len", "loss_corpus", "loss_chat",
        "loss_retrieval", "acc_retrieval", "loss_repeat", "acc_repeat", "tokens_per_s", "elapsed")


def load(run: Path) -> list[dict]:
    """The run's metrics up to its checkpoint's step (a run stopped between two saves logged
    steps that its checkpoint, and so the next stage, does not have)."""
    last = json.loads((run / "checkpoint" / "training_args.json").read_text())["step"]
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [r for r in recs if r["step"] <= last]


def main(argv: list[str]) -> int:
    before: list[dict] = []
    if len(argv) > 2 and argv[1] == "--after":
        before = [json.loads(l) for l in Path(argv[2]).read_text().splitlines() if l.strip()]
        argv = argv[:1] + argv[3:]
    if len(argv) < 2:
        print("usage: curves.py OUT_DIR [--after CURVES.jsonl] RUN_DIR [RUN_DIR ...]", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    rows, offset, tok_offset, bounds = list(before), 0, 0, []
    first = 0
    if before:
        first = before[-1]["stage"] + 1
        offset, tok_offset = before[-1]["global_step"], before[-1]["global_tokens"]
        bounds = [max(r["global_step"] for r in before if r["stage"] == st)
                  for st in sorted({r["stage"] for r in before})]
    for i, run in enumerate(map(Path, argv[1:]), start=first):
        recs = load(run)
        for r in recs:
            keep = "val_ppl" in r or r["step"] % 10 == 0 or r is recs[-1]
            if keep:
                rows.append({"stage": i, "run": run.name, "global_step": offset + r["step"],
                             "global_tokens": tok_offset + r.get("tokens", 0),
                             **{k: r[k] for k in KEYS if k in r}})
        offset += recs[-1]["step"]
        tok_offset += recs[-1].get("tokens", 0)
        bounds.append(offset)
    (out / "curves.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    val = [r for r in rows if "val_ppl" in r]
    ax[0].plot([r["global_step"] for r in val], [r["val_ppl"] for r in val], "o-")
    ax[0].set_yscale("log"), ax[0].set_title("validation perplexity (256 tokens)")
    vr = [r for r in rows if "val_retrieval_acc" in r]
    ax[1].plot([r["global_step"] for r in vr], [r["val_retrieval_acc"] for r in vr], "o-",
               label="held-out retrieval: answer tokens right")
    ax[1].plot([r["global_step"] for r in vr], [r["val_retrieval_exact"] for r in vr], "s-",
               label="held-out retrieval: items exact")
    for k, lab in (("acc_retrieval", "training retrieval answers"), ("acc_repeat", "training repeated tokens")):
        pts = [r for r in rows if k in r]
        ax[1].plot([r["global_step"] for r in pts], [r[k] for r in pts], ".", alpha=0.4, label=lab)
    ax[1].set_ylim(0, 1), ax[1].set_title("retrieval and copying"), ax[1].legend(fontsize=7)
    for k in ("loss_corpus", "loss_chat", "loss_retrieval", "loss_repeat"):
        pts = [r for r in rows if k in r]
        ax[2].plot([r["global_step"] for r in pts], [r[k] for r in pts], ".", alpha=0.5, label=k)
    ax[2].set_title("training loss by row kind (nats/token)"), ax[2].legend(fontsize=7)
    for a in ax:
        a.set_xlabel("step (stages one after the other)")
        for b in bounds[:-1]:
            a.axvline(b, color="grey", ls="--", lw=0.8)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=90)
    print(f"wrote {out / 'curves.jsonl'} ({len(rows)} rows) and {out / 'curves.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
