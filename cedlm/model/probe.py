"""Indexer distillation probe: what the lightning indexer scored and where the attention went.

The lightning indexer gets no gradient through its top-k. DeepSeek trains it by distillation:
its score distribution over the visible compressed entries is pulled (KL) towards the main
attention's distribution over the same entries, summed over heads and detached. An
`IndexerProbe` set on a pass's `ForwardBatch` (`ForwardBatch.probe`, None by default: no cost
when off) asks
- each index layer (`Indexer.select`) to record its scores (with their gradient), the visible
  entries and the top-k it would select;
- each sparse attention layer (`Attention.forward`, dense cache only) to add its probabilities
  over the compressed entries, summed over heads and detached, to its index source's target
  (an index source's selection serves itself and the Reuse layers above it);
and, with `dense=True` (the warm-up), makes every index layer select every visible entry (no
candidate pool) so that the attention target covers all of them.

`distill_kl` is the loss: per query row, KL(target || softmax(score)) over the entries of the
set (every visible entry in the dense warm-up, the selected top-k with sparse selection on),
the target renormalised over that set. `topk_recall` is the share of the dense attention mass
(over every visible entry) that the indexer's top-k captures, over the rows that see more
entries than `index_topk` (where the selection matters).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class IndexerProbe:
    dense: bool = False                   # select every visible entry (dense warm-up)
    scores: dict[int, torch.Tensor] = field(default_factory=dict)      # layer -> [B,T,N] raw scores
    visible: dict[int, torch.Tensor] = field(default_factory=dict)     # layer -> [B,T,N] bool
    topk: dict[int, torch.Tensor] = field(default_factory=dict)        # layer -> [B,T,N] bool (top-k)
    target: dict[int, torch.Tensor] = field(default_factory=dict)      # index layer -> [B,T,N] mass
    dense_mass: dict[int, torch.Tensor] = field(default_factory=dict)  # same, attention over all

    def record_scores(self, layer: int, score: torch.Tensor, visible: torch.Tensor,
                      idx: torch.Tensor, valid: torch.Tensor) -> None:
        """score [B,T,N] (before the candidate pool; -inf where invisible), the top-k (idx, valid)."""
        sel = torch.zeros_like(visible)
        sel.scatter_(-1, idx, valid)
        self.scores[layer], self.visible[layer], self.topk[layer] = score, visible, sel

    def add_attention(self, index_layer: int, probs: torch.Tensor, dense_probs: torch.Tensor | None) -> None:
        """probs [B,H,T,N]: one layer's attention over the compressed entries (as it ran);
        dense_probs: the same over every visible entry (None: probs already are)."""
        for store, p in ((self.target, probs), (self.dense_mass, probs if dense_probs is None else dense_probs)):
            m = p.detach().sum(1)
            store[index_layer] = store[index_layer] + m if index_layer in store else m

    @property
    def layers(self) -> list[int]:
        return sorted(k for k in self.scores if k in self.target)


def _kl_rows(score: torch.Tensor, target: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KL(target || softmax(score)) over the entries in `keep` -> (kl [R], row ok [R])."""
    tgt = target.float().masked_fill(~keep, 0.0)
    tot = tgt.sum(-1, keepdim=True)
    ok = (tot.squeeze(-1) > 0) & keep.any(-1)
    p = tgt / tot.clamp_min(1e-30)
    logq = torch.log_softmax(score.float().masked_fill(~keep, float("-inf")), -1)
    logq = logq.masked_fill(~keep, 0.0)
    logp = torch.where(p > 0, p.clamp_min(1e-30).log(), torch.zeros_like(p))
    return (p * (logp - logq)).sum(-1), ok


def distill_kl(probe: IndexerProbe, sparse: bool) -> tuple[torch.Tensor, dict[int, float]]:
    """Mean over index layers of the mean per-row KL; also {layer: kl} (floats). The set is the
    visible entries (dense) or the selected top-k (sparse)."""
    per, total = {}, []
    for l in probe.layers:
        keep = probe.topk[l] if sparse else probe.visible[l]
        kl, ok = _kl_rows(probe.scores[l], probe.target[l], keep)
        if ok.any():
            v = kl[ok].mean()
            total.append(v)
            per[l] = v.item()
    if not total:
        return torch.zeros((), device=next((s.device for s in probe.scores.values()), "cpu")), per
    return torch.stack(total).mean(), per


@torch.no_grad()
def topk_recall(probe: IndexerProbe, k: int) -> dict[int, float]:
    """{layer: mean share of the dense attention mass on the indexer's top-k}, over rows that
    see more than k entries (absent when there are none)."""
    out = {}
    for l in probe.layers:
        mass, vis = probe.dense_mass[l].float(), probe.visible[l]
        rows = (vis.sum(-1) > k) & (mass.sum(-1) > 0)
        if rows.any():
            share = (mass * probe.topk[l]).sum(-1) / mass.sum(-1).clamp_min(1e-30)
            out[l] = share[rows].mean().item()
    return out
