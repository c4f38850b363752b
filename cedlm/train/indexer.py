"""`cedlm train indexer`: distil the lightning indexer and continue training on long sequences.

    cedlm train indexer --init cedlm/assets/model --out runs/indexer --seq-len 2048 \\
        --warmup-steps 20 --steps 200 --max-minutes 45 --threads 1

The lightning indexer gets no gradient through its top-k, so it is trained by distillation
(DeepSeek's recipe; `cedlm.model.probe`): its score distribution over the visible compressed
entries is pulled (KL) towards the main attention's distribution over the same entries (summed
over the heads of the layers that use its selection, detached).

With `--take-indexer RUN` nothing trains: --out gets the --init model with the indexer weights of
a finished run (the distilled indexer without the run's continued training of the main weights).

1. Dense warm-up (`--warmup-steps`): every index layer selects every visible entry; only the
   indexer's weights train, on the KL alone (the rest of the model is frozen).
2. Sparse phase (`--steps`): selection on (index_topk, candidate pool, as the model runs). The
   whole model continues training on the language-modelling loss over long sequences of corpus
   text carrying passkey / key-value retrieval items (`cedlm.data.retrieval`); the indexer
   trains on the KL over its selected entries. The indexer's inputs are detached and its
   selection passes no gradient, so each loss reaches only its own weights.
   With `--selection dense` this phase selects every visible entry instead (the attention of the
   evaluation's dense reference; the indexer's KL is then over every visible entry): it trains a
   model to retrieve before its indexer is distilled (`--kl-weight 0` keeps the indexer at its
   initialisation), e.g. the `retrieval` preset of FIDELITY.md's "Retrieval beyond the window: a
   model that can retrieve". `--repeat-fraction` mixes in sequences whose text repeats a stretch of itself
   (`cedlm.data.retrieval.repeat_sequence`): copying from context is what retrieval needs, and
   such sequences teach it with far more signal than a few answer tokens.

Per step, metrics.jsonl gets: the losses, the KL per index layer, the top-k recall of attention
mass per index layer (share of the dense attention mass over every visible entry that lands on
the indexer's top-k, over query rows that see more than index_topk entries), the answer-token
accuracy of the batch's retrieval items, lr, tokens/s and elapsed wall time. The run directory
holds `checkpoint/` (the whole model: the main weights move in phase 2), `metrics.jsonl`,
`loss.png` and `summary.json` (training cost: wall time and tokens per phase).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from cedlm import checkpoint as ckpt_io
from cedlm.data.retrieval import repeat_sequence, training_sequence
from cedlm.data.tokens import token_cache
from cedlm.model.probe import IndexerProbe, distill_kl, topk_recall
from cedlm.train.optim import clip_and_step, cosine_lr, update_moe_bias
from cedlm.train.runner import (DEVICE_HELP, MetricsLog, StepLoop, TimeBudget, progress_bar, run_steps,
                                save_model, set_threads, stage_device, write_json)
from cedlm.util import describe_device

DEFAULT_INIT = "cedlm/assets/model"


def indexer_params(model) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if ".indexer." in n]


def set_trainable(model, indexer_only: bool) -> None:
    for n, p in model.named_parameters():
        p.requires_grad_(".indexer." in n or not indexer_only)


def batch_of(rng, tokens, tok, a) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [B, S], y [B, S], answer mask of y [B, S]): a --retrieval-fraction share of the
    sequences carries --items retrieval items, a --repeat-fraction share repeats a stretch of its
    text (`repeat_sequence`; no answer tokens), the others are plain corpus windows."""
    xs, ms = [], []
    for _ in range(a.batch_size):
        r = rng.random()
        if r < a.retrieval_fraction:
            ids, m = training_sequence(rng, tokens, tok, a.seq_len, a.items, a.min_gap)
        elif r < a.retrieval_fraction + a.repeat_fraction:
            ids = repeat_sequence(rng, tokens, a.seq_len, kind=a.repeat_kind)[0]
            m = np.zeros(a.seq_len + 1, bool)
        else:
            s = int(rng.integers(0, len(tokens) - a.seq_len - 1))
            ids, m = np.asarray(tokens[s: s + a.seq_len + 1], dtype=np.int64), np.zeros(a.seq_len + 1, bool)
        xs.append(ids), ms.append(m)
    t, m = torch.from_numpy(np.stack(xs)), torch.from_numpy(np.stack(ms))
    return t[:, :-1], t[:, 1:], m[:, 1:]


def phase_name(whole: bool, dense: bool) -> str:
    """'dense' (the warm-up: indexer only), 'sparse' (whole model, sparse selection) or
    'whole-dense' (whole model, every visible entry selected: --selection dense)."""
    return ("whole-dense" if dense else "sparse") if whole else "dense"


def step(model, opt, x, y, ans, a, whole: bool, lr_main: float, lr_idx: float,
         dense: bool | None = None) -> dict:
    """One optimizer step of either phase -> its metrics. `whole`: the whole model trains on the
    LM loss too (phase 2); `dense`: every visible entry is selected (default: in the warm-up
    only)."""
    dense = not whole if dense is None else dense
    for g in opt.param_groups:
        g["lr"] = lr_idx if g["name"] == "indexer" else lr_main
    probe = IndexerProbe(dense=dense)
    logits = model(x, probe=probe)
    kl, per_layer = distill_kl(probe, sparse=not dense)
    rec = {"phase": phase_name(whole, dense), "kl": kl.item(),
           **{f"kl_{l}": v for l, v in per_layer.items()},
           **{f"recall_{l}": v for l, v in topk_recall(probe, model.cfg.index_topk).items()}}
    with torch.no_grad():
        ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(y)
        rec["lm_loss"] = ce.mean().item()
        if ans.any():
            rec["answer_loss"] = ce[ans].mean().item()
            rec["answer_acc"] = (logits.argmax(-1) == y)[ans].float().mean().item()
    loss = a.kl_weight * kl
    if whole:
        lm = ce_loss(logits, y, ans, a.answer_weight)
        loss = loss + lm
    loss.backward()
    rec["grad_norm"] = clip_and_step(opt, [p for p in model.parameters() if p.requires_grad], a.grad_clip)
    rec["loss"] = loss.item()
    return rec


def ce_loss(logits, y, ans, answer_weight: float) -> torch.Tensor:
    """Token-mean cross-entropy with answer tokens weighted `answer_weight` times."""
    ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(y)
    w = torch.ones_like(ce) + (answer_weight - 1.0) * ans.float()
    return (ce * w).sum() / w.sum()


def lr_at(i: int, n: int, peak: float, warm: int) -> float:
    """The stage's schedule: linear warm-up over `warm` steps, then cosine to 10% of peak at step n."""
    return cosine_lr(i, peak=peak, min_lr=0.1 * peak, warmup=warm, total=n)


def take_indexer(args: argparse.Namespace) -> int:
    """--take-indexer RUN: the --init model with only its indexer weights replaced by those of a
    run (the distilled indexer without the run's continued training of the main weights)."""
    try:
        model, tok = ckpt_io.load_model(args.init)
        trained, _ = ckpt_io.load_model(args.take_indexer)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: --init / --take-indexer: {e}", file=sys.stderr)
        return 2
    src = {k: v for k, v in trained.state_dict().items() if ".indexer." in k}
    state = model.state_dict()
    if not src or any(k not in state or state[k].shape != v.shape for k, v in src.items()):
        print("error: --take-indexer: its indexer tensors do not match the --init model's", file=sys.stderr)
        return 2
    model.load_state_dict({**state, **src}, strict=True)
    out = Path(args.out)
    saved = {"stage": "indexer", "init": str(args.init), "take_indexer": str(args.take_indexer)}
    ckpt_io.save_checkpoint(out / ckpt_io.CHECKPOINT_NAME, model, tok, training_args=saved)
    print(f"{out / ckpt_io.CHECKPOINT_NAME}: {args.init} with the {len(src)} indexer tensors of "
          f"{args.take_indexer}", file=sys.stderr)
    return 0


class IndexerStage:
    """The stage's parts for the runner: setup (model, corpus tokens, one AdamW with an indexer
    group and the main groups), `step` (one step of the dense warm-up or of the whole-model
    phase), `report` (plots) and `finish` (checkpoint, plots, summary.json)."""

    def __init__(self, args: argparse.Namespace):
        set_threads(args.threads)
        self.device = stage_device(args.device)       # before loading: a ValueError naming device
        torch.manual_seed(args.seed)
        try:
            self.model, self.tok = model, tok = ckpt_io.load_model(args.init, device=self.device)
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"--init: {e}") from None
        if not (0 <= args.repeat_fraction and args.retrieval_fraction + args.repeat_fraction <= 1):
            raise ValueError("--retrieval-fraction + --repeat-fraction must be within [0, 1]")
        if model.cfg.arch != "ced" or not model.cfg.index_source_layer_ids:
            raise ValueError("--init: the model has no lightning indexer to train")
        self.args = args
        self.tokens = token_cache(Path(args.data) / "train.txt", tok, None)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.rng = np.random.Generator(np.random.PCG64(args.seed))
        idx = indexer_params(model)
        idx_ids = {id(p) for p in idx}
        main = [p for p in model.parameters() if id(p) not in idx_ids]
        self.opt = torch.optim.AdamW([{"params": idx, "name": "indexer", "weight_decay": 0.0},
                                      {"params": [p for p in main if p.dim() >= 2], "name": "main",
                                       "weight_decay": args.weight_decay},
                                      {"params": [p for p in main if p.dim() < 2], "name": "main",
                                       "weight_decay": 0.0}], betas=(0.9, 0.95), eps=1e-8)
        self.metrics = MetricsLog(self.out / "metrics.jsonl")
        self.total = args.warmup_steps + args.steps
        self.budget = TimeBudget(args.max_minutes)
        self.cost = {p: {"steps": 0, "tokens": 0, "wall_s": 0.0}
                     for p in ("dense", phase_name(True, args.selection == "dense"))}
        model.train()
        print(f"cedlm train indexer: device {describe_device(self.device)}", file=sys.stderr, flush=True)

    def step(self, i: int) -> dict:
        args, model = self.args, self.model
        whole = i >= args.warmup_steps                     # phase 2: the whole model trains
        j = i - args.warmup_steps if whole else i
        set_trainable(model, indexer_only=not whole)
        ts = time.time()
        x, y, ans = (t.to(self.device, non_blocking=True)     # drawn on the host
                     for t in batch_of(self.rng, self.tokens, self.tok, args))
        if whole:
            rec = step(model, self.opt, x, y, ans, args, True, lr_at(j, args.steps, args.lr, args.lr_warmup),
                       lr_at(j, args.steps, args.indexer_lr, 1), dense=args.selection == "dense")
            update_moe_bias(model, args.bias_update_rate)
        else:
            rec = step(model, self.opt, x, y, ans, args, False, 0.0, lr_at(j, args.warmup_steps, args.indexer_lr, 1))
            update_moe_bias(model, 0.0)                     # frozen model: only reset the load
        dt = time.time() - ts
        c = self.cost[rec["phase"]]
        c["steps"], c["tokens"], c["wall_s"] = c["steps"] + 1, c["tokens"] + x.numel(), c["wall_s"] + dt
        rec.update(step=i + 1, tokens=sum(v["tokens"] for v in self.cost.values()),
                   tokens_per_s=x.numel() / dt, elapsed=self.budget.elapsed())
        return rec

    def report(self, rec: dict) -> None:
        if rec["step"] % self.args.plot_every == 0:
            _plot(self.metrics.records, self.out)

    def finish(self) -> dict:
        args, out, n = self.args, self.out, len(self.metrics)
        self.model.eval()
        saved = {k: v for k, v in vars(args).items() if k not in ("progress", "threads", "device")}
        save_model(out, self.model, self.tok, training_args={**saved, "stage": "indexer", "step": n})
        _plot(self.metrics.records, out)
        summary = {"stage": "indexer", "init": str(args.init), "seq_len": args.seq_len,
                   "batch_size": args.batch_size, "threads": args.threads, "cost": self.cost,
                   "wall_s": self.budget.elapsed(), "steps": n,
                   "command": "cedlm train indexer " + shlex.join(sys.argv[3:])}
        write_json(out / "summary.json", summary)
        print(json.dumps(summary), file=sys.stderr)
        return summary


def run(args: argparse.Namespace) -> int:
    if args.take_indexer:
        return take_indexer(args)
    try:
        st = IndexerStage(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_steps(StepLoop(
        name="cedlm train indexer", step=st.step, stop=min(st.total, args.stop_at_step or st.total),
        metrics=st.metrics, budget=st.budget, report=st.report,
        bar=progress_bar(args.progress, st.total, "train indexer"),
        postfix=lambda rec: dict(phase=rec["phase"], kl=f"{rec['kl']:.3f}", lm=f"{rec['lm_loss']:.3f}")))
    st.finish()
    return 0


def _plot(metrics: list[dict], out: Path) -> None:
    """loss.png (LM loss) and distill.png (KL and top-k recall per index layer)."""
    from cedlm.train.plot import plot_metrics
    plot_metrics([{"step": m["step"], "loss": m["lm_loss"], "tokens": m["tokens"]} for m in metrics],
                 out / "loss.png")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    keys = sorted({k for m in metrics for k in m if k.startswith("kl_")}, key=lambda k: int(k[3:]))
    for k in keys:
        a1.plot([m["step"] for m in metrics if k in m], [m[k] for m in metrics if k in m], label=f"layer {k[3:]}")
        r = "recall_" + k[3:]
        a2.plot([m["step"] for m in metrics if r in m], [m[r] for m in metrics if r in m], label=f"layer {k[3:]}")
    dense = [m["step"] for m in metrics if m["phase"] == "dense"]
    if dense and len(dense) < len(metrics):             # KL over all visible, then over the top-k
        for ax in (a1, a2):
            ax.axvline(dense[-1] + 0.5, color="grey", linestyle=":", linewidth=1)
    a1.set(xlabel="step (dotted: dense warm-up | sparse)", ylabel="KL(attention || indexer) nats",
           yscale="log", title="indexer distillation")
    a2.set(xlabel="step", ylabel="top-k share of attention mass", title="top-k recall (rows beyond k)")
    for ax in (a1, a2):
        ax.grid(alpha=0.3), ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "distill.png")
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The stage's flags (`cedlm train indexer`)."""
    a = p.add_argument
    a("--init", default=DEFAULT_INIT, help=f"model directory to start from (default {DEFAULT_INIT})")
    a("--out", default="runs/indexer", help="run directory (default runs/indexer)")
    a("--data", default="data/corpus", help="corpus dir with train.txt (default data/corpus)")
    a("--seq-len", type=int, default=2048, help="tokens per training sequence (default 2048)")
    a("--batch-size", type=int, default=1, help="sequences per step (default 1)")
    a("--warmup-steps", type=int, default=20, help="dense warm-up steps, indexer only (default 20)")
    a("--steps", type=int, default=200, help="sparse steps, whole model (default 200)")
    a("--selection", choices=("sparse", "dense"), default="sparse",
      help="selection of the whole-model steps: sparse (index_topk and the candidate pool, as the "
      "model runs; default) or dense (every visible entry, as the evaluation's reference)")
    a("--lr", type=float, default=2e-4, help="peak lr of the main model (default 2e-4)")
    a("--lr-warmup", type=int, default=10, help="linear lr warm-up of the sparse phase (default 10)")
    a("--indexer-lr", type=float, default=1e-3, help="peak lr of the indexer (default 1e-3)")
    a("--kl-weight", type=float, default=1.0, help="weight of the distillation KL (default 1)")
    a("--answer-weight", type=float, default=1.0, help="LM loss weight of retrieval answer tokens (default 1)")
    a("--retrieval-fraction", type=float, default=0.5, help="share of sequences with retrieval items (default 0.5)")
    a("--repeat-fraction", type=float, default=0.0, help="share of sequences whose text repeats a "
      "stretch of itself further on, to learn copying from context (default 0)")
    a("--repeat-kind", choices=("text", "random"), default="text", help="what the repeating "
      "sequences hold: corpus text (default) or tokens drawn independently from the corpus, which "
      "only a copy predicts")
    a("--items", type=int, default=6, help="retrieval items per such sequence (default 6)")
    a("--min-gap", type=int, default=128, help="least tokens between a record and its query (default 128)")
    a("--weight-decay", type=float, default=0.1)
    a("--grad-clip", type=float, default=1.0)
    a("--bias-update-rate", type=float, default=1e-3, help="MoE balancing bias step (default 1e-3)")
    a("--seed", type=int, default=1234)
    a("--threads", type=int, default=1, help="torch threads (default 1)")
    a("--device", default=None, help=DEVICE_HELP)
    a("--max-minutes", type=float, help="stop and save after this wall time")
    a("--stop-at-step", type=int, help="stop and save after this step (counting the warm-up), "
      "keeping the schedule of --steps (to repeat a run that --max-minutes stopped)")
    a("--plot-every", type=int, default=10, help="steps between plot redraws (default 10)")
    a("--take-indexer", metavar="RUN", help="train nothing: write --init's weights with the indexer "
      "of RUN (a finished run) to --out")
    a("--no-progress", dest="progress", action="store_false", help="no progress bar")
