"""Loss curve of a run: training loss (raw and smoothed) and validation loss against steps."""
from __future__ import annotations

from pathlib import Path


def plot_metrics(metrics: list[dict], path: str | Path, smoothing: float = 0.9) -> None:
    """Write a PNG of `metrics` (records with step, loss and, on eval steps, val_loss)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cedlm.util import atomic_open

    steps = [m["step"] for m in metrics if m.get("loss") is not None]
    loss = [m["loss"] for m in metrics if m.get("loss") is not None]
    ema, s = [], None
    for v in loss:
        s = v if s is None else smoothing * s + (1 - smoothing) * v
        ema.append(s)
    val = [(m["step"], m["val_loss"]) for m in metrics if m.get("val_loss") is not None]

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.plot(steps, loss, color="tab:blue", alpha=0.25, linewidth=0.8, label="train loss")
    ax.plot(steps, ema, color="tab:blue", linewidth=1.5, label=f"train loss (EMA {smoothing})")
    if val:
        ax.plot(*zip(*val), "o-", color="tab:orange", markersize=3, label="val loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    if metrics:
        last = metrics[-1]
        ax.set_title(f"step {last['step']}, {last.get('tokens', 0) / 1e6:.1f}M tokens")
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png")
    plt.close(fig)
