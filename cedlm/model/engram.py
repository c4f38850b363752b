"""Engram: hashed n-gram memory added to the mHC copies before attention.

For n = 2..max_ngram and each of `engram_n_heads` heads, the n-gram of compressed token ids
ending at t is hashed (multiplicative-XOR with per-layer odd multipliers, then modulo a distinct
prime per (n, head)); every bucket lives in one offset table of sum(primes) rows. The looked-up
rows are concatenated ([(max_n-1)*heads*head_dim]) and projected by `wkv` to one key per mHC copy
plus one shared value; copy j gets  h_j += sigmoid(signed_sqrt(<norm(key_j), norm(h_j)> / sqrt(D))) * value.
Row indices depend only on token ids, so they are computed (and rows can be fetched from host
memory or a memory-mapped table) before the layer runs: see `EngramHasher`. The token id ->
compressed id map comes from the tokenizer: `cedlm.text.engram_map` (set by
`cedlm.checkpoint.set_token_map`).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from cedlm.config import ModelConfig
from cedlm.config.engram_sizes import engram_primes


class EngramHasher(nn.Module):
    """Token ids (with history) -> table row indices. Pure integer arithmetic, no parameters: its
    constants (primes, offsets, multipliers) are non-persistent buffers, so they move with the
    model to its device and stay out of the state dict."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.max_n, self.n_heads = cfg.engram_max_ngram_size, cfg.engram_n_heads
        primes = engram_primes(cfg.engram_layer_ids, cfg.engram_vocab_size, self.max_n, self.n_heads)
        flat = [p for per_n in primes[layer_id] for p in per_n]           # order: n, then head
        self.register_buffer("primes", torch.tensor(flat, dtype=torch.int64), persistent=False)
        self.register_buffer("offsets", torch.tensor([0] + list(np.cumsum(flat)[:-1]), dtype=torch.int64),
                             persistent=False)
        # Odd multipliers per look-back shift, seeded 10007 * layer_id, bounded so that
        # compressed_id * multiplier fits in int64 (as vLLM's deepseek_v41 engram.py does).
        rng = np.random.default_rng(10007 * layer_id)
        half = (np.iinfo(np.int64).max // cfg.engram_compressed_vocab_size) // 2
        self.register_buffer("mult", torch.tensor(rng.integers(0, half, size=self.max_n) * 2 + 1,
                                                  dtype=torch.int64), persistent=False)

    def rows(self, cids: torch.Tensor, history: int, dead: torch.Tensor | None = None,
             pad_id: int = 0) -> torch.Tensor:
        """cids: [B, history + T] compressed ids (history = max_n - 1 leading ids, padded);
        returns [B, T, (max_n-1)*heads] global row indices. `dead` [B, history + T] (image-span
        tokens) breaks n-grams as the reference does: from the first dead token looking back
        from t (t itself included), that token and every earlier one hash as `pad_id`."""
        T = cids.shape[1] - history
        out = []
        blocked = None
        cur = cids[:, history:]
        if dead is not None:
            blocked = dead[:, history:]
            cur = torch.where(blocked, pad_id, cur)
        mix = cur * self.mult[0]
        for n in range(2, self.max_n + 1):
            k = n - 1                                           # position t-k in the n-gram
            prev = cids[:, history - k: history - k + T]
            if blocked is not None:
                blocked = blocked | dead[:, history - k: history - k + T]
                prev = torch.where(blocked, pad_id, prev)
            mix = torch.bitwise_xor(mix, prev * self.mult[k])
            out.append(mix.unsqueeze(-1).expand(*mix.shape, self.n_heads))
        h = torch.cat(out, dim=-1)                              # [B, T, (max_n-1)*heads]
        return h % self.primes + self.offsets


class Engram(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        i = cfg.engram_layer_ids.index(layer_id)
        D, n = cfg.hidden_size, cfg.hc_mult
        self.D, self.n, self.eps = D, n, cfg.rms_norm_eps
        self.hasher = EngramHasher(cfg, layer_id)
        n_buckets = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        self.embed = nn.Embedding(cfg.engram_num_embeddings[i], cfg.engram_head_dim)
        self.wkv = nn.Linear(n_buckets * cfg.engram_head_dim, D * (n + 1), bias=False)
        self.q_weight = nn.Parameter(torch.ones(n, D))     # RMSNorm weights of the copies h_j
        self.k_weight = nn.Parameter(torch.ones(n, D))     # RMSNorm weights of the keys
        nn.init.normal_(self.embed.weight, std=cfg.initializer_range)
        nn.init.normal_(self.wkv.weight, std=cfg.initializer_range)

    host_table = None           # np.memmap of the table when offloaded (see `offload`)

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [B, T, buckets] -> concatenated embeddings [B, T, buckets * head_dim].

        The indices come from token ids alone, so the caller runs this before the layer (a
        prefetch); with an offloaded table (host memory, the seeds' design beside a model on the
        GPU) the rows are gathered on the host, only the touched rows are read from the file,
        and only the gathered rows move to the model's device."""
        if self.host_table is not None:
            flat = np.asarray(self.host_table[rows.reshape(-1).cpu().numpy()])
            out = torch.from_numpy(flat).view(*rows.shape, -1).flatten(-2)
            return out.to(self.wkv.weight.device, non_blocking=True)
        return self.embed(rows).flatten(-2)

    def offload(self, path) -> None:
        """Move the table to a memory-mapped .npy file (inference): the table then lives in the
        page cache / on disk, not in the model's parameters (its state_dict entry goes away)."""
        path = str(path)
        np.save(path, self.embed.weight.detach().float().cpu().numpy())
        self.host_table = np.load(path if path.endswith(".npy") else path + ".npy", mmap_mode="r")
        del self.embed

    def forward(self, x: torch.Tensor, emb: torch.Tensor, dead: torch.Tensor | None = None) -> torch.Tensor:
        """x: mHC copies [B, T, n, D]; emb: looked-up rows [B, T, buckets*head_dim]; dead [B, T]
        (image-span tokens): their gate is zero, x passes unchanged."""
        kv = self.wkv(emb).unflatten(-1, (self.n + 1, self.D)).float()     # [B, T, n+1, D]
        key, value = kv[..., : self.n, :], kv[..., self.n, :]
        xf = x.float()

        def norm(t, w):
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + self.eps) * w.float()

        dot = (norm(key, self.k_weight) * norm(xf, self.q_weight)).sum(-1) / self.D ** 0.5
        gate = torch.sigmoid(dot.sign() * dot.abs().clamp_min(1e-6).sqrt())   # [B, T, n]
        if dead is not None:
            gate = gate.masked_fill(dead.unsqueeze(-1), 0.0)
        return (xf + gate.unsqueeze(-1) * value.unsqueeze(-2)).to(x.dtype)


def lookup_rows(model, full: torch.Tensor, history: int) -> dict[int, torch.Tensor]:
    """{Engram layer: its looked-up rows [B, T, buckets * head_dim]} for token ids full
    [B, history + T]: each row's `history` previous ids (the pad id before position 0), then the
    rows' own. From token ids alone, before any layer runs (the prefill, the decode, and the
    static steps, where an offloaded table is read on the host before the step)."""
    cfg = model.cfg
    cids = model.engram_token_map[full]
    dead = model.image_mask(full)
    pad = model.engram_token_map[cfg.engram_pad_token_id]      # a 0-d tensor: no .item()
    out = {}
    for l in cfg.engram_layer_ids:
        eng = model.layers[l].engram
        out[l] = eng.lookup(eng.hasher.rows(cids, history) if dead is None else
                            eng.hasher.rows(cids, history, dead, pad))
    return out
