"""The joint pretraining step: `cedlm train pretrain --mixture FILE` trains corpus text, chat and
retrieval from step 0 in one run, with a sequence-length curriculum and the lightning indexer
distilled as it goes.

    cedlm train pretrain --preset small --mixture mixture.json --indexer-kl-weight 1 \\
        --dense-steps 300 --steps 2000 --out runs/joint

The batches come from `cedlm.train.mixture.MixtureBatches` (the file is a `MixtureConfig` in
JSON: weights of corpus / chat / retrieval / repeat rows, the (step, seq_len) curriculum, the
retrieval gap in sliding windows). Chat rows pack conversations of
`cedlm.train.chat_data.build_examples` drawn from the training split's documents
(`--chat-examples` of them, seeded by --seed).

Per step:
- rows: `--batch-size` rows at the first stage's length; a longer stage keeps the tokens per step
  (rows = batch_size x first_len / len, at least one per rank), so the schedule's step counts mean
  the same work at every stage;
- loss: the mean cross-entropy over the batch's target tokens (`MixtureBatch.loss_mask`: every
  token of corpus, repeat and retrieval rows, the assistant's tokens of chat rows), plus
  `--indexer-kl-weight` x the indexer's distillation KL (`cedlm.model.probe`);
- selection: for the first `--dense-steps` every index layer selects every visible entry (the
  dense warm-up: attention learns where to look before the indexer has learnt to score, and the
  indexer's KL covers every entry); then sparse, as the model serves (index_topk, candidate pool),
  the KL over the selected entries. The LM loss never reaches the indexer and the KL reaches
  only the indexer (its inputs are detached, its top-k passes no gradient).

The record adds the loss of each row kind, the accuracy of retrieval answers and repeated tokens,
the KL and top-k recall per index layer, the rows, seq_len and phase. A resumed run draws exactly
the batches of the uninterrupted one: a batch is a function of (mixture seed, step).

With the indexer KL on, the step runs eager (the probe records tensors per layer; --compile on is
refused); without it, the masked loss runs through `cedlm.train.compile.training_loss` like plain
pretraining.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from cedlm.model.probe import IndexerProbe, distill_kl, topk_recall
from cedlm.train.mixture import KINDS, MixtureBatches, MixtureConfig, curriculum_seq_len


class SettingsError(ValueError):
    """A bad joint-pretraining setting: the CLI prints it as one line and exits 2."""


def load_mixture(spec) -> dict:
    """--mixture's value (a JSON file's path, or the dict saved in a checkpoint) -> the
    validated `MixtureConfig` as a dict; a ValueError naming `mixture` otherwise."""
    if isinstance(spec, dict):
        d = spec
    else:
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"mixture: {spec}: no such file")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"mixture: {spec}: not JSON ({e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"mixture: {spec}: must hold a JSON object")
    try:
        return MixtureConfig.from_dict(d).to_dict()
    except (TypeError, ValueError) as e:
        raise ValueError(f"mixture: {e}") from None


def rows_at(batch_size: int, first_len: int, seq_len: int, world: int) -> int:
    """Rows of the global batch at `seq_len`: the first stage's tokens per step kept, rounded down
    to a multiple of the ranks, at least one row per rank."""
    rows = batch_size * first_len // seq_len
    return max(world, rows - rows % world)


class JointData:
    """The mixture of a run: batches per step and their token counts."""

    def __init__(self, mixture: dict, tokens, tokenizer, window: int, data_dir: str | Path,
                 batch_size: int, chat_examples: int, seed: int, world: int = 1):
        self.cfg = MixtureConfig.from_dict(mixture)
        self.batch_size, self.world = batch_size, world
        examples = ()
        if self.cfg.weight("chat") > 0:
            from cedlm.train.chat_data import build_examples, corpus_documents
            if chat_examples < 1:
                raise ValueError("chat_examples: must be >= 1 when the mixture has chat rows")
            examples = build_examples(corpus_documents(data_dir, "train"), tokenizer, chat_examples, seed,
                                      weights=self.cfg.chat_tasks)
        self.source = MixtureBatches(self.cfg, tokens, tokenizer, window, examples)

    def seq_len(self, step: int) -> int:
        return curriculum_seq_len(self.cfg, step)

    def rows(self, step: int) -> int:
        return rows_at(self.batch_size, self.cfg.curriculum[0][1], self.seq_len(step), self.world)

    def tokens_through(self, steps: int) -> int:
        """Input tokens of steps 0 .. steps-1 (closed form over the curriculum's stages)."""
        total, stages = 0, list(self.cfg.curriculum)
        for i, (start, n) in enumerate(stages):
            end = min(steps, stages[i + 1][0] if i + 1 < len(stages) else steps)
            if end > start:
                total += (end - start) * self.rows(start) * n
        return total

    def batch(self, step: int, rank: int = 0):
        return self.source.batch(step, self.rows(step), rank, self.world)


def loss_weights(mask: torch.Tensor, answer: torch.Tensor, answer_weight: float) -> torch.Tensor:
    """The per-token loss weights [B, S] (float): 1 on a target, `answer_weight` on a target that
    is an answer token, 0 elsewhere; the bool mask itself when the weight is 1 (the plain mean)."""
    if answer_weight == 1:
        return mask
    return mask.float() * torch.where(answer, answer_weight, 1.0)


def masked_ce(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy over the targets where mask, the per-token cross-entropy [B, S]); a float
    mask weighs each token (the weighted mean)."""
    ce = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none").view_as(y)
    m = mask.to(ce.dtype)
    return (ce * m).sum() / m.sum().clamp_min(1), ce


@torch.no_grad()
def batch_metrics(ce: torch.Tensor, logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
                  answer: torch.Tensor, kinds: list[str]) -> dict:
    """Loss per row kind (over its targets) and answer accuracy of retrieval and repeat rows."""
    rec = {}
    right = logits.argmax(-1) == y
    for k in KINDS:
        rows = torch.tensor([kk == k for kk in kinds], device=y.device)
        if not rows.any():
            continue
        m = mask & rows[:, None]
        if m.any():
            rec[f"loss_{k}"] = ce[m].mean().item()
        if k in ("retrieval", "repeat"):
            a = answer & rows[:, None]
            if a.any():
                rec[f"acc_{k}"] = right[a].float().mean().item()
    return rec


def joint_loss(model, x, y, mask, answer, kinds, kl_weight: float, dense: bool, loss_fn=None,
               answer_weight: float = 1.0) -> tuple[torch.Tensor, dict]:
    """The step's loss (not yet backpropagated) and its metrics. With kl_weight > 0 the forward
    carries an `IndexerProbe` (dense: every visible entry selected; also without the KL);
    otherwise `loss_fn(x, y,
    mask)` (the compiled or eager masked loss) when given. The LM loss is the mean over the
    targets weighted by `loss_weights` (answer tokens x answer_weight)."""
    weights = loss_weights(mask, answer, answer_weight)
    if kl_weight > 0 or dense:
        probe = IndexerProbe(dense=dense)
        logits = model(x, probe=probe)
        lm, ce = masked_ce(logits, y, weights)
        kl, per_layer = distill_kl(probe, sparse=not dense)
        rec = {"lm_loss": lm.item(), "kl": kl.item(), **{f"kl_{l}": v for l, v in per_layer.items()},
               **{f"recall_{l}": v for l, v in topk_recall(probe, model.cfg.index_topk).items()}}
        rec.update(batch_metrics(ce, logits, y, mask, answer, kinds))
        return lm + kl_weight * kl, rec
    if loss_fn is not None:
        lm = loss_fn(x, y, weights)
        return lm, {"lm_loss": lm.item()}
    logits = model(x)
    lm, ce = masked_ce(logits, y, weights)
    return lm, {"lm_loss": lm.item(), **batch_metrics(ce, logits, y, mask, answer, kinds)}


@torch.no_grad()
def retrieval_eval(model, joint: JointData, val_tokens, seq_len: int, n: int, device) -> dict:
    """Held-out retrieval at `seq_len`: `n` fixed rows of the mixture's retrieval kind built on
    the validation tokens (one passkey, key-value or held-out `varied` item, its query at least
    `min_gap` tokens after its record), run as the model serves (eval mode: sparse selection). -> {"val_retrieval_acc":
    answer tokens predicted right (greedy, teacher-forced), "val_retrieval_exact": rows whose every
    answer token is right, "val_retrieval_len"}; {} when an item does not fit at this length."""
    src = joint.source
    if n < 1 or not src.retrieval_fits(seq_len) or len(val_tokens) < seq_len + 2:
        return {}
    held = MixtureBatches(replace(src.cfg, weights={"retrieval": 1.0}, curriculum=((0, seq_len),)),
                          val_tokens, src.tok, src.window)
    held.retrieval_split = "heldout"       # `varied` items: wordings, words and names training never drew
    was = model.training
    model.eval()
    right = total = exact = 0
    for i in range(n):
        # generators of their own (a step no run reaches): the same rows at every validation
        ids, _, ans = held.retrieval_row(held.rng_for(2**31, i), seq_len + 1)
        t = torch.from_numpy(ids)[None].to(device)
        a = torch.from_numpy(ans[1:])[None].to(device)
        ok = (model(t[:, :-1]).argmax(-1) == t[:, 1:])[a]
        right, total, exact = right + int(ok.sum()), total + ok.numel(), exact + int(ok.all())
    model.train(was)
    return {"val_retrieval_acc": right / max(total, 1), "val_retrieval_exact": exact / n,
            "val_retrieval_len": seq_len}
