"""The decoder-only baseline: the model the CED model is measured against.

Same width, depth, query path and MoE as the CED config it is built from, but a conventional
decoder-only stack: plain pre-norm residuals, every layer full causal attention over every
previous token with its own K and V (one KV head of head_dim, stored BF16), RoPE on the last
rope dims. No compression, no windows, no indexer, no Engram, no mHC. Its KV grows by
2 * L * head_dim * 2 bytes per token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cedlm.config import ModelConfig
from cedlm.model.moe import MoE
from cedlm.model.norm import RMSNorm
from cedlm.model.rope import Rope


class DecoderOnlyState:
    """BF16 K and V of every layer, grown by doubling: [L, 2, capacity, head_dim], on `device`."""

    def __init__(self, cfg: ModelConfig, capacity: int = 256, device: torch.device | str = "cpu"):
        self.cfg, self.n = cfg, 0
        self.kv = torch.zeros(cfg.n_layers, 2, capacity, cfg.head_dim, dtype=torch.bfloat16, device=device)

    def reserve(self, n: int) -> None:
        if n > self.kv.shape[2]:
            new = torch.zeros(*self.kv.shape[:2], max(n, 2 * self.kv.shape[2]), self.kv.shape[3],
                              dtype=self.kv.dtype, device=self.kv.device)
            new[:, :, : self.n] = self.kv[:, :, : self.n]
            self.kv = new

    def nbytes(self) -> int:
        return self.n * self.cfg.n_layers * 2 * self.cfg.head_dim * 2


class TwinAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.H, self.hd, self.layer_id = H, hd, layer_id
        self.wq_a = nn.Linear(D, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, H * hd, bias=False)
        self.wk = nn.Linear(D, hd, bias=False)
        self.wv = nn.Linear(D, hd, bias=False)
        self.wo = nn.Linear(H * hd, D, bias=False)
        self.rope = Rope(cfg.qk_rope_head_dim, cfg.rope_theta, None)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, state: DecoderOnlyState | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))).unflatten(-1, (self.H, self.hd))
        q = self.rope.apply(q, pos.unsqueeze(-1)).transpose(1, 2)               # [B, H, T, hd]
        k = self.rope.apply(self.wk(x), pos).to(torch.bfloat16)                # stored BF16
        v = self.wv(x).to(torch.bfloat16)
        if state is None:
            k, v, causal = k.unsqueeze(1), v.unsqueeze(1), True
        else:                                   # B == 1: append to the cache, attend to all of it
            n0 = state.n
            state.kv[self.layer_id, 0, n0: n0 + T] = k[0]
            state.kv[self.layer_id, 1, n0: n0 + T] = v[0]
            k = state.kv[self.layer_id, 0, : n0 + T][None, None]
            v = state.kv[self.layer_id, 1, : n0 + T][None, None]
            causal = T > 1
        kf, vf = k.float().expand(B, self.H, -1, -1), v.float().expand(B, self.H, -1, -1)
        if causal and state is not None and state.n > 0:
            L = kf.shape[2]
            mask = torch.ones(T, L, dtype=torch.bool, device=x.device).tril(L - T)
            o = F.scaled_dot_product_attention(q.float(), kf, vf, attn_mask=mask)
        else:
            o = F.scaled_dot_product_attention(q.float(), kf, vf, is_causal=causal)
        return self.wo(o.transpose(1, 2).flatten(2).to(x.dtype))


class TwinBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = TwinAttention(cfg, layer_id)
        self.ffn = MoE(cfg)

    def forward(self, x, pos, state):
        x = x + self.attn(self.attn_norm(x), pos, state)
        return x + self.ffn(self.ffn_norm(x))


class DecoderOnlyModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TwinBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if name.endswith(".weight") and p.dim() == 2:
                nn.init.normal_(p, std=cfg.initializer_range)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.cfg.n_layers * self.cfg.head_dim * 2

    def _run(self, ids: torch.Tensor, pos: torch.Tensor, state: DecoderOnlyState | None) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, pos, state)
        return self.head(self.norm(x)).float()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        B, S = input_ids.shape
        return self._run(input_ids, torch.arange(S, device=input_ids.device).expand(B, S), None)

    def new_state(self) -> DecoderOnlyState:
        return DecoderOnlyState(self.cfg, device=self.device)

    @torch.no_grad()
    def prefill(self, input_ids, state: DecoderOnlyState, mode: str = "full", chunk_size=None) -> torch.Tensor:
        ids = torch.as_tensor(input_ids, dtype=torch.int64, device=self.device).flatten()[None]
        T = ids.shape[1]
        state.reserve(state.n + T)
        out = self._run(ids, torch.arange(state.n, state.n + T, device=self.device)[None], state)
        state.n += T
        return out[0]

    @torch.no_grad()
    def decode(self, input_ids, states: list[DecoderOnlyState]) -> torch.Tensor:
        outs = []
        for t, st in zip(torch.as_tensor(input_ids, device="cpu").flatten().tolist(), states):
            outs.append(self.prefill([t], st)[-1])
        return torch.stack(outs)

    def num_parameters(self, exclude_engram: bool = False) -> int:
        return sum(p.numel() for p in self.parameters())      # no Engram in the baseline
