"""`cedlm train pretrain`: pretrain a CED model on a prepared corpus (one process, or DDP under
torchrun).

    cedlm train pretrain --preset small --data data/corpus --out runs/small --steps 2000 --threads 2
    torchrun --nproc_per_node 2 -m cedlm.train.train --preset tiny --out runs/tiny --steps 100
    cedlm train pretrain --resume runs/small --steps 4000     # continue (saved settings are kept)

Each step: draw the global batch (every rank its slice of it), forward + cross-entropy, backward,
average gradients across ranks, clip, AdamW with linear warmup and cosine decay to --min-lr, then
the MoE aux-loss-free balancing: every gate's selection bias moves by --bias-update-rate towards
balance, from the tokens-per-expert load of this step (summed over ranks), and the load is reset.

With --compile on, the forward + loss and its backward run compiled by torch.compile
(`cedlm.train.compile`: 1.3-1.4x the tokens/s of eager at the shipped size on an idle core, more
under load; the first step compiles, about 15 minutes cold, 2-4 cached): worth it for long runs.

Gradients are averaged with one all-reduce of a flat buffer rather than the DDP wrapper: MoE experts
that no token of the global batch chose keep `grad = None` exactly as in a single process (AdamW
then skips them), which is what makes N ranks reproduce one process on the same global batch.

A run directory holds `checkpoint/` (HF-style, see cedlm/checkpoint.py), `metrics.jsonl` (one line per
step; eval steps add val_loss and val_ppl) and `loss.png`. Resuming restores the optimizer, step,
RNG and sampler states: N steps straight and N/2 + resume + N/2 give bitwise equal weights.

`train` is `setup` (a `TrainRun`), then the stage runner (`cedlm.train.runner.run_steps`): per
step `optimisation_step`, `validate` when due and at the end, the metrics line and progress, and
`save` when due and at the end.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cedlm import checkpoint as ckpt_io
from cedlm.config import ModelConfig
from cedlm.data.tokens import token_cache
from cedlm.model import build_model
from cedlm.text.engram_map import V41, build_token_map
from cedlm.text.tokenizer import load_tokenizer
from cedlm.train import checkpoint as train_state
from cedlm.train.compile import compile_default, compile_flag, drop_unrouted, training_loss
from cedlm.train.data import BatchSampler, val_batches
from cedlm.train.joint import JointData, SettingsError, joint_loss, load_mixture, retrieval_eval
from cedlm.train.optim import (clip_and_step, cosine_lr, param_groups, set_lr, sync_gradients,
                               update_moe_bias)
from cedlm.train.plot import plot_metrics
from cedlm.train.runner import MetricsLog, StepLoop, TimeBudget, progress_bar, run_steps, set_threads
from cedlm.util import describe_device, resolve_device

DEFAULTS = dict(
    preset="small", config=None, arch=None, tokenizer="default", data="data/corpus", cache_dir=None,
    out="runs/train", steps=1000, batch_size=16, seq_len=256, lr=1e-3, min_lr=1e-4, warmup=100,
    weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0, eval_every=100, eval_batches=8,
    save_every=500, seed=1337, bias_update_rate=1e-3, threads=None, max_minutes=None,
    stop_at_step=None, device=None, progress=True, compile=None,   # None: compile_default(); device auto
    mixture=None, chat_examples=3000, indexer_kl_weight=0.0, dense_steps=0, eval_retrieval=16,
    init_from=None,
)
# Settings of this invocation only: not saved, not restored on resume.
RUN_ONLY = ("resume", "out", "threads", "max_minutes", "stop_at_step", "device", "progress", "func",
            "command", "stage", "compile")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Training flags. Defaults are None here so --resume can tell given from omitted."""
    a = p.add_argument
    a("--preset", help=f"model preset (default {DEFAULTS['preset']})")
    a("--config", help="model config.json (official schema); overrides --preset")
    a("--arch", choices=["ced", "decoder_only", "twin"],
      help="ced (default) or decoder_only (the baseline: full attention, BF16 KV); twin = decoder_only")
    a("--tokenizer", help="tokenizer name or dir (default: the shipped 4096-vocab BPE)")
    a("--data", help="corpus dir with train.txt and val.txt (default data/corpus)")
    a("--cache-dir", help="token cache dir (default DATA/tokens)")
    a("--out", help="run directory (default runs/train; on resume, the resumed run's dir)")
    a("--steps", type=int, help="total optimizer steps (default 1000)")
    a("--batch-size", type=int, help="global batch in sequences, split across ranks (default 16)")
    a("--seq-len", type=int, help="tokens per sequence (default 256)")
    a("--lr", type=float, help="peak learning rate (default 1e-3)")
    a("--min-lr", type=float, help="final learning rate of the cosine decay (default 1e-4)")
    a("--warmup", type=int, help="linear warmup steps (default 100)")
    a("--weight-decay", type=float, help="AdamW weight decay on matrices (default 0.1)")
    a("--beta1", type=float), a("--beta2", type=float)
    a("--grad-clip", type=float, help="max global grad norm; 0 disables (default 1.0)")
    a("--eval-every", type=int, help="steps between validations (default 100)")
    a("--eval-batches", type=int, help="validation batches of --batch-size windows (default 8)")
    a("--save-every", type=int, help="steps between checkpoints (default 500)")
    a("--seed", type=int, help="seed of init and data order (default 1337)")
    a("--bias-update-rate", type=float, help="MoE balancing bias step per update (default 1e-3)")
    a("--threads", type=int, help="torch threads per process (default: cores / local ranks)")
    a("--max-minutes", type=float, help="stop cleanly and checkpoint after this wall time")
    a("--stop-at-step", type=int, help="stop (and checkpoint) at this step, keeping the --steps schedule")
    a("--resume", help="checkpoint or run dir to continue from")
    a("--init-from", help="start a new run (step 0, fresh optimizer and schedule) from this checkpoint's "
                          "weights: a second stage with other settings; its config, or --config's "
                          "when given (same shapes: e.g. another rope_precision)")
    a("--device", help="auto (default: CUDA when this torch build sees a GPU, else the CPU), cpu, "
                       "cuda or cuda:N; under torchrun on CUDA each rank takes cuda:LOCAL_RANK")
    a("--no-progress", dest="progress", action="store_false", default=None, help="no progress bar")
    a("--compile", type=compile_flag, metavar="on|off",
      help="torch.compile the training forward + backward (default off, or $CEDLM_TRAIN_COMPILE; "
           "the first step compiles, its time is logged; artefacts cached in "
           "$CEDLM_CACHE_DIR/inductor, default ~/.cache/cedlm/inductor)")
    a("--mixture", help="joint pretraining: a MixtureConfig JSON file (row weights of corpus / chat / "
                        "retrieval / repeat, the (step, seq_len) curriculum; cedlm/train/joint.py); "
                        "--batch-size is then the rows at the first stage, tokens per step kept after")
    a("--chat-examples", type=int, help="conversations built for the mixture's chat rows (default 3000)")
    a("--indexer-kl-weight", type=float,
      help="weight of the lightning indexer's distillation KL in the loss (default 0: not trained)")
    a("--eval-retrieval", type=int,
      help="with --mixture: held-out retrieval rows checked at each validation, at the stage's "
           "length (default 16; 0: none)")
    a("--dense-steps", type=int,
      help="steps of dense selection first (every visible entry; the indexer warm-up), then sparse "
           "(default 0)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cedlm train pretrain", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


# ---------------------------------------------------------------------------- helpers
def lr_at(step: int, a) -> float:
    """The pretraining schedule (`cosine_lr`) of settings `a` (lr, min_lr, warmup, steps)."""
    return cosine_lr(step, peak=a.lr, min_lr=a.min_lr, warmup=a.warmup, total=a.steps)


def resolve_args(given: argparse.Namespace, saved: dict | None) -> argparse.Namespace:
    """DEFAULTS < settings saved in the checkpoint < flags given on this command line."""
    merged = dict(DEFAULTS)
    if saved:
        merged.update(saved)
    merged.update({k: v for k, v in vars(given).items() if v is not None})
    if merged["compile"] is None:
        merged["compile"] = compile_default()
    return argparse.Namespace(**merged)


def all_mean(x: float, world: int, device) -> float:
    if world == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / world


@torch.no_grad()
def evaluate(model, tokens, a, rank: int, world: int, device) -> float:
    """Mean validation cross-entropy (nats/token) over the fixed windows."""
    was = model.training
    model.eval()
    tot = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in val_batches(tokens, a.seq_len, a.batch_size, a.eval_batches, rank, world):
        x, y = x.to(device), y.to(device)
        logits = model(x)
        tot[0] += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").double()
        tot[1] += y.numel()
    if world > 1:
        dist.all_reduce(tot)
    model.train(was)
    return (tot[0] / tot[1]).item()


# ---------------------------------------------------------------------------- distributed
def train_device(spec, world: int, local_rank: int) -> torch.device:
    """The device of this process for `--device spec` (`cedlm.util.resolve_device`: a ValueError
    naming `device` for one this torch cannot use): on CUDA with several ranks, each rank its own
    GPU, cuda:LOCAL_RANK."""
    device = resolve_device(spec, "device")
    if device.type == "cuda" and world > 1:
        device = resolve_device(f"cuda:{local_rank}", "device")
    return device


def setup_distributed(device_spec):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = train_device(device_spec, world, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


# ---------------------------------------------------------------------------- training
@dataclass
class TrainRun:
    """One training process's run: settings, model, optimizer, data and progress so far."""
    a: argparse.Namespace
    rank: int
    world: int
    device: torch.device
    model: torch.nn.Module
    tokenizer: object
    opt: torch.optim.Optimizer
    sampler: BatchSampler
    val_tok: np.ndarray
    out: Path
    step: int = 0
    log: MetricsLog | None = None         # metrics.jsonl (written by rank 0)
    budget: TimeBudget = field(default_factory=TimeBudget)   # --max-minutes of this process
    loss_fn: object = None                # (x, y) -> mean cross-entropy: compiled or eager
    first_step_s: float | None = None     # wall time of this process's first step
    joint: JointData | None = None        # --mixture: the joint pretraining batches
    elapsed0: float = 0.0                 # wall time of earlier processes of this run (resume)

    @property
    def master(self) -> bool:
        return self.rank == 0

    @property
    def params(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    @property
    def metrics(self) -> list[dict]:
        return self.log.records

    def elapsed(self) -> float:
        return self.elapsed0 + self.budget.elapsed()


def _build_model(a: argparse.Namespace, master: bool):
    """A fresh model (seeded) with its tokenizer; the config's vocabulary follows the tokenizer."""
    tokenizer = load_tokenizer(a.tokenizer)
    cfg = ModelConfig.from_json(a.config) if a.config else ModelConfig.preset(a.preset)
    if cfg.vocab_size != tokenizer.vocab_size:
        if master:
            print(f"note: vocab_size {cfg.vocab_size} -> {tokenizer.vocab_size} (the tokenizer's)",
                  file=sys.stderr)
        cfg = cfg.replace(vocab_size=tokenizer.vocab_size)
        if cfg.engram_layer_ids:       # the Engram bound was sized for another vocabulary
            cfg = cfg.replace(engram_compressed_vocab_size=build_token_map(tokenizer, V41)[1])
    if cfg.engram_token_map != V41:    # a new model always uses the V4.1 Engram map
        if master:
            print(f"note: engram_token_map {cfg.engram_token_map} -> {V41} (new model)", file=sys.stderr)
        cfg = cfg.replace(engram_token_map=V41)
    if a.arch:
        cfg = cfg.replace(arch=a.arch)
    torch.manual_seed(a.seed)
    model = build_model(cfg)
    ckpt_io.set_token_map(model, tokenizer)
    return model, tokenizer


def _init_from(a: argparse.Namespace, given: argparse.Namespace, master: bool):
    """--init-from: the checkpoint's model, or its weights in --config's model (same parameter
    shapes), with the checkpoint's tokenizer. `SettingsError` naming the field otherwise, also for
    a --preset, --arch or --tokenizer given with it (they would be ignored)."""
    try:
        src = ckpt_io.resolve_checkpoint(a.init_from)
        model, tokenizer = ckpt_io.load_model(src)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise SettingsError(f"init_from: {a.init_from}: {e}") from None
    for f in ("preset", "arch", "tokenizer"):
        if getattr(given, f, None) is not None:
            raise SettingsError(f"{f}: not used with --init-from (the checkpoint's model and "
                                "tokenizer; --config for a same-shaped config)")
    if a.config:
        fresh = build_model(ModelConfig.from_json(a.config))
        mine, theirs = fresh.state_dict(), model.state_dict()
        shape = lambda sd, k: tuple(sd[k].shape) if k in sd else "absent"
        for k in sorted(mine.keys() | theirs.keys()):
            if shape(mine, k) != shape(theirs, k):
                raise SettingsError(f"init_from: parameter {k}: {shape(mine, k)} in --config's model, "
                                    f"{shape(theirs, k)} in the checkpoint")
        fresh.load_state_dict(theirs, strict=True)
        ckpt_io.set_token_map(fresh, tokenizer)
        model = fresh
    if master:
        print(f"cedlm train: weights from {src}" + (f", config {a.config}" if a.config else ""),
              file=sys.stderr)
    return model, tokenizer


def setup(given: argparse.Namespace) -> TrainRun:
    """Settings, process group, model + tokenizer (fresh or resumed), optimizer, token data, the
    saved progress on resume, and the run directory with its metrics file."""
    saved_state = train_state.load_training_state(given.resume) if getattr(given, "resume", None) else None
    a = resolve_args(given, saved_state["args"] if saved_state else None)
    rank, world, device = setup_distributed(a.device)
    set_threads(a.threads)
    master = rank == 0

    if saved_state:
        src = ckpt_io.resolve_checkpoint(a.resume)
        if given.out is None:
            a.out = str(src.parent if src.name == ckpt_io.CHECKPOINT_NAME else src)
        model, tokenizer = ckpt_io.load_model(src)
    elif a.init_from:
        model, tokenizer = _init_from(a, given, master)
    else:
        model, tokenizer = _build_model(a, master)
    model.to(device).train()
    opt = torch.optim.AdamW(param_groups(model, a.weight_decay), lr=a.lr, betas=(a.beta1, a.beta2),
                            eps=1e-8)

    # Data: rank 0 tokenises once; the others wait, then map the same cache.
    data = Path(a.data)
    if master:
        train_tok = token_cache(data / "train.txt", tokenizer, a.cache_dir, progress=a.progress)
        val_tok = token_cache(data / "val.txt", tokenizer, a.cache_dir)
    if world > 1:
        dist.barrier()
    if not master:
        train_tok = token_cache(data / "train.txt", tokenizer, a.cache_dir, build=False)
        val_tok = token_cache(data / "val.txt", tokenizer, a.cache_dir, build=False)
    sampler = BatchSampler(train_tok, a.seq_len, a.batch_size, a.seed, rank, world)
    check_joint(a, model)
    try:
        joint = (JointData(a.mixture, train_tok, tokenizer, model.cfg.sliding_window, a.data, a.batch_size,
                           a.chat_examples, a.seed, world) if a.mixture else None)
    except ValueError as e:
        raise SettingsError(str(e)) from None

    run = TrainRun(a, rank, world, device, model, tokenizer, opt, sampler, val_tok, Path(a.out),
                   budget=TimeBudget(a.max_minutes), loss_fn=training_loss(model, a.compile), joint=joint)
    if saved_state:
        opt.load_state_dict(saved_state["optimizer"])
        sampler.load_state_dict(saved_state["sampler"])
        rngs = saved_state["rng"]
        train_state.set_rng_state(rngs[rank] if rank < len(rngs) else rngs[0])
        run.step = saved_state["step"]
        run.elapsed0 = saved_state.get("elapsed", 0.0)
    if master:
        run.out.mkdir(parents=True, exist_ok=True)
    # a fresh run, or exactly what the checkpoint saw
    run.log = MetricsLog(run.out / "metrics.jsonl", saved_state["metrics"] if saved_state else (), master)
    if master:
        print(f"cedlm train: {model.num_parameters() / 1e6:.2f}M params "
              f"({model.num_parameters(True) / 1e6:.2f}M without Engram tables), "
              f"{len(train_tok):,} train tokens, {world} rank(s), "
              f"{torch.get_num_threads()} threads/rank, step {run.step}/{a.steps}, "
              f"device {describe_device(device)}", file=sys.stderr)
        if joint:
            for st in joint.source.plan():
                w = " ".join(f"{k} {v:.2f}" for k, v in st["weights"].items())
                print(f"cedlm train: mixture from step {st['step']}: seq_len {st['seq_len']}, "
                      f"{joint.rows(st['step'])} rows; {w}", file=sys.stderr)
    return run


def check_joint(a: argparse.Namespace, model) -> None:
    """The joint-pretraining settings against each other and the model (`SettingsError` naming
    the field)."""
    if a.mixture is not None:
        try:
            a.mixture = load_mixture(a.mixture)
        except ValueError as e:
            raise SettingsError(str(e)) from None
    if not isinstance(a.indexer_kl_weight, (int, float)) or a.indexer_kl_weight < 0:
        raise SettingsError(f"indexer_kl_weight: must be >= 0, got {a.indexer_kl_weight!r}")
    if not isinstance(a.eval_retrieval, int) or a.eval_retrieval < 0:
        raise SettingsError(f"eval_retrieval: must be an int >= 0, got {a.eval_retrieval!r}")
    if not isinstance(a.dense_steps, int) or a.dense_steps < 0:
        raise SettingsError(f"dense_steps: must be an int >= 0, got {a.dense_steps!r}")
    probe = a.indexer_kl_weight > 0 or a.dense_steps > 0
    if probe and (model.cfg.arch != "ced" or not model.cfg.index_source_layer_ids):
        raise SettingsError("indexer_kl_weight: the model has no lightning indexer (index_source_layer_ids)")
    if probe and a.compile:
        raise SettingsError("compile: the indexer probe (--indexer-kl-weight, --dense-steps) runs eager; "
                         "use --compile off")


def optimisation_step(run: TrainRun) -> dict:
    """One optimizer step on the next global batch; returns its metrics record."""
    a, model, opt, params = run.a, run.model, run.opt, run.params
    t0 = time.time()
    lr = lr_at(run.step, a)
    set_lr(opt, lr)
    extra: dict = {}
    if run.joint:
        b = run.joint.batch(run.step, run.rank)
        x, y, mask = (t.to(run.device) for t in b.inputs_targets())
        dense = run.step < a.dense_steps
        loss, extra = joint_loss(model, x, y, mask, b.answer_mask[:, 1:].to(run.device), b.kinds,
                                 a.indexer_kl_weight, dense, run.loss_fn, run.joint.cfg.answer_weight)
        extra.update(seq_len=b.seq_len, rows=len(b.kinds) * run.world,
                     phase="dense" if dense else "sparse", **{f"rows_{k}": v for k, v in b.mix.items()})
    else:
        x, y = run.sampler.next_batch()
        x, y = x.to(run.device), y.to(run.device)
        loss = run.loss_fn(x, y)
    loss.backward()
    drop_unrouted(model)                  # as eager: no gradient for an expert no token chose
    if run.world > 1:
        sync_gradients(params, run.world)
    grad_norm = clip_and_step(opt, params, a.grad_clip)
    update_moe_bias(model, a.bias_update_rate, run.world)
    run.step += 1
    loss_v = all_mean(loss.item(), run.world, run.device)
    dt = time.time() - t0
    if run.first_step_s is None:          # this process's first step: the compile, when on
        run.first_step_s = dt
        if a.compile and run.master:
            print(f"cedlm train: first step (compiling the training step) {dt:.1f} s", file=sys.stderr)
    tokens_per_step = x.numel() * run.world
    tokens = run.joint.tokens_through(run.step) if run.joint else run.step * tokens_per_step
    return {"step": run.step, "loss": loss_v, "lr": lr, "grad_norm": grad_norm,
            "tokens": tokens, "tokens_per_s": tokens_per_step / dt, "elapsed": run.elapsed(), **extra}


def out_of_time(run: TrainRun) -> bool:
    """Whether --max-minutes is used up: rank 0 decides, every rank follows."""
    over = run.budget.over()
    if run.world > 1:
        flag = torch.tensor([float(over)], device=run.device)
        dist.broadcast(flag, 0)
        over = bool(flag.item())
    return over


def validate(run: TrainRun, rec: dict) -> None:
    """Validation loss and perplexity, added to the step's record."""
    val = evaluate(run.model, run.val_tok, run.a, run.rank, run.world, run.device)
    rec.update(val_loss=val, val_ppl=math.exp(min(val, 50.0)))
    if run.joint and run.master:          # held-out retrieval at the stage's length (rank 0)
        rec.update(retrieval_eval(run.model, run.joint, run.val_tok, run.joint.seq_len(max(run.step - 1, 0)),
                                  run.a.eval_retrieval, run.device))


def report(run: TrainRun, rec: dict, bar) -> None:
    """On rank 0, after a validation: redraw loss.png and print the step's line."""
    if not run.master or "val_loss" not in rec:
        return
    plot_metrics(run.metrics, run.out / "loss.png")
    msg = (f"step {rec['step']}: loss {rec['loss']:.4f} val_loss {rec['val_loss']:.4f} "
           f"val_ppl {rec['val_ppl']:.2f} lr {rec['lr']:.2e} {rec['tokens_per_s']:.0f} tok/s")
    if "val_retrieval_acc" in rec:
        msg += (f" retrieval@{rec['val_retrieval_len']} {rec['val_retrieval_acc']:.2f} "
                f"(exact {rec['val_retrieval_exact']:.2f})")
    (bar.write(msg) if bar else print(msg, file=sys.stderr))


def save(run: TrainRun) -> None:
    """Checkpoint the run (weights, tokenizer, optimizer, sampler, every rank's RNG, metrics)."""
    # Every rank's RNG state: identical today (no dropout), kept per rank for exactness.
    rngs = [train_state.rng_state()]
    if run.world > 1:
        gathered = [None] * run.world
        dist.all_gather_object(gathered, rngs[0])
        rngs = gathered
    if run.master:
        saved_args = {k: v for k, v in vars(run.a).items() if k not in RUN_ONLY}
        state = {"step": run.step, "optimizer": run.opt.state_dict(),
                 "sampler": run.sampler.state_dict(), "rng": rngs, "metrics": run.metrics,
                 "elapsed": run.elapsed(), "args": saved_args, "world_size": run.world}
        ckpt_io.save_checkpoint(run.out / ckpt_io.CHECKPOINT_NAME, run.model, run.tokenizer, state,
                                training_args={**saved_args, "step": run.step})
    if run.world > 1:
        dist.barrier()


def train(given: argparse.Namespace) -> dict:
    """Run training; returns {"step", "loss", "val_loss", "metrics", "out", "model"} (rank 0's
    view; loss and val_loss of this process's last step and validation, None without one)."""
    run = setup(given)
    a = run.a
    bar = progress_bar(run.master and a.progress, a.steps, "train", initial=run.step)
    n0 = len(run.metrics)
    run_steps(StepLoop(
        name="cedlm train pretrain", step=lambda i: optimisation_step(run),
        stop=min(a.steps, a.stop_at_step) if a.stop_at_step else a.steps, start=run.step,
        metrics=run.log, budget=run.budget, out_of_time=lambda: out_of_time(run), announce=run.master,
        evaluate=lambda rec: validate(run, rec), eval_every=a.eval_every, eval_at_end=True,
        save=lambda: save(run), save_every=a.save_every, report=lambda rec: report(run, rec, bar),
        bar=bar, postfix=lambda rec: dict(loss=f"{rec['loss']:.3f}", lr=f"{rec['lr']:.1e}",
                                          tok_s=f"{rec['tokens_per_s']:.0f}")))
    done = run.metrics[n0:]
    vals = [r["val_loss"] for r in done if "val_loss" in r]
    return {"step": run.step, "loss": done[-1]["loss"] if done else None,
            "val_loss": vals[-1] if vals else None, "metrics": run.metrics, "out": str(run.out),
            "model": run.model}


def run(args: argparse.Namespace) -> int:
    try:                                  # before anything loads: one line, no traceback
        train_device(args.device, int(os.environ.get("WORLD_SIZE", "1")),
                     int(os.environ.get("LOCAL_RANK", "0")))
    except ValueError as e:
        print(f"cedlm train pretrain: error: {e}", file=sys.stderr)
        return 2
    try:
        train(args)
    except SettingsError as e:
        print(f"cedlm train pretrain: error: {e}", file=sys.stderr)
        return 2
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
