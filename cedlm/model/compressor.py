"""Compressor of a KV-source layer: token rows -> compressed entries (pre-RoPE latents).

Ratio r > 1 (CSA2 encoder, r = 2): `wkv` and `wgate` project each token (fp32); a per-channel
softmax over the r tokens of a group (no overlap) weights the projections; `norm` follows. Entry
g covers positions [g*r, g*r + r - 1] and is emitted when its last token arrives; an incomplete
group waits in the sequence's pending state. Ratio 1 (the decoder's global KV): norm(wkv(x)).
An entry's main KV is its latent with RoPE at the group's first position, rounded to the main-KV
format; the layer's indexer derives the entry's index key from the same latent.
"""
from __future__ import annotations

import torch
from torch import nn

from cedlm.config import ModelConfig
from cedlm.model.forward_batch import ForwardBatch
from cedlm.model.kv_cache import KVCache
from cedlm.model.norm import RMSNorm
from cedlm.model.rope import Rope
from cedlm.kernels import store_round


class Compressor(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id, self.ratio, self.fmt = layer_id, cfg.compress_ratios[layer_id], cfg.main_kv_format
        ratio = self.ratio
        self.rope = Rope(cfg.qk_rope_head_dim, cfg.rope_theta_of(layer_id),
                         cfg.rope_scaling if cfg.uses_yarn(layer_id) else None,
                         cfg.rope_precision)
        self.wkv = nn.Linear(cfg.hidden_size, cfg.head_dim, bias=False)
        self.wgate = nn.Linear(cfg.hidden_size, cfg.head_dim, bias=False) if ratio > 1 else None
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        kv = x.float() @ self.wkv.weight.float().t()
        gate = None if self.wgate is None else x.float() @ self.wgate.weight.float().t()
        return kv, gate

    def pool(self, kv: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """kv, gate: [..., G*r, hd] (whole groups) -> normalised latents [..., G, hd]."""
        if self.ratio == 1:
            return self.norm(kv)
        r = self.ratio
        kv = kv.unflatten(-2, (-1, r))                        # [..., G, r, hd]
        w = gate.unflatten(-2, (-1, r)).softmax(dim=-2)       # per-channel softmax over the group
        return self.norm((kv * w).sum(-2))

    def forward_rows(self, x: torch.Tensor, first_pos: int, pending=None):
        """One sequence's new rows x [T, D] starting at position first_pos.

        Returns (latents [G, hd], first positions [G], new pending (kv, gate) or None).
        """
        kv, gate = self.project(x)
        r = self.ratio
        if r == 1:
            return self.pool(kv, None), torch.arange(first_pos, first_pos + x.shape[0], device=x.device), None
        pk, pg = pending if pending is not None else (kv[:0], gate[:0])
        assert pk.shape[0] == first_pos % r, "pending rows must match the position phase"
        kv, gate = torch.cat((pk, kv)), torch.cat((pg, gate))
        start = first_pos - pk.shape[0]                       # a group boundary
        G = kv.shape[0] // r
        lat = self.pool(kv[: G * r], gate[: G * r])
        return lat, start + torch.arange(G, device=x.device) * r, (kv[G * r:], gate[G * r:])

    def compress(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache, indexer=None) -> None:
        """New rows x [B, T, D] of this pass -> the completed entries (main KV, and index keys
        when `indexer` owns keys) appended to the cache; the incomplete group carried over."""
        for b, p0 in enumerate(batch.first_positions()):
            lat, starts, pend = self.forward_rows(x[b], p0, self.pending_of(cache, b))
            if pend is not None:
                cache.set_pending(self.layer_id, b, (pend[0].detach(), pend[1].detach()))
            kv = store_round(self.rope.apply(lat, starts), self.fmt, self.training)
            idx = indexer.entry_keys(lat, starts) if indexer is not None else None
            cache.add_entries(self.layer_id, b, kv, idx)

    def pending_of(self, cache: KVCache, b: int):
        return cache.pending(self.layer_id, b) if self.ratio > 1 else None
