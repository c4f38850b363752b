"""Lightning indexer and the hierarchical candidate pool.

Score I(t, s) = sum_j w(t, j) * ReLU(q(t, j) . k(s)) over `index_n_heads` heads, with
w = weights_proj(x) * d^-0.5 * H^-0.5; queries and keys are FP4 (index_fp4) after RoPE on their
last rope dims. Keys come from the KV source: k = RoPE(k_norm(wk(latent))). A query at t sees the
entries whose last token is <= t, and keeps the top `index_topk` (all, when fewer are visible).
The candidate source publishes a pool: per block of `candidate_block_size` entries the max score,
the newest block always kept, the top `candidate_topk_blocks` blocks. Reindex layers score only
inside the pool; the source itself is not restricted by it.
The indexer's inputs (queries' qr and x, keys' latents) are detached: the selection passes no
gradient, and the indexer learns only from the distillation loss (`probe.py`), which in turn
does not reach the main model. With a probe on the pass, `select` records its scores there, and a
dense probe (warm-up) selects every visible entry.
"""
from __future__ import annotations

import torch
from torch import nn

from cedlm.config import ModelConfig
from cedlm.model.forward_batch import ForwardBatch
from cedlm.model.kv_cache import KVCache
from cedlm.model.norm import RMSNorm
from cedlm.model.rope import Rope
from cedlm.model import static_kv
from cedlm.kernels import index as kernels_index
from cedlm.kernels import store_round

NEG = float("-inf")


def stable_topk(score: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, ties broken toward the NEWEST (highest) index.

    torch.topk breaks ties in a way that depends on the tensor's length, and ReLU'd index scores
    tie often (at 0); a length-independent rule keeps incremental decode equal to the full
    forward. Returns (indices, values) of the k best.
    """
    fast = kernels_index.stable_topk(score, k)   # compiled (index.h), bit-identical, else None
    if fast is not None:
        return fast
    return kernels_index.topk_reference(score, k)       # a stable sort of the reversed scores


def candidate_blocks(score: torch.Tensor, n_visible: torch.Tensor, block: int, topk_blocks: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """score [B, T, N] (-inf where invisible), n_visible [B, T] -> the pool's blocks (ids
    [B, T, kb] in ascending order, kb = min(topk_blocks, blocks), and whether each is kept)."""
    B, T, N = score.shape
    nb = -(-N // block)
    padded = torch.full((B, T, nb * block), NEG, device=score.device)
    padded[..., :N] = score
    bscore = padded.view(B, T, nb, block).amax(-1)                      # [B, T, nb]
    newest = ((n_visible - 1).clamp_min(0) // block).unsqueeze(-1)
    bscore = bscore.scatter(-1, newest, torch.where(n_visible > 0, float("inf"), NEG).unsqueeze(-1))
    ids, vals = stable_topk(bscore, min(topk_blocks, nb))
    ids, order = ids.sort(-1)
    return ids, (vals > NEG).gather(-1, order)


def candidate_pool(score: torch.Tensor, n_visible: torch.Tensor, block: int, topk_blocks: int
                   ) -> torch.Tensor:
    """score [B, T, N] (-inf where invisible), n_visible [B, T] -> pool mask [B, T, N] bool."""
    B, T, N = score.shape
    ids, kept = candidate_blocks(score, n_visible, block, topk_blocks)
    keep = torch.zeros(B, T, -(-N // block), dtype=torch.bool, device=score.device)
    keep.scatter_(-1, ids, kept)
    return keep.repeat_interleave(block, dim=-1)[..., :N]


def candidate_entries(score: torch.Tensor, n_visible: torch.Tensor, block: int, topk_blocks: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool as its entries: (indices [B, T, kb * block] ascending, each < N, and whether
    the entry is in the pool and visible), for a Reindex layer that scores only those."""
    N = score.shape[-1]
    ids, kept = candidate_blocks(score, n_visible, block, topk_blocks)
    at = (ids.unsqueeze(-1) * block + torch.arange(block, device=ids.device)).flatten(-2)
    ok = kept.repeat_interleave(block, dim=-1) & (at < n_visible.unsqueeze(-1))
    return at.clamp(max=N - 1), ok


def topk_entries(score: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """score [B, T, N] -> (indices [B, T, min(k, N)], valid [B, T, min(k, N)])."""
    ids, vals = stable_topk(score, min(k, score.shape[-1]))
    return ids, vals > NEG


class Indexer(nn.Module):
    """One index-source layer's indexer: query side always; key side (`wk`, `k_norm`) on the
    sources that own index keys. Owns the sparse selection of its layer (and, on the candidate
    source, the candidate pool of the pass)."""

    decisions = None    # a cedlm.model.decisions.Decisions recording or replaying the top-k

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        self.h, self.d = cfg.index_n_heads, cfg.index_head_dim
        self.keys_src = cfg.kv_source_of(layer_id)              # whose entries it scores
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.h * self.d, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.h, bias=False)
        if layer_id in cfg.index_key_layer_ids:
            self.wk = nn.Linear(cfg.head_dim, self.d, bias=False)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.rope = Rope(min(cfg.qk_rope_head_dim, self.d), cfg.rope_theta_of(layer_id),
                         cfg.rope_scaling if cfg.uses_yarn(layer_id) else None,
                         cfg.rope_precision)

    @property
    def has_keys(self) -> bool:
        return hasattr(self, "wk")

    @property
    def in_pool(self) -> bool:
        """Whether this layer selects inside the candidate pool (Reindex): it is not the
        candidate source and scores the candidate source's KV source."""
        cand = self.cfg.candidate_source_layer_id
        return cand is not None and self.layer_id != cand and self.cfg.kv_source_of(cand) == self.keys_src

    # ---------------------------------------------------------------- keys
    def keys(self, latent: torch.Tensor) -> torch.Tensor:
        """Compressed latents [.., hd] -> index keys before RoPE [.., d]."""
        return self.k_norm(self.wk(latent))

    def entry_keys(self, latent: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """Stored index keys of new entries: RoPE at each group's first position, FP4-rounded."""
        return store_round(self.rope.apply(self.keys(latent.detach()), starts), self.cfg.index_kv_format,
                           self.training)

    # ---------------------------------------------------------------- queries and scores
    def queries(self, qr: torch.Tensor, x: torch.Tensor):
        """qr [B, T, q_lora], x [B, T, D] -> q [B, T, h, d] before RoPE, weights [B, T, h]."""
        q = self.wq_b(qr).unflatten(-1, (self.h, self.d))
        w = self.weights_proj(x).float() * (self.d ** -0.5 * self.h ** -0.5)
        return q, w

    @staticmethod
    def score(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """q [B,T,h,d], w [B,T,h], keys [B,N,d], visible [B,T,N] -> [B,T,N] (-inf invisible):
        I(t, s) = sum_j w(t, j) * ReLU(q(t, j) . k(s)), the einsums of
        `score_reference` in cedlm/kernels/index.py (shared with the custom op
        `cedlm::index_score`)."""
        return kernels_index.score_reference(q, w, keys, visible)

    def score_cached(self, q: torch.Tensor, w: torch.Tensor, cache: KVCache, visible: torch.Tensor
                     ) -> torch.Tensor:
        """`score` against the KV source's cached keys. Fast path: the compiled kernel reads the
        packed FP4/FP8 keys directly (decoded tile by tile inside the score, no decoded copy of
        the cache; same math as `score`, float32 rounding apart); reference: decode every key with
        the codec (`KVCache.index_keys`), then `score`."""
        packed = cache.index_bytes(self.keys_src)
        if packed is not None:
            raw, _, fmt = packed
            fast = kernels_index.score_packed(q, w, raw, visible, fmt)
            if fast is not None:
                return fast
        keys, _ = cache.index_keys(self.keys_src)
        return self.score(q, w, keys, visible)

    # ---------------------------------------------------------------- selection
    def select(self, qr: torch.Tensor, x: torch.Tensor, batch: ForwardBatch, cache: KVCache):
        """Top-k entries of the KV source for this layer's queries -> (idx [B,T,k], valid
        [B,T,k]), published in the pass's selection for the Reuse layers that follow."""
        cfg, pos, sel = self.cfg, batch.positions, batch.selection
        ends = cache.entry_ends(self.keys_src)
        visible = ends.unsqueeze(1) <= pos.unsqueeze(-1)                      # [B, T, N]
        q, w = self.queries(qr.detach(), x.detach())
        q = store_round(self.rope.apply(q, pos.unsqueeze(-1)), cfg.index_kv_format, self.training)
        raw = score = self.score_cached(q, w, cache, visible)
        cand = cfg.candidate_source_layer_id
        if self.layer_id == cand:
            sel.pool = candidate_pool(score.detach(), visible.sum(-1), cfg.candidate_block_size,
                                      cfg.candidate_topk_blocks)
        elif sel.pool is not None and self.in_pool:
            score = score.masked_fill(~sel.pool, NEG)               # Reindex: inside the pool
        sel.topk[self.layer_id] = topk_entries(score.detach(), cfg.index_topk)
        if self.decisions is not None:                               # recorded / replayed (decisions.py)
            idx, ok = sel.topk[self.layer_id]
            pinned = self.decisions.take(self.decision_key, torch.stack((idx, ok.long())), row_dim=-2)
            sel.topk[self.layer_id] = (pinned[0], pinned[1].bool())
        if batch.probe is not None:                                  # indexer distillation
            batch.probe.record_scores(self.layer_id, raw, visible, *sel.topk[self.layer_id])
            if batch.probe.dense:                                    # warm-up: every visible entry
                N = visible.shape[-1]
                sel.topk[self.layer_id] = (torch.arange(N, device=visible.device).expand(visible.shape), visible)
        return sel.topk[self.layer_id]

    # ---------------------------------------------------------------- the static step
    def step_select(self, shapes, P: dict, p1: torch.Tensor, n_vis: torch.Tensor, io: dict):
        """`select` in the static step (`Attention.step`) for the call's query rows p1 [B, T]
        (P: the layer's products "ix_q", "ix_w"; n_vis [B, T] the entries each row sees) over
        the padded entries (io["idx_rows"]: the stored keys' bytes, the keys this call completed,
        n stored) -> (idx [B, T, k], valid). On a Reindex layer only the candidate pool's entries
        are scored (io["pool_sel"]: the candidate source's `candidate_entries`, which that source
        puts there); the reference scores every entry and masks all but the pool: the same scores
        for the pool's entries (a score depends on its key alone), so the same selection, at the
        pool's cost instead of the context's."""
        cfg = self.cfg
        fmt = shapes.idx_fmt[self.keys_src]
        raw, key, n = io["idx_rows"]
        B, T = n_vis.shape
        q = P["ix_q"].unflatten(-1, (self.h, self.d))                  # `queries`, from the products
        w = P["ix_w"].float() * (self.d ** -0.5 * self.h ** -0.5)
        q = static_kv.stored(self.rope.apply(q, p1.unsqueeze(-1)), fmt).contiguous()
        reindex = self.in_pool and "pool_sel" in io
        # the stored keys straight from their bytes; the keys this call completed (not stored yet)
        # scored here and put at their indices n, n + 1, ... for the rows that see them
        if reindex:
            at, ok = io["pool_sel"]                                                  # [B, T, M]
            M, wk = at.shape[-1], static_kv.words(raw)
            keys = static_kv.unwords(wk.gather(1, at.reshape(B, T * M, 1).expand(-1, -1, wk.shape[-1])))
            stored = (ok & (at < n.view(-1, 1, 1))).reshape(B * T, 1, M)
            score = static_kv.cedlm_ops.index_score(q.reshape(B * T, 1, self.h, self.d),
                                                    w.reshape(B * T, 1, self.h),
                                                    keys.reshape(B * T, M, -1), stored, fmt).view(B, T, M)
        else:
            N = raw.shape[1]
            at = torch.arange(N, device=raw.device).view(1, 1, N)
            score = static_kv.cedlm_ops.index_score(q, w, raw, (at < n.view(-1, 1, 1)).expand(B, T, N), fmt)
        new = (torch.einsum("bthd,bgd->btgh", q, key).relu() * w.unsqueeze(2)).sum(-1)   # [B, T, G]
        off = at - n.view(-1, 1, 1)                                                  # [B, 1 or T, N or M]
        seen = (off >= 0) & (off < (n_vis - n.view(-1, 1)).unsqueeze(-1))             # [B, T, N or M]
        made = new.gather(-1, off.clamp(0, new.shape[-1] - 1).expand(B, T, -1))
        score = torch.where(seen, made, score)
        if reindex:
            score = score.masked_fill(~ok, NEG)
        elif self.layer_id == cfg.candidate_source_layer_id:
            io["pool_sel"] = candidate_entries(score, n_vis, cfg.candidate_block_size, cfg.candidate_topk_blocks)
        idx, vals = static_kv.cedlm_ops.stable_topk(score.contiguous(), min(cfg.index_topk, score.shape[-1]))
        if reindex:
            idx = at.gather(-1, idx)                                 # pool slots -> entry indices
        return idx, vals > NEG
