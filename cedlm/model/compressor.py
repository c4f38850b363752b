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
from cedlm.model import static_kv
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

    # ---------------------------------------------------------------- the static step
    def step(self, shapes, P: dict, p1: torch.Tensor, io: dict, indexer=None):
        """The entries completed by the call's rows p1 [B, T] (`Attention.step`; P: the layer's
        products "c_wkv", "c_wgate"), with static shapes: the pending rows arrive padded
        (io["pending"]: [B, r-1, hd] each, rows < pos % r valid) and the group this call may
        complete is pooled under a mask. Returns (n visible [B, T] (row t sees entries
        < n_vis[:, t]), n stored [B], the new entries' main-KV bytes [B, G, w], emit [B, G]): G the
        groups the rows may complete, entry n + g made when emit[:, g]. Puts in io: "entries"
        (main, index-key bytes or None, emit), "pending" (the old rows followed by the rows'
        projections, [B, r - 1 + T, hd]; for T = 1 the first r - 1, the token put at its phase)
        and, with index keys (`indexer`), "idx_rows" (the stored keys' bytes, the new keys, n)."""
        r = self.ratio
        B, T = p1.shape
        dev = p1.device
        pos = p1[:, 0]
        kv, gate = P["c_wkv"].float(), P["c_wgate"].float() if r > 1 else None       # [B, T, hd]
        if r == 1:                                  # every row makes an entry
            lat, start = self.norm(kv), p1
            emit = torch.ones(B, T, dtype=torch.bool, device=dev)
            made = torch.arange(1, T + 1, device=dev).expand(B, T)       # entries made by row t
        else:
            pk, pg = io["pending"]                                                   # [B, r-1, hd]
            phase = (pos % r).view(B, 1)
            if T == 1:
                slot = (torch.arange(r - 1, device=dev) == phase).unsqueeze(-1)      # where it waits
                kvs, gates = torch.cat((pk, kv), 1), torch.cat((pg, gate), 1)
                io["pending"] = (torch.where(slot, kv, pk), torch.where(slot, gate, pg))
            else:   # slot i: pending row i below the phase, else the row i - phase of the call
                L = -(-(r - 1 + T) // r) * r
                i = torch.arange(L, device=dev).view(1, L)
                at = (i - phase).clamp(0, T - 1).unsqueeze(-1).expand(B, L, kv.shape[-1])
                old = (i < phase).unsqueeze(-1)
                pad = kv.new_zeros(B, L - (r - 1), kv.shape[-1])
                kvs = torch.where(old, torch.cat((pk, pad), 1), kv.gather(1, at))
                gates = torch.where(old, torch.cat((pg, pad), 1), gate.gather(1, at))
                io["pending"] = (kvs, gates)
            lat = self.pool(kvs, gates)                                              # [B, G, hd]
            G = lat.shape[1]
            start = (pos - phase[:, 0]).view(B, 1) + r * torch.arange(G, device=dev)
            emit = (torch.arange(1, G + 1, device=dev) * r).view(1, G) <= phase + T
            made = (phase + torch.arange(1, T + 1, device=dev)) // r
        main = static_kv.encode_rows(self.rope.apply(lat, start), shapes.kv_fmt[self.layer_id])  # [B, G, w]
        idx_bytes = None
        n = io["count"]
        if indexer is not None and indexer.has_keys:
            fmt = shapes.idx_fmt[self.layer_id]
            key = static_kv.stored(indexer.rope.apply(indexer.keys(lat), start), fmt)     # [B, G, d]
            idx_bytes = static_kv.encode_rows(key, fmt)
            pool = io["idx_pool"]
            io["idx_rows"] = (pool if shapes.flat else static_kv.all_rows(pool, io["table"]), key, n)
        io["entries"] = (main, idx_bytes, emit)
        return n.view(B, 1) + made, n, main, emit
