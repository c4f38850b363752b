"""Attention of one layer: FP8 window + sparse compressed entries in one softmax with a sink.

K and V are the same `head_dim` latent (one KV head). Queries: wq_a -> q_norm -> wq_b (+ an
optional weightless per-head RMS norm, off for V4.1), RoPE on the last rope dims. Output:
inverse RoPE on the rope dims at the query position, then the grouped low-rank projection
(wo_a per group of heads, wo_b). Per-layer role (from the config): 'swa' (window only), 'full'
(compressor + index keys + own top-k), 'reindex' (own indexer queries inside the candidate pool),
'reuse' (KV and indices of the latest sources at or below it; owns no cache).
Entries come from the layer's `Compressor`, the sparse selection from its `Indexer` (or, on a
Reuse layer, from the index source's selection of the same pass); caches from `KVCache`.
"""
from __future__ import annotations

import torch
from torch import nn

from cedlm.config import ModelConfig
from cedlm.model.compressor import Compressor
from cedlm.model.forward_batch import ForwardBatch
from cedlm.model.indexer import Indexer
from cedlm.model.linear import fuse, project
from cedlm.model.kv_cache import KVCache
from cedlm.model.norm import RMSNorm, rms
from cedlm.model.rope import Rope
from cedlm.model import static_kv
from cedlm.kernels import attention as kernels_attention
from cedlm.kernels.attention import PackedKeys, attend_reference, unpacked
from cedlm.kernels import store_round

cedlm_ops = torch.ops.cedlm


def attend(q, win_k, win_valid, comp_k, comp_valid, sink, scale, dense: bool, return_probs: bool = False):
    """One softmax over [window keys || compressed keys] plus a per-head sink logit.

    q [B,T,H,hd]; win_k [B,W,hd], win_valid [B,T,W]; sink [H].
    dense=False: comp_k [B,T,k,hd] gathered per query, comp_valid [B,T,k]. Either may also be
    `PackedKeys` (the cache's bytes and an index of the same shape less hd, dense=False only):
    the compiled kernel decodes them inside its loop, the reference reads them decoded.
    dense=True (reference / training): comp_k [B,N,hd] all entries, comp_valid [B,T,N] top-k mask.
    Returns [B, T, H, hd] fp32; with return_probs, also the probabilities of the compressed
    entries [B, H, T, N or k] (indexer distillation). The readable math (the einsums) is
    `attend_reference` in cedlm/kernels/attention.py, shared with the custom op `cedlm::attend`.
    """
    if not (dense or return_probs):   # compiled (attend.h, attend_packed.h), float32 rounding apart
        packed = any(isinstance(k, PackedKeys) for k in (win_k, comp_k))
        kernel = kernels_attention.attend_packed if packed else kernels_attention.attend_sparse
        fast = kernel(q, win_k, win_valid, comp_k, comp_valid, sink, scale)
        if fast is not None:
            return fast
    win_k, comp_k = unpacked(win_k), unpacked(comp_k)     # keys still in their storage bytes
    return attend_reference(q, win_k, win_valid, comp_k, comp_valid, sink, scale, dense, return_probs)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.H, self.hd, self.G = H, hd, cfg.o_groups
        self.ratio = cfg.compress_ratios[layer_id]
        self.role = cfg.role(layer_id)
        self.src = cfg.kv_source_of(layer_id)
        self.isrc = cfg.index_source_of(layer_id)
        # Sparse selection only when the index source scores this layer's own KV source.
        self.sparse = self.isrc is not None and cfg.kv_source_of(self.isrc) == self.src
        self.is_global_source = layer_id == cfg.decoder_start
        self.attn_sink = nn.Parameter(torch.zeros(H))
        self.wq_a = nn.Linear(D, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, H * hd, bias=False)
        self.wkv = nn.Linear(D, hd, bias=False)
        self.kv_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.wo_a = nn.Linear(H * hd // self.G, self.G * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(self.G * cfg.o_lora_rank, D, bias=False)
        if self.role == "full":
            self.compressor = Compressor(cfg, layer_id)
        if layer_id in cfg.index_source_layer_ids:
            self.indexer = Indexer(cfg, layer_id)
        self.rope = Rope(cfg.qk_rope_head_dim, cfg.rope_theta_of(layer_id),
                         cfg.rope_scaling if cfg.uses_yarn(layer_id) else None,
                         cfg.rope_precision)

    # ---------------------------------------------------------------- queries and KV production
    def queries(self, qb: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The heads' queries from wq_b's product qb [B, T, H * hd] at positions pos [B, T]:
        [B, T, H, hd] (optional per-head norm, RoPE)."""
        q = qb.unflatten(-1, (self.H, self.hd))
        if self.cfg.q_head_norm:
            q = rms(q, self.cfg.rms_norm_eps)
        return self.rope.apply(q, pos.unsqueeze(-1))

    def window_latent(self, kv: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """A window row from wkv's product kv [B, T, hd]: normalised, RoPE at pos."""
        return self.rope.apply(self.kv_norm(kv), pos)

    def window_rows(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return store_round(self.window_latent(self.wkv(x), pos), self.cfg.window_kv_format, self.training)

    def compress(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> None:
        idx = self.indexer if hasattr(self, "indexer") and self.indexer.has_keys else None
        self.compressor.compress(x, batch, cache, idx)

    def write_global(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> None:
        """Encoder pass of the global-KV source: window rows and global entries for every token."""
        kv = self.window_rows(x, batch.positions)
        cache.push_stash(self.layer_id, kv, batch.positions)        # before the ring is written
        cache.window(self.layer_id, kv, batch.positions)
        if not batch.replay:
            self.compress(x, batch, cache)

    def _probed(self, probe, q, win_k, win_valid, comp_k, comp_valid, cache, pos):
        """`attend` that also gives its index source's probe this layer's attention over the
        compressed entries (and, with sparse selection, the attention it would give every visible
        entry, for the top-k recall)."""
        o, p = attend(q, win_k, win_valid, comp_k, comp_valid, self.attn_sink, self.hd ** -0.5,
                      dense=True, return_probs=True)
        dense_p = None
        if not probe.dense:
            visible = cache.entry_ends(self.src).unsqueeze(1) <= pos.unsqueeze(-1)
            with torch.no_grad():
                dense_p = attend(q, win_k, win_valid, comp_k, visible, self.attn_sink,
                                 self.hd ** -0.5, dense=True, return_probs=True)[1]
        probe.add_attention(self.isrc, p, dense_p)
        return o

    # ---------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """x: normalised attention input [B, T, D] at batch.positions -> [B, T, D]."""
        cfg, pos = self.cfg, batch.positions
        B, T, _ = x.shape
        qr = self.q_norm(self.wq_a(x))
        q = self.queries(self.wq_b(qr), pos)                                     # [B, T, H, hd]
        if self.is_global_source:                   # window rows were written in the encoder pass
            win_k, win_pos = cache.global_window(self.layer_id)
        else:
            win_k, win_pos = cache.window_keys(self.layer_id, self.window_rows(x, pos), pos)
            if self.role == "full" and not batch.replay:
                self.compress(x, batch, cache)
        qp, kp = pos.unsqueeze(-1), win_pos.unsqueeze(1)
        win_valid = (kp >= 0) & (kp <= qp) & (kp > qp - cfg.sliding_window)    # [B, T, W]
        comp_k = comp_valid = None
        # Every entry is read densely, with a mask: the training cache, and a config whose
        # index_topk covers any context (it selects every entry: the fidelity reference).
        dense = cache.dense or cfg.index_topk >= cfg.max_position_embeddings
        if self.ratio > 0:
            if self.sparse:
                idx, valid = (self.indexer.select(qr, x, batch, cache) if self.role in ("full", "reindex")
                              else batch.selection.topk[self.isrc])             # Reuse
            else:                                        # no indexer: every visible entry
                ends = cache.entry_ends(self.src)
                N = ends.shape[1]
                idx = torch.arange(N, device=ends.device).expand(B, T, N)
                valid = ends.unsqueeze(1) <= pos.unsqueeze(-1)
            if dense:
                comp_k = cache.all_kv(self.src)
                comp_valid = torch.zeros(B, T, comp_k.shape[1], dtype=torch.bool, device=idx.device)
                comp_valid.scatter_(-1, idx, valid)
            else:
                comp_k, comp_valid = cache.selected_kv(self.src, idx), valid
        if batch.probe is not None and cache.dense and self.sparse:       # indexer distillation
            o = self._probed(batch.probe, q, win_k, win_valid, comp_k, comp_valid, cache, pos)
        else:
            o = attend(q, win_k, win_valid, comp_k, comp_valid, self.attn_sink,
                       self.hd ** -0.5, dense=dense)
        return self.output(o, pos, x.dtype)

    def output(self, o: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The heads' outputs o [B, T, H, hd] at positions pos [B, T] -> [B, T, D]: RoPE undone,
        then the grouped output projection (the decode, verify and draft steps end the same way)."""
        B, T = o.shape[:2]
        o = self.rope.apply(o, pos.unsqueeze(-1), inverse=True).to(dtype)
        # Grouped output: heads split into G contiguous groups, each projected to o_lora_rank.
        o = o.reshape(B, T, self.G, self.H // self.G * self.hd)                 # [B, T, G, H/G*hd]
        wa = self.wo_a.weight.view(self.G, -1, o.shape[-1])                     # [G, r, H/G*hd]
        o = torch.einsum("btgi,gri->btgr", o, wa).flatten(2)                    # [B, T, G*r]
        return self.wo_b(o)

    # ---------------------------------------------------------------- the static step
    def project(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every product of x and of qr = q_norm(x wq_a): {"wq_a", "wkv", the compressor's
        "c_wkv", "c_wgate", the indexer's "ix_w", "wq_b", "ix_q"}, one matrix product for each
        input (`fuse`)."""
        P = project(self.fused_x, x)
        P.update(project(self.fused_qr, self.q_norm(P["wq_a"])))
        return P

    def step(self, shapes, x: torch.Tensor, p1: torch.Tensor, io: dict) -> torch.Tensor:
        """This layer's attention in the static step (`model.decode_step`): x [B, T, D] at positions
        p1 [B, T] -> [B, T, D]. io: the layer's caches as static tensors ("ring", "ring_pos",
        "table"; a KV source's "count", "pending", "idx_pool"; a reader's "kv_pool" and its
        source's "comp"; the selection's inputs; "window_valid" to replace the window's causal
        mask), and what it produces: "window" (the rows' ring bytes), a source's "comp",
        "entries", "pending", "idx_rows", a selecting layer's "topk" (`model.decode_step`)."""
        B, T = p1.shape
        P = self.project(x)
        q = self.queries(P["wq_b"], p1)
        row = static_kv.encode_rows(self.window_latent(P["wkv"], p1), shapes.window_fmt)   # [B, T, wb]
        io["window"] = row
        keys, win_idx, win_valid = static_kv.window(io["ring"], io["ring_pos"], row, p1,
                                                   self.cfg.sliding_window)
        win_valid = io.get("window_valid", win_valid)      # the draft step's (non-causal) mask
        if self.role == "full":
            io["comp"] = self.compressor.step(shapes, P, p1, io, getattr(self, "indexer", None))
        kv_fmt = shapes.kv_fmt.get(self.src, shapes.window_fmt)
        comp_rows = keys.new_zeros(1, shapes.row_width.get(self.src, keys.shape[-1]))
        comp_idx = torch.zeros(B, T, 0, dtype=torch.int64, device=x.device)
        comp_valid = torch.zeros(B, T, 0, dtype=torch.bool, device=x.device)
        if self.ratio > 0:
            n_vis, n, main, emit = io["comp"]          # n_vis [B, T]; main [B, G, w], emit [B, G]
            if self.sparse:
                if self.role in ("full", "reindex"):
                    io["topk"] = self.indexer.step_select(shapes, P, p1, n_vis, io)
                idx, valid = io["topk"]                                            # [B, T, k]
            else:                                   # every visible entry, gathered once for the rows
                N = io["table"].shape[1] * io["kv_pool"].shape[1]
                idx = torch.arange(N, device=x.device).expand(B, 1, N)
                valid = idx < n_vis.view(B, T, 1)
            rows = static_kv.selected_rows(io["kv_pool"], io["table"], idx, n, main)   # [B, k, w]
            k = rows.shape[1]
            comp_rows, comp_valid = rows.reshape(B * k, -1), valid.expand(B, T, -1)
            comp_idx = torch.arange(B * k, device=x.device).view(B, -1, idx.shape[-1]).expand(B, T, -1)
        # one kernel: the FP8 window rows and the selected FP4 entries decoded inside its loop
        o = cedlm_ops.attend_packed(q.float(), keys, win_idx, win_valid, shapes.window_fmt,
                                    comp_rows, comp_idx, comp_valid, kv_fmt, self.attn_sink.float(),
                                    self.hd ** -0.5)
        return self.output(o, p1, x.dtype)

    def fuse(self) -> None:
        """The weights that multiply the same input concatenated into one matrix, the modules'
        parameters made views of it (same storage, nothing copied twice): of x (wq_a, wkv, the
        compressor's wkv and wgate, the indexer's weights_proj), of qr (wq_b, the indexer's
        wq_b). One matrix product instead of up to five (`project`)."""
        if getattr(self, "fused_x", None) is not None:
            return
        xs = [("wq_a", self.wq_a), ("wkv", self.wkv)]
        if self.role == "full":
            xs.append(("c_wkv", self.compressor.wkv))
            if self.compressor.wgate is not None:
                xs.append(("c_wgate", self.compressor.wgate))
        qrs = [("wq_b", self.wq_b)]
        if hasattr(self, "indexer"):
            xs.append(("ix_w", self.indexer.weights_proj))
            qrs.append(("ix_q", self.indexer.wq_b))
        self.fused_x, self.fused_qr = fuse(xs), fuse(qrs)

