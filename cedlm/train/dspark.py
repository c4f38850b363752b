"""`cedlm train dspark`: train the DSpark drafter (`mtp.*`) of a model, the target frozen.

    cedlm train dspark --init cedlm/assets/model --out runs/dspark --export runs/dspark/export \\
        --max-minutes 25 --threads 1

The drafter is distilled on the target's own outputs over the corpus: each step draws corpus
windows, runs the frozen target over them once (its next-token distributions and the DSpark taps
of every position), then drafts `--anchors` blocks per window at random anchors in one parallel
`dspark.full_forward` (context rows from the taps before the anchor, the block non-causal). Row i
of a block is trained toward the target's distribution at anchor + i (soft cross-entropy), with
the Markov head fed the token at anchor + i (the anchor, then the previous tokens: teacher
forcing). The confidence head is trained (binary cross-entropy) to predict whether the row's
argmax equals the target's: the acceptance of that draft given the ones before it.

Besides corpus windows, `--self-gen-frac` of each batch are the target's own greedy continuations of
corpus prompts (`--self-gen-seqs`, generated first, as the engine decodes): the text the drafter
meets when it drafts for greedy decoding.

Initialisation (a model without `mtp.*`): every draft layer starts as a copy of the target's last
layer (same shapes; experts cut to `dspark_n_routed_experts`), `norm` as the target's final norm,
`main_proj` as the mean of the taps, the Markov bias and the confidence logit at 0. A model that
already has a drafter continues from it.

The run directory gets `checkpoint/` (the target and its drafter), `metrics.jsonl`, `loss.png`,
`summary.json`; `--export DIR` writes a model directory: the --init directory's files unchanged
(the target is byte for byte the one it was trained against) plus `mtp.safetensors` (bf16).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from cedlm.train.runner import DEVICE_HELP
from cedlm.util import atomic_directory, describe_device

DEFAULT_INIT = "cedlm/assets/model"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The stage's flags (`cedlm train dspark`)."""
    a = p.add_argument
    a("--init", default=DEFAULT_INIT, metavar="MODEL_DIR", help=f"the target model (default {DEFAULT_INIT})")
    a("--out", required=True, metavar="RUN_DIR", help="run directory")
    a("--export", default=None, metavar="DIR", help="also write a model directory with mtp.safetensors")
    a("--data", default="data/corpus", help="prepared corpus (default data/corpus)")
    a("--cache-dir", default="data/cache", help="token cache dir (default data/cache)")
    a("--steps", type=int, default=400, help="optimizer steps (default 400)")
    a("--batch-size", type=int, default=8, help="corpus windows per step (default 8)")
    a("--seq-len", type=int, default=192, help="window length in tokens (default 192)")
    a("--anchors", type=int, default=24, help="blocks drafted per window per update (default 24)")
    a("--updates-per-batch", type=int, default=4,
      help="optimizer steps per target pass, each at fresh anchors (default 4; the frozen target's "
           "pass costs several drafter steps)")
    a("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    a("--min-lr", type=float, default=1e-4, help="final learning rate (default 1e-4)")
    a("--warmup", type=int, default=20, help="warmup steps (default 20)")
    a("--conf-weight", type=float, default=0.2, help="weight of the confidence loss (default 0.2)")
    a("--self-gen-seqs", type=int, default=128,
      help="target greedy continuations generated first, trained on beside the corpus (default 128)")
    a("--self-gen-prompt", type=int, default=64, help="corpus prompt tokens of each (default 64)")
    a("--self-gen-frac", type=float, default=0.75,
      help="fraction of each batch from the generated sequences (default 0.75)")
    a("--seed", type=int, default=0, help="seed (default 0)")
    a("--threads", type=int, default=1, help="torch threads (default 1)")
    a("--device", default=None, help=DEVICE_HELP)
    a("--max-minutes", type=float, default=None, help="stop early (and save) after this wall time")
    a("--log-every", type=int, default=10, help="steps between log lines (default 10)")


# ---------------------------------------------------------------- model setup
def init_from_target(model) -> None:
    """Start every draft layer from the target's last layer (see the module docstring)."""
    from cedlm.model.dspark import build_mtp
    cfg = model.cfg
    model.mtp = build_mtp(cfg).to(model.device)      # drawn on the host, then beside the target
    last = model.layers[cfg.n_layers - 1].state_dict()
    for st in model.mtp:
        own = st.state_dict()
        take = {k: v for k, v in last.items() if k in own and own[k].shape == v.shape}
        st.load_state_dict(take, strict=False)
    last_st, D = model.mtp[-1], cfg.hidden_size
    last_st.norm.weight.data.copy_(model.norm.weight.data)
    n = len(cfg.dspark_target_layer_ids)
    model.mtp[0].main_proj.weight.data.copy_(torch.eye(D, device=model.device).repeat(1, n) / n)
    torch.nn.init.zeros_(last_st.markov_head.head.weight)
    torch.nn.init.zeros_(last_st.confidence_head.proj.weight)


@torch.no_grad()
def target_pass(model, ids: torch.Tensor):
    """The frozen target over ids [B, S]: (logits [B, S, V], taps [B, S, n_taps*D])."""
    from cedlm.model.rollback import capture
    with capture(model, taps=True) as cap:
        logits = model(ids)
    return logits, cap.taps


def draft_loss(model, ids, logits, taps, anchors, conf_weight: float):
    """Soft cross-entropy of every drafted row to the target's distribution, plus the confidence
    BCE. Returns (loss, stats dict)."""
    from cedlm.model import dspark
    N = model.cfg.dspark_block_size
    h = dspark.full_forward(model, ids, taps, anchors)                       # [B, K, N, D]
    at = anchors.unsqueeze(-1) + torch.arange(N, device=anchors.device)     # positions of the rows
    B, K = anchors.shape
    flat = at.flatten(1)
    prev = ids.gather(1, flat).view(B, K, N)                                 # Markov: token at the row
    tgt = logits.gather(1, flat.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).view(B, K, N, -1)
    bias, conf = dspark.markov_terms(model, h, prev)
    dl = dspark.base_logits(model, h) + bias
    p = tgt.float().softmax(-1)
    ce = -(p * dl.log_softmax(-1)).sum(-1).mean()
    ent = -(p * p.clamp_min(1e-12).log()).sum(-1).mean()
    hit = (dl.argmax(-1) == tgt.argmax(-1)).float()
    bce = F.binary_cross_entropy_with_logits(conf, hit)
    run_len = hit.cumprod(-1).sum(-1).mean()                                  # leading agreements
    stats = {"kl": (ce - ent).item(), "ce": ce.item(), "conf_bce": bce.item(),
             "agree_by_pos": hit.mean((0, 1)).tolist(), "accepted_run": run_len.item(),
             "conf_mean": torch.sigmoid(conf).mean().item()}
    return ce + conf_weight * bce, stats


@torch.no_grad()
def self_generate(model, tokens, n_seqs: int, prompt_len: int, total_len: int, seed: int,
                  batch: int = 32):
    """n_seqs sequences of total_len tokens: a corpus prompt, then the target's own greedy
    continuation (batched byte-cache decoding, as the engine runs it)."""
    import numpy as np
    rng = np.random.Generator(np.random.PCG64(seed + 1))
    out = []
    for c in range(0, n_seqs, batch):
        B = min(batch, n_seqs - c)
        starts = rng.integers(0, len(tokens) - prompt_len - 1, size=B)
        seqs = [list(map(int, tokens[s: s + prompt_len])) for s in starts]
        states = [model.new_state() for _ in range(B)]
        nxt = [int(model.prefill(q, st, "bounded")[-1].argmax()) for q, st in zip(seqs, states)]
        for _ in range(total_len - prompt_len):
            for q, t in zip(seqs, nxt):
                q.append(t)
            if len(seqs[0]) == total_len:
                break
            nxt = model.decode(nxt, states).argmax(-1).tolist()
        out += seqs
    return torch.tensor(out, dtype=torch.int64, device="cpu")              # host ids, as the corpus


def export_drafter(init_dir: Path, model, dst: Path) -> Path:
    """A model directory: the --init directory's files (the target unchanged) + mtp.safetensors."""
    from safetensors.torch import save_file
    dst = Path(dst)
    with atomic_directory(dst) as tmp:
        shutil.copytree(init_dir, tmp, ignore=shutil.ignore_patterns("mtp.safetensors"), dirs_exist_ok=True)
        mtp = {f"mtp.{k}": (v.to(torch.bfloat16) if v.is_floating_point() and k.endswith("weight") else v)
               .detach().cpu().contiguous() for k, v in model.mtp.state_dict().items()}
        save_file(mtp, str(tmp / "mtp.safetensors"), metadata={"format": "pt"})
    return dst


# ---------------------------------------------------------------- run
class DsparkStage:
    """The stage's parts for the runner: setup (the target with a drafter, corpus windows, the
    target's own continuations), `step` (one drafter update; a fresh target pass every
    --updates-per-batch steps) and `finish` (checkpoint, summary.json, export)."""

    def __init__(self, args: argparse.Namespace):
        from cedlm.checkpoint import load_model, resolve_checkpoint
        from cedlm.data.tokens import token_cache
        from cedlm.model.dspark import check_dspark_config
        from cedlm.train.data import BatchSampler
        from cedlm.train.runner import MetricsLog, TimeBudget, set_threads, stage_device
        for n in ("steps", "batch_size", "seq_len", "anchors", "threads", "updates_per_batch"):
            if getattr(args, n) <= 0:
                raise ValueError(f"--{n.replace('_', '-')}: must be positive, got {getattr(args, n)}")
        set_threads(args.threads)
        self.device = stage_device(args.device)       # before loading: a ValueError naming device
        torch.manual_seed(args.seed)
        self.args, self.init = args, resolve_checkpoint(args.init)
        self.model, self.tok = model, tok = load_model(self.init, device=self.device)
        print(f"cedlm train dspark: device {describe_device(self.device)}", flush=True)
        check_dspark_config(model.cfg)
        self.N = N = model.cfg.dspark_block_size
        if args.seq_len < N + 1:
            raise ValueError(f"--seq-len: {args.seq_len} is shorter than a block ({N}) + 1")
        if not hasattr(model, "mtp"):
            init_from_target(model)
        for n, prm in model.named_parameters():
            prm.requires_grad_(n.startswith("mtp."))
        model.eval()
        model.mtp.train()
        data = Path(args.data)
        if not (data / "train.txt").exists():
            raise ValueError(f"--data: no train.txt in {data} (run `cedlm data prepare`)")
        tokens = token_cache(data / "train.txt", tok, Path(args.cache_dir))
        self.sampler = BatchSampler(tokens, args.seq_len, args.batch_size, args.seed)
        self.budget = TimeBudget(args.max_minutes).begin()     # the generation counts towards it
        self.n_gen = round(args.batch_size * args.self_gen_frac) if args.self_gen_seqs > 0 else 0
        self.gen = None
        if self.n_gen:
            if not 0 < args.self_gen_prompt < args.seq_len:
                raise ValueError(f"--self-gen-prompt: must be in (0, --seq-len={args.seq_len})")
            print(f"generating {args.self_gen_seqs} target continuations ...", flush=True)
            self.gen = self_generate(model, tokens, args.self_gen_seqs, args.self_gen_prompt, args.seq_len,
                                     args.seed)
            print(f"  {self.gen.numel()} tokens in {self.budget.elapsed():.0f}s", flush=True)
        self.params = [p for p in model.mtp.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsLog(self.out / "metrics.jsonl")
        self.g = torch.Generator().manual_seed(args.seed)
        self.train_time = self.budget.rest(floor=1.0)       # the schedule ends with the time limit too
        self.batch: dict = {}

    def step(self, i: int) -> dict:
        from cedlm.train.optim import clip_and_step, cosine_lr, set_lr
        args, w, g = self.args, self.args.warmup, self.g
        # the cosine starts one step after the warm-up's peak (i + 1 past it), as it always has here
        lr = cosine_lr(i + 1 if i >= w else i, peak=args.lr, min_lr=args.min_lr, warmup=w, total=args.steps,
                       time_frac=self.train_time.frac())
        set_lr(self.opt, lr)
        if i % args.updates_per_batch == 0:
            ids, _ = self.sampler.next_batch()
            if self.gen is not None:          # part of the batch: the target's own continuations
                pick = torch.randint(0, self.gen.shape[0], (self.n_gen,), generator=g, device="cpu")
                ids = torch.cat((ids[: ids.shape[0] - self.n_gen], self.gen[pick]))
            ids = ids.to(self.device, non_blocking=True)     # host batches, device passes
            self.batch.update(ids=ids, target=target_pass(self.model, ids))
        ids = self.batch["ids"]
        span = args.seq_len - self.N + 1                 # drawn on the host (the CPU generator g)
        anchors = torch.stack([torch.randperm(span, generator=g, device="cpu")[:args.anchors].sort().values
                               for _ in range(ids.shape[0])]).to(self.device, non_blocking=True)
        loss, st = draft_loss(self.model, ids, *self.batch["target"], anchors, args.conf_weight)
        loss.backward()
        gn = clip_and_step(self.opt, self.params, 1.0)
        return {"step": i + 1, "loss": loss.item(), "lr": lr, "grad_norm": gn,
                "elapsed_s": round(self.budget.elapsed(), 1), **st}

    def report(self, rec: dict) -> None:
        if rec["step"] % self.args.log_every == 0 or rec["step"] == 1:
            print(f"step {rec['step']} loss {rec['loss']:.4f} kl {rec['kl']:.4f} run {rec['accepted_run']:.2f} "
                  f"agree {[round(x, 2) for x in rec['agree_by_pos']]} {rec['elapsed_s']}s", flush=True)

    def finish(self, steps: int) -> dict:
        from cedlm.train.runner import plot_loss, save_model, write_json
        args, out = self.args, self.out
        self.model.eval()
        save_model(out, self.model, self.tok,
                   training_args={"dspark_stage": {"init": str(self.init), "steps_run": steps, **vars(args)}})
        plot_loss(self.metrics.records, out / "loss.png")
        last = self.metrics.records[-20:]
        summary = {"dspark_steps": steps, "dspark_minutes": round(self.budget.elapsed() / 60, 2),
                   "dspark_final_loss": sum(m["loss"] for m in last) / len(last),
                   "dspark_final_kl": sum(m["kl"] for m in last) / len(last),
                   "dspark_accepted_run": sum(m["accepted_run"] for m in last) / len(last)}
        write_json(out / "summary.json", summary)
        if args.export:
            d = export_drafter(self.init, self.model, Path(args.export))
            print(f"exported {d} (mtp.safetensors {(d / 'mtp.safetensors').stat().st_size} B)")
        print(json.dumps(summary))
        return summary


def run(args: argparse.Namespace) -> int:
    from cedlm.train.runner import StepLoop, run_steps
    try:
        st = DsparkStage(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    steps, _ = run_steps(StepLoop(name="cedlm train dspark", step=st.step, stop=args.steps, metrics=st.metrics,
                                  budget=st.budget, report=st.report))
    st.finish(steps)
    return 0
