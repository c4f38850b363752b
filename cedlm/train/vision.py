"""`cedlm train vision`: a small ViT + aligner trained on top of a frozen text model.

    cedlm train vision --init cedlm/assets/model --out runs/vision [--minutes 25] [--threads 1]

The text model is extended with a scaled-down V4.1 vision tower (same structure: patch 14,
2-D RoPE, SwiGLU blocks, 3x3-unfold aligner, learned image_start / image_newline / image_end;
width/depth from the flags) and only `vision.*`, `aligner.*` and `image_*` are trained; the
text weights (and the `ffn.gate.bias_vl` buffers, left as loaded) do not change. Each example is
a chat turn rendered with the V4.1 chat encoder, `[image] question` -> `answer<EOS>`, with the image
placeholder expanded to its span (`cedlm.text.images.expand_image_tokens`); the loss is the
cross-entropy of the answer tokens. Tasks (`cedlm.data.vision_tasks`): scikit-learn's digits
(held-out 20%) and words rendered with Pillow.

The run directory gets `checkpoint/` (the full model, `cedlm.checkpoint.save_checkpoint`),
`metrics.jsonl`, `loss.png`, `eval.json` (held-out accuracies, measured by greedy decoding through
the training forward, and a few through the engine) and `export/` (`cedlm.train.export`: the text
weights unchanged in `model.safetensors`, the tower in `vision.safetensors`).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from cedlm.train.export import PARTS
from cedlm.train.runner import DEVICE_HELP
from cedlm.util import describe_device

TOWER = PARTS["vision"]        # the tower's name prefixes: vision.*, aligner.*, image_*


def vision_defaults():
    from cedlm.config.vision import VisionConfig
    return VisionConfig(num_hidden_layers=4, hidden_size=96, num_attention_heads=4,
                        intermediate_size=256, patch_size=14, rope_theta=10000.0, downsample_ratio=3,
                        max_image_tokens=64, min_pixels=126 * 126, max_wh_ratio=None)


def extend_with_vision(model, tokenizer, vc, seed: int = 0):
    """A copy of the text model with a fresh vision tower (text weights copied, strict). A model
    that already has a tower of the same config is returned as it is, so a run can continue one."""
    from cedlm.config.vision import vision_config_of, vision_enabled, with_vision
    from cedlm.model import CEDModel
    from cedlm.text.special_tokens import IMAGE_TOKEN
    if vision_enabled(model.cfg) and vision_config_of(model.cfg) == vc:
        torch.manual_seed(seed)
        return model
    image_id = tokenizer.special_ids[IMAGE_TOKEN]
    cfg = with_vision(model.cfg, vc, image_id)
    torch.manual_seed(seed)
    vlm = CEDModel(cfg)
    text_sd = {k: v for k, v in model.state_dict().items()          # a tower of another config
               if not k.startswith(TOWER)}                             # is replaced, not loaded
    missing, unexpected = vlm.load_state_dict(text_sd, strict=False)
    bad = [k for k in missing if not k.startswith(TOWER)]
    if bad or unexpected:
        raise ValueError(f"vision: text weights do not match ({bad[:3]} missing, {unexpected[:3]} unexpected)")
    vlm.engram_token_map.copy_(model.engram_token_map)
    with torch.no_grad():                 # image rows start at the scale of token embeddings
        vlm.aligner.w2.weight.mul_(0.1)
        vlm.aligner.w2.bias.zero_()
    return vlm


def freeze_text(model) -> list:
    """Only the tower trains: `vision.*`, `aligner.*`, `image_*`; returns those parameters."""
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith(TOWER))
    return [p for p in model.parameters() if p.requires_grad]


class Examples:
    """Tokenised examples: (ids, image start, span length, answer start, prepared image)."""

    def __init__(self, model, tokenizer, items, question: str, question_first: bool = True):
        from cedlm.config.vision import vision_config_of
        from cedlm.text.chat import encode_chat_ids
        from cedlm.text.images import expand_image_tokens, preprocess
        vc = vision_config_of(model.cfg)
        parts = [{"type": "image"}, {"type": "text", "text": question}]
        msgs = [{"role": "user", "content": parts[::-1] if question_first else parts}]
        prompt = encode_chat_ids(msgs, tokenizer)
        self.rows = []
        for im, ans in items:
            img = preprocess(im, vc)
            ids, spans = expand_image_tokens(prompt, [img], model.image_token_id)
            tgt = tokenizer.encode_plain(str(ans)) + [tokenizer.eos_id]
            self.rows.append((ids + tgt, spans[0][0], len(ids), img, str(ans)))

    def batch(self, idx: list[int], device=None):
        """(ids [B, S], target mask [B, S], rows) of the examples `idx`, built on the host and
        moved to `device` (None: left on the host)."""
        rows = [self.rows[i] for i in idx]
        S = max(len(r[0]) for r in rows)
        ids = torch.full((len(rows), S), 2, dtype=torch.int64, device="cpu")
        tgt_mask = torch.zeros(len(rows), S, dtype=torch.bool, device="cpu")
        for b, (t, _, a, _, _) in enumerate(rows):
            ids[b, : len(t)] = torch.tensor(t, device="cpu")
            tgt_mask[b, a: len(t)] = True
        if device is not None:
            ids, tgt_mask = ids.to(device, non_blocking=True), tgt_mask.to(device, non_blocking=True)
        return ids, tgt_mask, rows


def _embed_images(model, rows):
    """Span embeddings of the images of `rows`, batched by grid; per row [(start, emb)]."""
    from cedlm.model.vision import encode_image
    out = [None] * len(rows)
    groups: dict = {}
    for b, r in enumerate(rows):
        groups.setdefault((r[3].vit_grid, r[3].llm_grid), []).append(b)
    for (vg, lg), bs in groups.items():
        patches = torch.stack([rows[b][3].patches for b in bs]).to(model.device, non_blocking=True)
        emb = encode_image(model, patches, vg, lg)
        for k, b in enumerate(bs):
            out[b] = [(rows[b][1], emb[k])]
    return out


def loss_of(model, ex: Examples, idx: list[int]) -> torch.Tensor:
    ids, mask, rows = ex.batch(idx, model.device)
    logits = model(ids, images=_embed_images(model, rows))
    m = mask[:, 1:]
    return F.cross_entropy(logits[:, :-1][m], ids[:, 1:][m])


@torch.no_grad()
def accuracy(model, tokenizer, ex: Examples, limit: int | None = None, batch: int = 32,
             max_new: int = 6) -> float:
    """Exact-match accuracy of greedy answers (training forward, answers decoded to EOS)."""
    rows = ex.rows[:limit] if limit else ex.rows
    ok = 0
    for i in range(0, len(rows), batch):
        chunk = rows[i: i + batch]
        imgs = _embed_images(model, chunk)
        seqs = [list(r[0][: r[2]]) for r in chunk]
        done = [False] * len(chunk)
        for _ in range(max_new):
            S = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), S), 2, dtype=torch.int64, device="cpu")
            for b, s in enumerate(seqs):
                ids[b, : len(s)] = torch.tensor(s, device="cpu")
            logits = model(ids.to(model.device, non_blocking=True), images=imgs)
            for b, s in enumerate(seqs):
                if not done[b]:
                    t = int(logits[b, len(s) - 1].argmax())
                    s.append(t)
                    done[b] = t == tokenizer.eos_id
            if all(done):
                break
        for b, r in enumerate(chunk):
            out = seqs[b][r[2]:]
            if tokenizer.eos_id in out:
                out = out[: out.index(tokenizer.eos_id)]
            ok += tokenizer.decode(out).strip() == r[4]
    return ok / max(len(rows), 1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The stage's flags (`cedlm train vision`)."""
    a = p.add_argument
    a("--init", required=True, metavar="MODEL_DIR", help="the text model (model dir or run dir)")
    a("--out", required=True, metavar="RUN_DIR", help="run directory (export/ is written inside)")
    a("--minutes", type=float, default=24.0, help="wall-clock budget of the three phases (default 24; "
      "with data preparation and the final evaluation the run takes about 5 minutes more)")
    a("--steps", type=int, default=4000, help="at most this many steps (default 4000)")
    a("--batch", type=int, default=24, help="examples per step (default 24)")
    a("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    a("--threads", type=int, default=1, help="torch threads (default 1)")
    a("--device", default=None, help=DEVICE_HELP)
    a("--seed", type=int, default=0)
    a("--word-examples", type=int, default=3000, help="rendered training words (default 3000)")
    a("--vision-layers", type=int, default=None, help="ViT blocks (default 4)")
    a("--vision-width", type=int, default=None, help="ViT width (default 96)")
    a("--eval-every", type=int, default=100, help="end-to-end steps between held-out checks (default 100)")
    a("--eval-limit", type=int, default=None, help="held-out examples per task in the evaluations "
      "(default: all in the final one, 100 in the checks between steps)")
    a("--anchor-frac", type=float, default=0.45, help="share of the budget for phase A at most (default 0.45)")
    a("--regress-frac", type=float, default=0.2, help="share of the budget for phase B (default 0.2)")
    a("--anchors", default=None, metavar="ANCHORS_PT", help="reuse phase A (anchors.pt of an earlier "
      "run on the same text model and vision config) and skip it")
    a("--e2e-tasks", nargs="+", choices=("digits", "words"), default=["digits", "words"],
      help="the end-to-end phase's task schedule, cycled (default: digits words)")
    a("--codes", action="store_true", help="phase B as class codes in the aligner (digits; "
      "cedlm.train.vision_anchors.train_codes) instead of regression")


class VisionStage:
    """The stage's parts for the runner: setup (the text model extended with a tower, the task
    examples), phases A and B (`phases_ab`, `cedlm.train.vision_anchors`), `step` (one end-to-end
    step of phase C), `heldout` (its evaluation) and `finish` (final accuracies, checkpoint,
    export, eval.json)."""

    def __init__(self, args):
        import dataclasses

        from cedlm.checkpoint import load_model
        from cedlm.data import vision_tasks as T
        from cedlm.train.runner import MetricsLog, TimeBudget, set_threads, stage_device
        set_threads(args.threads)
        self.device = stage_device(args.device)       # before loading: a ValueError naming device
        if args.eval_limit is not None and args.eval_limit < 1:
            raise ValueError(f"--eval-limit: must be >= 1, got {args.eval_limit}")
        self.args, self.out = args, Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        text, self.tok = load_model(args.init)
        vc = vision_defaults()
        if args.vision_layers or args.vision_width:
            vc = dataclasses.replace(vc, num_hidden_layers=args.vision_layers or vc.num_hidden_layers,
                                     hidden_size=args.vision_width or vc.hidden_size)
        self.vc = vc
        # eval() except inside a step: MoE load counters and anything mode-dependent stay as served
        # the tower drawn on the host (the same weights on every device), then all moved
        self.model = model = extend_with_vision(text, self.tok, vc, args.seed).to(self.device).eval()
        del text
        print(f"cedlm train vision: device {describe_device(self.device)}", flush=True)
        self.train_params = freeze_text(model)
        tok = self.tok
        d_train, d_test = T.digits_split(args.seed)
        self.tasks = {
            "digits": (Examples(model, tok, d_train, T.DIGIT_QUESTION),
                       Examples(model, tok, d_test, T.DIGIT_QUESTION)),
            "words": (Examples(model, tok, T.word_examples(args.word_examples, args.seed + 1), T.WORD_QUESTION),
                      Examples(model, tok, T.word_examples(300, args.seed + 1000), T.WORD_QUESTION)),
        }
        self.rng = random.Random(args.seed)
        self.budget = TimeBudget(args.minutes).begin()       # the three phases share it
        self.metrics = MetricsLog(self.out / "metrics.jsonl")
        self.opt = self.phase_c = None

    def heldout(self, rec: dict) -> None:
        """Held-out accuracy (100 examples per task, at most --eval-limit), added to `rec` and printed."""
        limit = min(100, self.args.eval_limit or 100)
        for k, (_, te) in self.tasks.items():
            rec[f"{k}_heldout_acc_100"] = accuracy(self.model, self.tok, te, limit=limit)
        print(json.dumps(rec), flush=True)

    def phases_ab(self) -> tuple[int, int]:
        """Phase A (anchors; or those of --anchors) and phase B (regression or --codes), in their
        shares of the budget; -> their step counts."""
        from cedlm.train.vision_anchors import Anchors, train_anchors, train_codes, train_regression
        args, model, budget, log = self.args, self.model, self.budget, self.metrics.append
        anchors = {k: Anchors(model, tr) for k, (tr, _) in self.tasks.items()}
        if args.anchors:                      # phase A of an earlier run on the same text model
            saved = torch.load(args.anchors, map_location="cpu", weights_only=True)
            shared = saved.pop("_shared", None)
            for k, rows in saved.items():
                if rows.shape != anchors[k].rows.shape:
                    raise ValueError(f"--anchors: {k} rows {tuple(rows.shape)} do not match this run's "
                                     f"{tuple(anchors[k].rows.shape)}")
                anchors[k].rows.data.copy_(rows)
            if shared is not None:
                with torch.no_grad():
                    for name, v in shared.items():
                        getattr(model, name).copy_(v)
            na = 0
        else:
            na = train_anchors(model, anchors, args.anchor_frac * budget.seconds, args.batch, 3e-2, log,
                               self.rng, order=["digits", "digits", "words"])
        torch.save({**{k: a.rows.detach().cpu() for k, a in anchors.items()},      # host tensors
                    "_shared": {n: getattr(model, n).detach().cpu().clone()
                                for n in ("image_start", "image_newline", "image_end")}}, self.out / "anchors.pt")
        self.heldout({"phase": "anchors_done", "steps": na, "elapsed_s": round(budget.elapsed(), 1)})
        if args.regress_frac <= 0:           # continuing a trained tower: straight to phase C
            nr = 0
        elif args.codes:
            nr = train_codes(model, anchors["digits"], args.regress_frac * budget.seconds, 128, 3e-3, log, self.rng)
        else:
            nr = train_regression(model, anchors, args.regress_frac * budget.seconds, 128, args.lr, log, self.rng)
        self.heldout({"phase": "regression_done", "steps": nr, "elapsed_s": round(budget.elapsed(), 1)})
        # phase C: end to end through the frozen text model, in what is left of the budget
        self.opt = torch.optim.AdamW(self.train_params, lr=args.lr, weight_decay=0.01)
        self.phase_c = self.budget.rest()
        return na, nr

    def step(self, i: int) -> dict:
        """One end-to-end step (phase C) on a batch of the task of its turn."""
        from cedlm.train.optim import cosine_lr, set_lr
        args, model = self.args, self.model
        lr = cosine_lr(i, peak=0.5 * args.lr, min_lr=0.05 * args.lr, warmup=10, time_frac=self.phase_c.frac())
        set_lr(self.opt, lr)
        name = args.e2e_tasks[i % len(args.e2e_tasks)]
        ex = self.tasks[name][0]
        model.train()         # the storage rounding passes straight-through gradients
        loss = loss_of(model, ex, [self.rng.randrange(len(ex.rows)) for _ in range(args.batch)])
        model.eval()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.train_params, 1.0)
        self.opt.step()
        return {"phase": "end_to_end", "step": i + 1, "task": name, "loss": round(loss.item(), 5),
                "lr": lr, "elapsed_s": round(self.budget.elapsed(), 1)}

    def finish(self, na: int, nr: int, nc: int) -> dict:
        from cedlm.data import vision_tasks as T
        from cedlm.train.export import export_model
        from cedlm.train.runner import plot_loss, save_model, write_json
        args, model, tok, out, lim = self.args, self.model, self.tok, self.out, self.args.eval_limit
        digits, words = self.tasks["digits"][1], self.tasks["words"][1]
        res = {"anchor_steps": na, "regression_steps": nr, "end_to_end_steps": nc,
               "train_seconds": round(self.budget.elapsed(), 1), "threads": args.threads,
               "vision_config": self.vc.to_dict(), "init": str(args.init),
               "vision_params": sum(p.numel() for p in self.train_params),
               "digits_heldout_acc": accuracy(model, tok, digits, limit=lim),
               "digits_heldout_n": len(digits.rows[:lim]),
               "words_heldout_acc": accuracy(model, tok, words, limit=lim),
               "words_heldout_n": len(words.rows[:lim])}
        unseen = Examples(model, tok, T.word_examples(80, args.seed + 2000, T.UNSEEN_WORDS), T.WORD_QUESTION)
        res["unseen_words_acc"] = accuracy(model, tok, unseen, limit=lim)
        plot_loss([m for m in self.metrics.records if m.get("phase") == "end_to_end"], out / "loss.png")
        for p in model.parameters():
            p.requires_grad_(True)
        write_json(out / "args.json", vars(args))
        save_model(out, model, tok)
        export_model(out / "checkpoint", out / "export", summary={"stage": "vision", **res})
        write_json(out / "eval.json", res)
        print(json.dumps(res, indent=2))
        return res


def run(args) -> int:
    from cedlm.train.runner import StepLoop, run_steps
    try:
        st = VisionStage(args)
        na, nr = st.phases_ab()
        nc, _ = run_steps(StepLoop(name="cedlm train vision", step=st.step, stop=args.steps, metrics=st.metrics,
                                   budget=st.phase_c, evaluate=st.heldout, eval_every=args.eval_every))
        st.finish(na, nr, nc)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
