"""Fidelity of one model configuration against a reference: KL, perplexity, top-1, retrieval.

The reference configuration (`REFERENCE`): main KV, window and index keys in BF16, full prefill,
and dense attention over every visible compressed entry (index_topk and the candidate pool larger
than any context). A `Setting` is the same weights under other config fields (storage formats,
index_topk, candidate pool, window), another prefill mode, a restore by replay, or the indexer's
weights taken from another model (e.g. the indexer at initialisation).

Every measurement runs the inference path (`SequenceState` byte caches): a sequence of L tokens
is prefilled up to its tail of M tokens (in the setting's prefill mode; `full` runs in chunks of
`chunk` tokens, which is the same computation), optionally restored (global entries and token
ids kept, windows dropped, then `replay`), and the tail is scored by a continuation prefill. The
M rows of logits are compared with the reference's on the same tokens:

    kl      mean over rows of KL(p_ref || p_setting) of the next-token distributions (nats)
    ppl     exp(mean NLL of the actual next tokens); d_ppl_pct against the reference's
    top1    share of rows whose argmax equals the reference's argmax
    retrieval[L]  share of passkey / key-value items (`cedlm.data.retrieval`, records at depths
            spread over the context, so beyond the window) whose answer tokens are all the argmax
            under teacher forcing (= greedy generation of the answer); answer_nll[L] and
            answer_token_acc[L]: mean NLL (nats) and argmax accuracy per answer token, the graded
            view of the same items

Identical configurations give identical logits, so KL 0 and top-1 1 exactly.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from cedlm.checkpoint import set_token_map
from cedlm.data.retrieval import KINDS, eval_sample
from cedlm.kv_layout import KVLayout
from cedlm.model import build_model
from cedlm.model.replay import persisted_copy

DENSE = 1 << 30                   # index_topk / candidate_topk_blocks beyond any context
REFERENCE = {"main_kv_format": "bf16", "window_kv_format": "bf16", "index_kv_format": "bf16",
             "index_topk": DENSE, "candidate_topk_blocks": DENSE}


@dataclass
class Setting:
    name: str
    overrides: dict = field(default_factory=dict)     # config fields over the model's own
    prefill: str = "full"                             # prefill mode of the context
    restore: str | None = None                        # replay mode of a restore after prefill
    indexer_state: dict | None = None                 # indexer weights to swap in (name -> tensor)
    note: str = ""

    def describe(self) -> dict:
        return {"name": self.name, "overrides": {k: v for k, v in self.overrides.items()},
                "prefill": self.prefill, "restore": self.restore,
                "indexer": "swapped" if self.indexer_state is not None else "model's", "note": self.note}


def reference(**extra) -> Setting:
    return Setting("reference", {**REFERENCE, **extra.pop("overrides", {})}, **extra)


def variant_model(base, tokenizer, setting: Setting):
    """The base model's weights under the setting's config (and indexer swap), in eval mode."""
    cfg = base.cfg.replace(**setting.overrides) if setting.overrides else base.cfg
    with torch.device("cpu"):       # built on the host as every loaded model is, then moved
        # dspark: a model that ships mtp.safetensors keeps its drafter
        m = build_model(cfg, dspark=getattr(base, "mtp", None) is not None)
    state = base.state_dict()
    if setting.indexer_state is not None:
        missing = [k for k in setting.indexer_state if k not in state]
        if missing:
            raise ValueError(f"indexer weights: {missing[0]!r} is not a tensor of the model")
        state = {**state, **setting.indexer_state}
    m.load_state_dict(state, strict=True)
    set_token_map(m, tokenizer)
    from cedlm.engine.loader import model_device
    return m.to(model_device(base)).eval()                 # on the base model's device


def bytes_per_token(model) -> float:
    return float(KVLayout.from_config(model.cfg).bytes_per_token)


@torch.no_grad()
def tail_logits(model, ids: torch.Tensor, M: int, setting: Setting, chunk: int = 256) -> torch.Tensor:
    """ids [L] -> logits [M, vocab]: row i predicts ids[L - M + i]."""
    L = ids.numel()
    if not 0 < M < L:
        raise ValueError(f"tail: {M} scored tokens of a {L}-token sequence")
    st = model.new_state()
    ctx = ids[: L - M]
    if setting.prefill == "full":
        for c in range(0, ctx.numel(), chunk):
            last = model.prefill(ctx[c: c + chunk], st, "full")[-1]
    else:
        last = model.prefill(ctx, st, setting.prefill, chunk_size=chunk)[-1]
    if setting.restore:
        st = persisted_copy(model, st)
        last = model.replay(st, setting.restore)
    rows = [last[None]]
    rest = ids[L - M: L - 1]
    for c in range(0, rest.numel(), chunk):
        rows.append(model.prefill(rest[c: c + chunk], st, "full"))
    return torch.cat(rows)


def compare(ref: torch.Tensor, out: torch.Tensor, targets: torch.Tensor) -> dict:
    """Sums over rows: kl (nats), nll of targets (setting and reference), top-1 agreements."""
    lr, lo = ref.float().log_softmax(-1), out.float().log_softmax(-1)
    targets = targets.to(ref.device)                       # host token ids, device logits
    kl = (lr.exp() * (lr - lo)).sum(-1)
    return {"kl": kl.sum().item(), "nll": -lo.gather(-1, targets[:, None]).sum().item(),
            "ref_nll": -lr.gather(-1, targets[:, None]).sum().item(),
            "top1": (ref.argmax(-1) == out.argmax(-1)).sum().item(), "rows": int(targets.numel())}


def text_samples(tokens: np.ndarray, length: int, n: int) -> list[torch.Tensor]:
    """n windows of `length` tokens, evenly spaced over the text (deterministic)."""
    if len(tokens) < length:
        raise ValueError(f"text: {len(tokens)} tokens is too few for length {length}")
    starts = np.unique(np.linspace(0, len(tokens) - length, n).astype(np.int64))
    return [torch.as_tensor(np.asarray(tokens[s: s + length], dtype=np.int64), device="cpu")   # host ids
            for s in starts]


def retrieval_samples(tokens: np.ndarray, tokenizer, length: int, n: int, seed: int = 0,
                      kinds: tuple[str, ...] = KINDS):
    """n items cycling through `kinds` (passkey / kv), records at depths spread over [0.05, 0.75]
    of the context -> [(ids [L], answer length)]."""
    rng = np.random.Generator(np.random.PCG64(seed + length))
    depths = np.linspace(0.05, 0.75, n) if n > 1 else [0.4]
    out = []
    for i, d in enumerate(depths):
        ids, n_ans = eval_sample(rng, tokens, tokenizer, length, kinds[i % len(kinds)], float(d))
        out.append((torch.as_tensor(ids, device="cpu"), n_ans))
    return out


class Measurement:
    """The samples of one run and the reference's logits on them (computed once, then reused)."""

    def __init__(self, base, tokenizer, tokens: np.ndarray, text_lengths: list[int], n_text: int,
                 retrieval_lengths: list[int], n_retrieval: dict[int, int] | int, tail: int = 128,
                 chunk: int = 256, progress: bool = False, ref: Setting | None = None,
                 kinds: tuple[str, ...] = KINDS):
        self.base, self.tok, self.chunk, self.progress = base, tokenizer, chunk, progress
        self.text = {L: text_samples(tokens, L, n_text) for L in text_lengths}
        nr = n_retrieval if isinstance(n_retrieval, dict) else {L: n_retrieval for L in retrieval_lengths}
        self.retr = {L: retrieval_samples(tokens, tokenizer, L, nr[L], kinds=kinds) for L in retrieval_lengths if nr.get(L)}
        self.kinds = tuple(kinds)
        self.tail = {L: min(tail, L // 4) for L in text_lengths}
        self.ref_setting = ref or reference()
        self._ref: dict | None = None

    def _bar(self, total: int, desc: str):
        if not self.progress:
            return None
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, unit="seq", dynamic_ncols=True, leave=False, disable=None)

    def reference_logits(self) -> dict:
        if self._ref is None:
            m = variant_model(self.base, self.tok, self.ref_setting)
            bar = self._bar(sum(len(v) for v in self.text.values()), "reference")
            self._ref = {}
            for L, seqs in self.text.items():
                self._ref[L] = []
                for ids in seqs:
                    self._ref[L].append(tail_logits(m, ids, self.tail[L], self.ref_setting, self.chunk))
                    bar and bar.update(1)
            bar and bar.close()
        return self._ref

    def run(self, setting: Setting, skip_retrieval: set[int] = frozenset()) -> dict:
        """All metrics of one setting (JSON-able)."""
        t0 = time.time()
        ref = self.reference_logits()
        same = setting.describe() == self.ref_setting.describe()    # the reference itself:
        m = variant_model(self.base, self.tok, setting)              # its text logits are cached
        n = sum(len(v) for v in self.text.values()) + sum(len(v) for L, v in self.retr.items()
                                                         if L not in skip_retrieval)
        bar = self._bar(n, setting.name)
        tot = {"kl": 0.0, "nll": 0.0, "ref_nll": 0.0, "top1": 0, "rows": 0}
        per_len = {}
        for L, seqs in self.text.items():
            acc = dict.fromkeys(tot, 0.0)
            for ids, r in zip(seqs, ref[L]):
                M = self.tail[L]
                c = compare(r, r if same else tail_logits(m, ids, M, setting, self.chunk), ids[-M:])
                for k in tot:
                    tot[k] += c[k]
                    acc[k] += c[k]
                bar and bar.update(1)
            per_len[str(L)] = _summary(acc)
        retrieval, answer_nll, answer_acc = {}, {}, {}
        for L, items in self.retr.items():
            if L in skip_retrieval:
                continue
            ok, nll, hit, n = 0, 0.0, 0, 0
            for ids, k in items:
                logits = tail_logits(m, ids, k, setting, self.chunk)
                tgt = ids[-k:].to(logits.device)
                right = logits.argmax(-1) == tgt
                ok += bool(right.all())
                hit, n = hit + int(right.sum()), n + k
                nll -= logits.float().log_softmax(-1).gather(-1, tgt[:, None]).sum().item()
                bar and bar.update(1)
            retrieval[str(L)] = ok / len(items)
            answer_nll[str(L)], answer_acc[str(L)] = nll / n, hit / n
        bar and bar.close()
        return {**setting.describe(), **_summary(tot), "per_length": per_len, "retrieval": retrieval,
                "answer_nll": answer_nll, "answer_token_acc": answer_acc,
                "retrieval_samples": {str(L): len(v) for L, v in self.retr.items() if L not in skip_retrieval},
                "retrieval_kinds": list(self.kinds),
                "text_samples": {str(L): len(v) for L, v in self.text.items()},
                "bytes_per_token": bytes_per_token(m), "wall_s": time.time() - t0}


def _summary(t: dict) -> dict:
    rows = max(t["rows"], 1)
    ppl, ref_ppl = math.exp(t["nll"] / rows), math.exp(t["ref_nll"] / rows)
    return {"kl": t["kl"] / rows, "ppl": ppl, "ref_ppl": ref_ppl,
            "d_ppl_pct": 100.0 * (ppl / ref_ppl - 1.0), "top1": t["top1"] / rows, "rows": int(t["rows"])}
