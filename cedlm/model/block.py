"""One layer of the stack: Engram (on its layers), then attention and MoE, each a sub-layer of the
mHC residual copies (`mhc.py`). `forward` runs a pass over a `KVCache` backend (training,
prefill, the eager decode); `step` runs the static step over `static_kv` tensors (the decode,
verify and draft steps, compiled whole or one region per `kind`)."""
from __future__ import annotations

import torch
from torch import nn

from cedlm.config import ModelConfig
from cedlm.model.attention import Attention
from cedlm.model.engram import Engram
from cedlm.model.forward_batch import ForwardBatch
from cedlm.model.kv_cache import KVCache
from cedlm.model.mhc import add_hc_params, collapse, expand, sublayer_mixes
from cedlm.model.moe import MoE
from cedlm.model.norm import RMSNorm


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        D, n = cfg.hidden_size, cfg.hc_mult
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(D, cfg.rms_norm_eps)
        add_hc_params(self, n, D)
        self.attn = Attention(cfg, layer_id)
        self.ffn = MoE(cfg)
        if layer_id in cfg.engram_layer_ids:
            self.engram = Engram(cfg, layer_id)

    def mixes(self, x: torch.Tensor, sub: str):
        return sublayer_mixes(self, x, sub, self.cfg)

    def forward(self, x: torch.Tensor, pre: torch.Tensor, batch: ForwardBatch, cache: KVCache):
        """x: mHC copies [B, T, n, D]; pre: the previous sub-layer's pre [B, T, n]."""
        if hasattr(self, "engram"):
            x = self.engram(x, batch.engram_rows[self.layer_id], batch.image_mask)
        pre_a, post, comb = self.mixes(x, "attn")
        x = expand(x, self.attn(self.attn_norm(collapse(x, pre)), batch, cache), post, comb)
        pre_f, post, comb = self.mixes(x, "ffn")
        x = expand(x, self.ffn(self.ffn_norm(collapse(x, pre_a)), batch.image_mask), post, comb)
        return x, pre_f

    def write_global(self, x: torch.Tensor, pre: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> None:
        self.attn.write_global(self.attn_norm(collapse(x, pre)), batch, cache)

    def step(self, shapes, x: torch.Tensor, pre: torch.Tensor, p1: torch.Tensor, io: dict,
             engram: torch.Tensor | None, image: torch.Tensor | None):
        """`forward` in the static step (`decode_step`): the caches are io's static tensors
        (`Attention.step`), what the layer produces goes into io (and its experts, "experts")."""
        if hasattr(self, "engram"):
            x = self.engram(x, engram, image)
        pre_a, post, comb = self.mixes(x, "attn")
        x = expand(x, self.attn.step(shapes, self.attn_norm(collapse(x, pre)), p1, io), post, comb)
        pre_f, post, comb = self.mixes(x, "ffn")
        f, io["experts"] = self.ffn.step(self.ffn_norm(collapse(x, pre_a)), image)
        return expand(x, f, post, comb), pre_f

    def kind(self) -> tuple:
        """What the static step's graph of this layer depends on besides tensor shapes: layers of
        one kind run one compiled region (`compiled_step`, regions)."""
        a, cfg = self.attn, self.cfg
        ix = getattr(a, "indexer", None)
        lay = None if a.ratio == 0 else (cfg.compress_ratios[a.src], cfg.main_kv_format)
        return (a.role, a.ratio, a.sparse, lay, hasattr(self, "engram"),
                None if ix is None else (ix.has_keys, ix.in_pool, ix.layer_id == cfg.candidate_source_layer_id,
                                         cfg.index_kv_format),
                cfg.rope_theta_of(self.layer_id), cfg.uses_yarn(self.layer_id))
