"""Plots of the passkey-in-text experiment: training curve (train_copy.py --out JSONL) and exact
retrieval by gap for each selection (distil_eval.py OUT.json).

    python plot_passkey.py TRAIN.jsonl EVAL.json OUT_DIR
"""
import json
import sys
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

train, evaluation, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
out.mkdir(parents=True, exist_ok=True)
recs = [r for r in map(json.loads, open(train)) if "step" in r]
fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
steps = [r["step"] for r in recs]
a1.plot(steps, [r["first"] for r in recs], label="text tokens (LM loss)")
a1.plot(steps, [r["second"] for r in recs], label="answer tokens")
a1.set(xlabel="step (16 sequences of 128 tokens)", ylabel="loss (nats), mean of 25 steps", yscale="log")
a2.plot(steps, [r["exact_rows"] for r in recs], color="tab:green", label="items answered exactly")
a2.plot(steps, [r["second_acc"] for r in recs], color="tab:olive", label="answer tokens right")
a2.set(xlabel="step", ylabel="share (training batches)", ylim=(0, 1))
for ax in (a1, a2):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
fig.suptitle("passkey in text, dense selection (train_copy.py --layout passkey)")
fig.tight_layout()
fig.savefig(out / "passkey_training.png")
plt.close(fig)

ev = json.load(open(evaluation))
fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
gaps = [str(g) for g in ev["gaps"]]
w = 0.8 / len(ev["rows"])
for i, row in enumerate(ev["rows"]):
    ax.bar([j + i * w for j in range(len(gaps))], [row["by_gap"][g]["exact"] for g in gaps], w, label=row["row"])
ax.set_xticks([j + w * (len(ev["rows"]) - 1) / 2 for j in range(len(gaps))], gaps)
ax.set(xlabel=f"gap setting G (about 0.9 G filler tokens between record and query; window {ev['window']})",
       ylabel="passkey items answered exactly", ylim=(0, 1))
ax.legend(fontsize=8)
ax.grid(alpha=0.3, axis="y")
fig.tight_layout()
fig.savefig(out / "passkey_by_gap.png")
plt.close(fig)
print(out / "passkey_training.png", out / "passkey_by_gap.png")
