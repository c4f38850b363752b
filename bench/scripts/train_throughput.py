"""Training throughput (tokens/s) of a model config, eager vs compiled (`cedlm.train.compile`).

    .venv/bin/python bench/scripts/train_throughput.py --seq-len 256 1024 --threads 1 2 \\
        --modes eager compiled --steps 6 --warmup 2 --json bench/results/train_throughput.json

Each case (mode x sequence length x threads) builds the model from --config (default: the
shipped model's), seeded, and runs `--warmup + --steps` optimizer steps of pretraining on
synthetic tokens (uniform random ids: throughput does not depend on the text), each step what
`cedlm train pretrain` does: forward + cross-entropy, backward, clip, AdamW, the MoE bias update.
The batch is --tokens-per-step / seq len sequences (16 x 256 by default, the train CLI's batch at
its default length). Reported: the median step's tokens/s after the warm-up, the first step's
time (for compiled: the compile, forward and backward, plus one step) and the final loss. Every
case runs in its own process (torch threads and dynamo's state start fresh), one after another.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "cedlm" / "assets" / "model" / "config.json"


def run_case(config: str, mode: str, seq_len: int, batch: int, threads: int, steps: int,
             warmup: int, seed: int) -> dict:
    """One case in this process: -> its figures."""
    import torch

    from cedlm.config import ModelConfig
    from cedlm.model import build_model
    from cedlm.train.compile import drop_unrouted, training_loss
    from cedlm.train.optim import clip_and_step, param_groups, update_moe_bias

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model = build_model(ModelConfig.from_json(config)).train()
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    loss_fn = training_loss(model, compile=mode == "compiled")
    g = torch.Generator().manual_seed(seed)
    times, losses = [], []
    for _ in range(warmup + steps):
        x = torch.randint(0, model.cfg.vocab_size, (batch, seq_len + 1), generator=g)
        t0 = time.perf_counter()
        loss = loss_fn(x[:, :-1], x[:, 1:])
        loss.backward()
        drop_unrouted(model)
        clip_and_step(opt, model.parameters(), 1.0)
        update_moe_bias(model, 1e-3)
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    med = statistics.median(times[warmup:])
    return {"mode": mode, "seq_len": seq_len, "batch": batch, "threads": threads, "steps": steps,
            "warmup": warmup, "tokens_per_s": batch * seq_len / med, "median_step_s": med,
            "first_step_s": times[0], "step_s": times, "losses": losses}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="model config.json (default: the shipped model's)")
    p.add_argument("--seq-len", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--tokens-per-step", type=int, default=4096, help="batch = this / seq len (default 4096)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    p.add_argument("--steps", type=int, default=6, help="timed steps after the warm-up (default 6)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--case", help=argparse.SUPPRESS)        # internal: one case, JSON on stdout
    a = p.parse_args(argv)
    if a.steps < 1 or a.warmup < 1:
        p.error("--steps and --warmup: must be >= 1")
    if a.case:
        mode, s, t = a.case.split(",")
        s, t = int(s), int(t)
        print(json.dumps(run_case(a.config, mode, s, max(1, a.tokens_per_step // s), t, a.steps, a.warmup, a.seed)))
        return 0
    rows = []
    for s in a.seq_len:
        for t in a.threads:
            for mode in a.modes:
                cmd = [sys.executable, __file__, "--config", a.config, "--tokens-per-step",
                       str(a.tokens_per_step), "--steps", str(a.steps), "--warmup", str(a.warmup),
                       "--seed", str(a.seed), "--case", f"{mode},{s},{t}"]
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode:
                    sys.stderr.write(out.stderr)
                    return out.returncode
                r = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(r)
                print(f"{mode:9s} seq {s:5d} batch {r['batch']:3d} threads {t}: "
                      f"{r['tokens_per_s']:8.0f} tok/s (median step {r['median_step_s']:.2f} s, "
                      f"first step {r['first_step_s']:.1f} s, loss {r['losses'][-1]:.4f})", flush=True)
    print("\n| seq len | batch | threads | eager tok/s | compiled tok/s | speed-up | compiled first step (s) |")
    print("|---|---|---|---|---|---|---|")
    for s in a.seq_len:
        for t in a.threads:
            by = {r["mode"]: r for r in rows if r["seq_len"] == s and r["threads"] == t}
            e, c = by.get("eager"), by.get("compiled")
            ef = f"{e['tokens_per_s']:.0f}" if e else "-"
            cf = f"{c['tokens_per_s']:.0f}" if c else "-"
            sp = f"{c['tokens_per_s'] / e['tokens_per_s']:.2f}x" if e and c else "-"
            first = f"{c['first_step_s']:.1f}" if c else "-"
            print(f"| {s} | {(e or c)['batch']} | {t} | {ef} | {cf} | {sp} | {first} |")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"config": a.config, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
