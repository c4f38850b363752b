"""A short width sweep of the joint run's first stage: the shipped model's config at several
widths, each trained from scratch on the stage-1 mixture for the same number of tokens, and what
each reached per token and per second of this machine.

    .venv/bin/python experiments/joint_pretraining/sweep.py docs/joint_pretraining/sweep.json \
        runs/sweep --widths 128,192,256 --steps 100 --threads 2

A width W keeps the config's depth, heads, head_dim, KV geometry, experts and Engram tables and
sets hidden_size = W and moe_intermediate_size = q_lora_rank = o_lora_rank = W / 2 (the shipped
shape is W = 256). Each run is its own `cedlm train pretrain` (the stage-1 command's settings, with
--steps STEPS so that every width gets its whole warm-up and cosine decay within the budget), one
after another on the same threads. The JSON holds per width the parameter counts, the tokens,
the training seconds, the tokens/s, the validation perplexity at each evaluation and, to compare
at equal time, every run's training loss at the time the fastest run finished.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASE_CONFIG = HERE / "config.json"
MIXTURE = HERE / "mixture.json"


def _shown(p: Path) -> str:
    """A path as the command line shows it: relative to the working directory when under it."""
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)


def width_config(width: int) -> dict:
    """The shipped config (official schema) at `width`."""
    cfg = json.loads(BASE_CONFIG.read_text())
    tc = cfg["text_config"]
    if width % 2:
        raise ValueError(f"--widths: {width} is odd; W / 2 must be a whole number")
    tc["hidden_size"] = width
    for k in ("moe_intermediate_size", "q_lora_rank", "o_lora_rank"):
        tc[k] = width // 2
    return cfg


def counts(config_path: Path) -> dict:
    from cedlm.config.params import param_counts
    from cedlm.config.schema import ModelConfig
    cfg = ModelConfig.from_dict(json.loads(config_path.read_text()))
    c = param_counts(cfg)
    return {"total": int(c["total"]), "active_decode": float(c["active_decode"])}


def command(config: Path, out: Path, steps: int, threads: int) -> list[str]:
    cli = str(Path(sys.executable).with_name("cedlm"))
    return [cli, "train", "pretrain", "--config", str(config),
            "--mixture", _shown(MIXTURE), "--out", str(out), "--steps", str(steps),
            "--batch-size", "16", "--seq-len", "256", "--lr", "1e-3", "--min-lr", "1e-4",
            "--warmup", str(max(1, steps // 10)), "--eval-every", str(max(1, steps // 2)),
            "--eval-batches", "8", "--save-every", str(steps), "--indexer-kl-weight", "1",
            "--dense-steps", str(steps), "--chat-examples", "3000", "--threads", str(threads),
            "--compile", "off", "--no-progress"]


def loss_at(recs: list[dict], seconds: float) -> float:
    """Mean training loss of the last 10 logged steps at or before `seconds` of training."""
    before = [r for r in recs if r["elapsed"] <= seconds + 1e-9] or recs[:1]
    tail = before[-10:]
    return sum(r["loss"] for r in tail) / len(tail)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_json")
    ap.add_argument("runs_root")
    ap.add_argument("--widths", default="128,192,256")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reuse", action="store_true", help="keep finished runs (their metrics)")
    a = ap.parse_args(argv)
    widths = [int(w) for w in a.widths.split(",")]
    root = Path(a.runs_root)
    rows = []
    for w in widths:
        run = root / f"w{w}"
        run.mkdir(parents=True, exist_ok=True)
        cfg_path = run / "sweep_config.json"
        cfg_path.write_text(json.dumps(width_config(w), indent=2) + "\n")
        cmd = command(cfg_path, run, a.steps, a.threads)
        done = (run / "checkpoint" / "training_args.json").exists()
        if not (a.reuse and done):
            t0 = time.time()
            print(f"sweep: width {w}: {' '.join(cmd[1:])}", flush=True)
            subprocess.run(cmd, check=True)
            print(f"sweep: width {w} done in {time.time() - t0:.0f} s", flush=True)
        recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l]
        val = [{"step": r["step"], "tokens": r["tokens"], "val_ppl": r["val_ppl"]}
               for r in recs if "val_ppl" in r]
        last = recs[-1]
        rows.append({"width": w, "params": counts(cfg_path), "steps": last["step"],
                     "tokens": last["tokens"], "train_s": round(last["elapsed"], 1),
                     "tokens_per_s": round(last["tokens"] / last["elapsed"], 1),
                     "val": val, "val_ppl": val[-1]["val_ppl"],
                     "train_loss_end": round(loss_at(recs, last["elapsed"]), 4),
                     "command": " ".join(["cedlm"] + cmd[1:]), "_recs": recs})
    fastest = min(r["train_s"] for r in rows)
    for r in rows:
        r["train_loss_at_fastest_s"] = round(loss_at(r.pop("_recs"), fastest), 4)
    out = {"widths": widths, "steps": a.steps, "threads": a.threads,
           "batch_tokens": 16 * 256, "equal_time_s": fastest, "rows": rows,
           "best_at_equal_tokens": min(rows, key=lambda r: r["val_ppl"])["width"],
           "best_at_equal_time": min(rows, key=lambda r: r["train_loss_at_fastest_s"])["width"]}
    Path(a.out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out_json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'width':>6} {'params':>10} {'active':>10} {'tok/s':>7} {'s':>6} {'val ppl':>8} "
          f"{'loss@' + str(int(fastest)) + 's':>10}")
    for r in rows:
        print(f"{r['width']:>6} {r['params']['total']:>10,} {r['params']['active_decode']:>10,.0f} "
              f"{r['tokens_per_s']:>7.0f} {r['train_s']:>6.0f} {r['val_ppl']:>8.1f} "
              f"{r['train_loss_at_fastest_s']:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
