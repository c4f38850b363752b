"""Lightning indexer and the hierarchical candidate pool.

Score I(t, s) = sum_j w(t, j) * ReLU(q(t, j) . k(s)) over `index_n_heads` heads, with
w = weights_proj(x) * d^-0.5 * H^-0.5; queries and keys are FP4 (index_fp4) after RoPE on their
last rope dims. Keys come from the KV source: k = RoPE(k_norm(wk(latent))). A query at t sees the
entries whose last token is <= t, and keeps the top `index_topk` (all, when fewer are visible).
The candidate source publishes a pool: per block of `candidate_block_size` entries the max score,
the newest block always kept, the top `candidate_topk_blocks` blocks. Reindex layers score only
inside the pool; the source itself is not restricted by it.
"""
from __future__ import annotations

import torch
from torch import nn

from cedlm.config import ModelConfig
from cedlm.model.norm import RMSNorm

NEG = float("-inf")


def stable_topk(score: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, ties broken toward the NEWEST (highest) index.

    torch.topk breaks ties in a way that depends on the tensor's length, and ReLU'd index scores
    tie often (at 0); a length-independent rule keeps incremental decode equal to the full
    forward. Returns (indices, values) of the k best.
    """
    N = score.shape[-1]
    vals, order = torch.sort(score.flip(-1), dim=-1, descending=True, stable=True)
    return (N - 1 - order[..., :k]), vals[..., :k]


def candidate_pool(score: torch.Tensor, n_visible: torch.Tensor, block: int, topk_blocks: int
                   ) -> torch.Tensor:
    """score [B, T, N] (-inf where invisible), n_visible [B, T] -> pool mask [B, T, N] bool."""
    B, T, N = score.shape
    nb = -(-N // block)
    padded = torch.full((B, T, nb * block), NEG)
    padded[..., :N] = score
    bscore = padded.view(B, T, nb, block).amax(-1)                      # [B, T, nb]
    newest = ((n_visible - 1).clamp_min(0) // block).unsqueeze(-1)
    bscore = bscore.scatter(-1, newest, torch.where(n_visible > 0, float("inf"), NEG).unsqueeze(-1))
    ids, vals = stable_topk(bscore, min(topk_blocks, nb))
    keep = torch.zeros(B, T, nb, dtype=torch.bool)
    keep.scatter_(-1, ids, vals > NEG)
    return keep.repeat_interleave(block, dim=-1)[..., :N]


def topk_entries(score: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """score [B, T, N] -> (indices [B, T, min(k, N)], valid [B, T, min(k, N)])."""
    ids, vals = stable_topk(score, min(k, score.shape[-1]))
    return ids, vals > NEG


class Indexer(nn.Module):
    """Query side on every index source; key side (`wk`, `k_norm`) only on KV sources."""

    def __init__(self, cfg: ModelConfig, has_keys: bool):
        super().__init__()
        self.h, self.d = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.h * self.d, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.h, bias=False)
        if has_keys:
            self.wk = nn.Linear(cfg.head_dim, self.d, bias=False)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)

    def keys(self, latent: torch.Tensor) -> torch.Tensor:
        """Compressed latents [.., hd] -> index keys before RoPE [.., d]."""
        return self.k_norm(self.wk(latent))

    def queries(self, qr: torch.Tensor, x: torch.Tensor):
        """qr [B, T, q_lora], x [B, T, D] -> q [B, T, h, d] before RoPE, weights [B, T, h]."""
        q = self.wq_b(qr).unflatten(-1, (self.h, self.d))
        w = self.weights_proj(x).float() * (self.d ** -0.5 * self.h ** -0.5)
        return q, w

    @staticmethod
    def score(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """q [B,T,h,d], w [B,T,h], keys [B,N,d], visible [B,T,N] -> [B,T,N] (-inf invisible)."""
        s = torch.einsum("bthd,bnd->bthn", q.float(), keys.float()).relu()
        s = torch.einsum("bthn,bth->btn", s, w)
        return s.masked_fill(~visible, NEG)
