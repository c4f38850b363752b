"""`cedlm train chat`: a short supervised chat stage on top of a trained model.

    cedlm train chat --init cedlm/assets/model --out runs/chat --steps 110 --threads 2
    cedlm eval ppl --text data/corpus/val.txt --model runs/chat --json > runs/chat/val_ppl.json
    cedlm train chat --out runs/chat --record-ppl runs/chat/val_ppl.json --export runs/chat/export

The model learns the DeepSeek-V4.1 chat encoding and to end its turn: conversations built from the
corpus (`cedlm.train.chat_data`: which source a quote is from, which book of the Bible, the next
sentence of a passage, what a standard-library function does, greetings; some multi-turn, some
with a system prompt, some in thinking mode), rendered by the same encoder the server uses. The
loss covers the assistant tokens only, each turn's closing EOS included (the engine's stop token).
A fraction of the rows (`--text-fraction`) are plain corpus windows with the pretraining loss on
every token, so the model keeps most of its language modelling (docs/training.md, "Chat stage":
the trade-off between the text fraction, the end-of-turn rate and validation perplexity).

Batches are right-padded to their longest row (causal attention: padding after a row cannot
change it) and the loss ignores padding. The schedule is linear warmup then cosine decay, as in
pretraining; the MoE gate biases keep their aux-loss-free balancing updates. The run directory gets
`checkpoint/` (weights, tokenizer, `training_args.json` = the base model's plus this stage's under
`chat_stage`), `metrics.jsonl`, `loss.png`, `summary.json` (the base model's summary plus `chat_*`
keys: held-out chat metrics of `cedlm.train.chat_eval`, before and after; the pretrained model's
validation perplexity as `chat_base_val_perplexity`) and, with `--export`, an exported model
directory (`cedlm.train.export.export_model`). This model's own perplexity comes from `cedlm eval
ppl` (an app of its own layer) and is recorded with `--record-ppl`. A stage run is not resumable:
it is short; re-run it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from cedlm.train import chat_data as D
from cedlm.train.runner import DEVICE_HELP
from cedlm.util import describe_device

DEFAULT_INIT = "cedlm/assets/model"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The stage's flags (`cedlm train chat`)."""
    a = p.add_argument
    a("--init", default=DEFAULT_INIT, metavar="MODEL_DIR",
      help=f"the model to start from (model dir or run dir; default {DEFAULT_INIT})")
    a("--out", required=True, metavar="RUN_DIR", help="run directory")
    a("--data", default="data/corpus", help="prepared corpus (default data/corpus)")
    a("--steps", type=int, default=60, help="optimizer steps (default 60)")
    a("--batch-size", type=int, default=16, help="rows per step (default 16)")
    a("--max-len", type=int, default=D.MAX_LEN, help=f"longest conversation / text row in tokens (default {D.MAX_LEN})")
    a("--lr", type=float, default=4e-4, help="peak learning rate (default 4e-4)")
    a("--min-lr", type=float, default=4e-5, help="final learning rate (default 4e-5)")
    a("--warmup", type=int, default=5, help="warmup steps (default 5)")
    a("--weight-decay", type=float, default=0.1, help="AdamW weight decay on matrices (default 0.1)")
    a("--grad-clip", type=float, default=1.0, help="max global grad norm; 0 disables (default 1.0)")
    a("--text-fraction", type=float, default=0.25,
      help="fraction of rows that are plain corpus text (default 0.25)")
    a("--examples", type=int, default=4000, help="training conversations to build (default 4000)")
    a("--heldout", type=int, default=D.HELDOUT, help=f"held-out conversations from the val split (default {D.HELDOUT})")
    a("--eval-max-tokens", type=int, default=D.EVAL_MAX_TOKENS,
      help=f"reply budget of the held-out generation (default {D.EVAL_MAX_TOKENS})")
    a("--no-eval-before", action="store_true", help="skip the held-out chat metrics of the initial model")
    a("--seed", type=int, default=D.SEED, help=f"seed of the data and order (default {D.SEED})")
    a("--bias-update-rate", type=float, default=1e-3, help="MoE balancing bias step (default 1e-3)")
    a("--threads", type=int, default=1, help="torch threads (default 1)")
    a("--device", default=None, help=DEVICE_HELP)
    a("--max-minutes", type=float, default=None, help="stop early (and save) after this wall time")
    a("--export", default=None, metavar="MODEL_DIR", help="also export the result here (BF16 model dir)")
    a("--no-progress", action="store_true", help="no per-step lines")
    a("--record-ppl", default=None, metavar="PPL_JSON",
      help="no training: record the output of `cedlm eval ppl --model RUN_DIR --json` as this run's "
           "val_perplexity in RUN_DIR/summary.json (then --export, if given)")


def check_args(a: argparse.Namespace) -> None:
    """Bad values raise ValueError naming the flag."""
    for flag in ("steps", "batch_size", "max_len", "examples", "threads", "eval_max_tokens"):
        if getattr(a, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}: must be >= 1, got {getattr(a, flag)}")
    if a.heldout < 0:
        raise ValueError(f"--heldout: must be >= 0, got {a.heldout}")
    if a.warmup < 0:
        raise ValueError(f"--warmup: must be >= 0, got {a.warmup}")
    if not 0.0 <= a.text_fraction < 1.0:
        raise ValueError(f"--text-fraction: must be in [0, 1), got {a.text_fraction}")
    for flag in ("lr", "min_lr"):
        if not getattr(a, flag) > 0 or not math.isfinite(getattr(a, flag)):
            raise ValueError(f"--{flag.replace('_', '-')}: must be a positive number, got {getattr(a, flag)}")
    if a.max_len < 32:
        raise ValueError(f"--max-len: must be >= 32 tokens, got {a.max_len}")
    if a.max_minutes is not None and not a.max_minutes > 0:
        raise ValueError(f"--max-minutes: must be > 0, got {a.max_minutes}")
    from cedlm.train.runner import stage_device
    stage_device(a.device)          # a device this torch cannot use, before any file is read
    if not Path(a.data, "train.txt").exists():
        raise ValueError(f"--data: no train.txt in {a.data} (run `cedlm data prepare`)")


def run(args: argparse.Namespace) -> int:
    try:
        if args.record_ppl:
            record_ppl(args)
            return 0
        check_args(args)
        train_chat(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def masked_loss(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy over the masked targets, per-row sums [B, 2] of loss and count)."""
    logits = model(ids[:, :-1])
    tgt, m = ids[:, 1:], mask[:, 1:].to(logits.dtype)
    ce = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="none").view_as(m)
    rows = torch.stack([(ce * m).sum(1), m.sum(1)], 1)
    return (ce * m).sum() / m.sum().clamp_min(1), rows.detach()


def base_metadata(init: Path) -> tuple[dict, dict]:
    """(summary.json, training_args.json) of the initial model, each {} when absent."""
    from cedlm.checkpoint import resolve_checkpoint
    ckpt = resolve_checkpoint(init)
    out = []
    for name in ("summary.json", "training_args.json"):
        f = next((d / name for d in (ckpt, ckpt.parent) if (d / name).exists()), None)
        out.append(json.loads(f.read_text("utf-8")) if f else {})
    return out[0], out[1]


def record_ppl(a: argparse.Namespace) -> dict:
    """Store a `cedlm eval ppl --json` result of RUN_DIR's checkpoint in RUN_DIR/summary.json (the
    numbers the model card shows for this model); export with --export."""
    from cedlm.checkpoint import resolve_checkpoint
    out = Path(a.out)
    if not (out / "summary.json").exists():
        raise ValueError(f"--out: {out} has no summary.json (run `cedlm train chat --out {out}` first)")
    try:
        got = json.loads(Path(a.record_ppl).read_text("utf-8"))
        ppl, bpb = float(got["perplexity"]), float(got["bits_per_byte"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--record-ppl: {a.record_ppl} is not the JSON of `cedlm eval ppl --json` ({e})") from None
    ckpt = resolve_checkpoint(out).resolve()
    if Path(str(got.get("model", ""))).resolve() != ckpt:
        raise ValueError(f"--record-ppl: {a.record_ppl} scored {got.get('model')!r}, not {ckpt}")
    summary = json.loads((out / "summary.json").read_text("utf-8"))
    summary.update(val_perplexity=ppl, val_bits_per_byte=bpb)
    for k in ("tokens", "bytes"):
        if k in got:
            summary[f"val_{k}"] = got[k]
    cmd = f"cedlm eval ppl --text {Path(a.data, 'val.txt').as_posix()} --model {a.out} --json"
    summary["commands"] = [c for c in summary.get("commands", []) if c != cmd] + [cmd]
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if a.export:
        from cedlm.train.export import export_model
        export_model(ckpt, a.export, summary=summary)
    return summary


class ChatStage:
    """The stage's parts for the runner: setup (model, conversations, held-out set, the metrics
    of the initial model), `step` (one optimizer step on a batch of rows) and `finish` (held-out
    metrics after, checkpoint, summary.json, export)."""

    def __init__(self, a: argparse.Namespace):
        from cedlm.checkpoint import load_model
        from cedlm.train.chat_data import ChatBatches, build_examples, corpus_documents, heldout_examples
        from cedlm.train.optim import param_groups
        from cedlm.train.runner import MetricsLog, TimeBudget, set_threads, stage_device
        set_threads(a.threads)
        self.device = stage_device(a.device)          # before loading: a ValueError naming device
        self.a, self.out = a, Path(a.out)
        self.model, self.tok = model, tok = load_model(a.init, device=self.device)
        self.base_summary, self.base_args = base_metadata(Path(a.init))
        train_docs = corpus_documents(a.data, "train")
        val_docs = corpus_documents(a.data, "val")
        t0 = time.time()
        self.examples = build_examples(train_docs, tok, a.examples, a.seed, a.max_len)
        self.heldout = heldout_examples(val_docs, tok, a.heldout, a.seed, a.max_len)
        self.batches = ChatBatches(self.examples, train_docs, tok, a.batch_size, a.max_len, a.text_fraction,
                                   a.seed)
        self.log(f"cedlm train chat: {model.num_parameters() / 1e6:.2f}M params from {a.init}; "
                 f"{len(self.examples)} conversations ({time.time() - t0:.1f} s), {len(self.heldout)} held "
                 f"out; {a.steps} steps x {a.batch_size} rows, text fraction {a.text_fraction}, "
                 f"{a.threads} thread(s), device {describe_device(self.device)}")
        self.summary = self.start_summary()
        self.out.mkdir(parents=True, exist_ok=True)
        model.train()
        self.opt = torch.optim.AdamW(param_groups(model, a.weight_decay), lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
        self.metrics = MetricsLog(self.out / "metrics.jsonl")
        self.budget = TimeBudget(a.max_minutes)
        self.tokens = {"chat": 0, "text": 0}

    def log(self, msg: str) -> None:
        if not self.a.no_progress:
            print(msg, file=sys.stderr, flush=True)

    def start_summary(self) -> dict:
        """The base model's summary with its perplexity renamed `chat_base_*` (this model's comes
        from `cedlm eval ppl` after), plus the held-out chat metrics before the stage."""
        from cedlm.train.chat_eval import chat_metrics
        a, base = self.a, self.base_summary
        summary = {k: v for k, v in base.items() if not k.startswith(("chat", "sft"))}
        for k in ("val_perplexity", "val_bits_per_byte"):
            if k in base:
                summary[f"chat_base_{k}"] = summary.pop(k)
        summary["chat_eval_max_tokens"] = a.eval_max_tokens
        if self.heldout and not a.no_eval_before:
            before = chat_metrics(self.model, self.tok, self.heldout, a.eval_max_tokens, seed=a.seed)
            summary.update({f"chat_before_{k}": v for k, v in before.items()})
            self.log(f"held-out before: {json.dumps(before)}")
        return summary

    def step(self, i: int) -> dict:
        from cedlm.train.optim import clip_and_step, cosine_lr, set_lr, update_moe_bias
        a, t1 = self.a, time.time()
        lr = cosine_lr(i, peak=a.lr, min_lr=a.min_lr, warmup=a.warmup, total=a.steps)
        set_lr(self.opt, lr)
        ids, mask, is_text = (t.to(self.device, non_blocking=True) for t in self.batches.next_batch())
        loss, rows = masked_loss(self.model, ids, mask)
        loss.backward()
        gn = clip_and_step(self.opt, self.model.parameters(), a.grad_clip)
        update_moe_bias(self.model, a.bias_update_rate)
        c, t = rows[~is_text].sum(0), rows[is_text].sum(0)
        self.tokens["chat"] += int(c[1])
        self.tokens["text"] += int(t[1])
        return {"step": i + 1, "loss": loss.item(), "chat_loss": (c[0] / c[1]).item() if c[1] else None,
                "text_loss": (t[0] / t[1]).item() if t[1] else None, "lr": lr, "grad_norm": gn,
                "rows": list(ids.shape), "step_s": time.time() - t1, "elapsed": self.budget.elapsed()}

    def report(self, rec: dict) -> None:
        self.log(f"step {rec['step']}/{self.a.steps}: loss {rec['loss']:.3f} "
                 f"chat {rec['chat_loss'] or float('nan'):.3f} text {rec['text_loss'] or float('nan'):.3f} "
                 f"lr {rec['lr']:.2e} {rec['step_s']:.1f} s")

    def finish(self, steps: int) -> dict:
        from cedlm.train.chat_eval import chat_metrics
        from cedlm.train.runner import plot_loss, save_model, write_json
        a, out, summary = self.a, self.out, self.summary
        self.model.eval()
        wall = self.budget.elapsed()
        recs = self.metrics.records
        plot_loss([{**r, "loss": r["chat_loss"] if r["chat_loss"] is not None else r["loss"]} for r in recs],
                  out / "loss.png")
        chat_tok, text_tok = self.tokens["chat"], self.tokens["text"]
        summary.update(chat_steps=steps, chat_rows_per_step=a.batch_size, chat_max_len=a.max_len,
                       chat_text_fraction_rows=a.text_fraction,
                       chat_text_fraction_tokens=round(text_tok / max(1, chat_tok + text_tok), 4),
                       chat_assistant_tokens=chat_tok, chat_text_tokens=text_tok,
                       chat_train_conversations=len(self.examples), chat_train_wall_s=round(wall),
                       chat_threads=a.threads, chat_final_loss=recs[-1]["chat_loss"] if recs else None)
        if self.heldout:
            after = chat_metrics(self.model, self.tok, self.heldout, a.eval_max_tokens, seed=a.seed)
            summary.update({f"chat_after_{k}": v for k, v in after.items()})
            self.log(f"held-out after: {json.dumps(after)}")
        cmd = (f"cedlm train chat --init {a.init} --out {a.out} --steps {a.steps} --batch-size {a.batch_size} "
               f"--max-len {a.max_len} --lr {a.lr:g} --min-lr {a.min_lr:g} --warmup {a.warmup} "
               f"--text-fraction {a.text_fraction} --examples {a.examples} --seed {a.seed} --threads {a.threads}")
        summary["commands"] = list(self.base_summary.get("commands", [])) + [cmd]
        stage = dict(vars(a), step=steps, command="train chat")
        save_model(out, self.model, self.tok, training_args={**self.base_args, "chat_stage": stage})
        write_json(out / "summary.json", summary)
        if a.export:
            from cedlm.train.export import export_model
            export_model(out / "checkpoint", a.export, summary=summary)
            self.log(f"exported to {a.export}")
        return summary


def train_chat(a: argparse.Namespace) -> dict:
    """Run the stage; returns the summary dict (also written to RUN_DIR/summary.json)."""
    from cedlm.train.runner import StepLoop, run_steps
    st = ChatStage(a)
    steps, _ = run_steps(StepLoop(name="cedlm train chat", step=st.step, stop=a.steps, metrics=st.metrics,
                                  budget=st.budget, report=st.report, announce=not a.no_progress))
    return st.finish(steps)
