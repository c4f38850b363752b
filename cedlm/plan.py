"""Accounting and capacity planning: KV bytes, window bytes, parameter counts, sequences that fit.

Everything here is computed from a `ModelConfig` alone (no model is built), so the same code
serves the official full-size configs and the small runnable presets. For the runnable presets
the numbers are pinned to what the code allocates (tests compare them with `SequenceState.nbytes()`
and `CEDModel.num_parameters()`).

    entry_bytes(cfg, fmt, dim)        bytes of one stored entry in a KV format
    kv_bytes_per_token(cfg)           global (context-proportional) KV bytes per token, by part
    window_bytes_per_sequence(cfg)    fixed per-sequence bytes: SWA rings, DSpark rings, compressor
    param_inventory(cfg)              every parameter tensor (name, shape, group, layer)
    param_counts(cfg)                 total / Engram / DSpark / vision / active prefill & decode
    plan(cfg, context, memory_gib)    the whole account plus sequences that fit (JSON-stable keys)
    format_plan(plan_dict)            a human table
    add_parser(subparsers) / main()   the `cedlm plan` command (`python -m cedlm.plan ...`)

Conventions (also listed in each plan's `assumptions`):

* GiB = 2^30 bytes, MiB = 2^20 bytes.
* A token's global KV is the sum over KV-source layers of (entry bytes / compress ratio) for the
  main KV and, where the source owns index keys, the index keys. Reuse/Reindex layers own nothing.
* `bytes_per_sequence` at context C = sum over sources of floor(C / r) entries (what is allocated;
  equals kv_bytes_per_token x C when C is a multiple of every ratio) + the SWA rings of every
  layer + the DSpark rings + the largest compressor pending state. Token ids, ring positions and
  allocator slack are not counted.
* Parameters are learnable weights, counted as numbers of elements. Router selection biases
  (`ffn.gate.bias`, `ffn.gate.bias_vl`) are buffers in cedlm and not counted (they are 2 x experts
  per layer, negligible); `.scale` tensors of the quantised checkpoint are not parameters.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections import namedtuple
from fractions import Fraction
from pathlib import Path

from cedlm.config import ConfigError, ModelConfig

GIB = 1 << 30
MIB = 1 << 20

# The concurrency example: one accelerator's memory given entirely to KV (weights excluded: they
# live on other devices of an expert/tensor-parallel group, or in host memory), minus a reserve
# for the runtime, activations and workspace. Memory is the nominal HBM size in GiB.
DEVICES = {
    "NVIDIA H100 80GB": {"memory_gib": 80, "reserve_fraction": 0.10},
    "Ascend 910B 64GB": {"memory_gib": 64, "reserve_fraction": 0.10},
}
EXAMPLE_MODELS = ("deepseek-v4.1-flash", "deepseek-v4-flash", "deepseek-llm-67b")
EXAMPLE_CONTEXTS = (1 << 20, 128 * 1024)

PLAN_KEYS = (
    "model", "family", "kv_bytes_per_token", "kv_bytes_per_token_parts", "kv_bytes_alternatives",
    "window_bytes_per_sequence", "dspark_window_bytes_per_sequence",
    "compressor_state_bytes_per_sequence", "params_total", "params_engram", "params_dspark",
    "params_vision", "params_active_prefill", "params_active_decode", "params_detail", "context",
    "memory_gib", "bytes_per_sequence", "max_sequences", "assumptions", "concurrency_example",
)


def _num(x):
    """A Fraction/int as a JSON number: an int when integral (890, not 890.0), else a float."""
    x = Fraction(x)
    return int(x) if x.denominator == 1 else float(x)


# ============================================================================ KV bytes
V4_INDEX_ASSUMPTION = ("V4-Flash index keys: format unverified; assumed FP4 like V4.1 "
                       "(index_fp4, 68 B per 128-dim entry); FP8 + FP32 scale (132 B) would add "
                       "about twice as much")


def entry_bytes(cfg: ModelConfig, fmt: str, dim: int) -> int:
    """Bytes of one stored entry of `dim` values in KV format `fmt`.

    kv_fp4 / index_fp4 / window_fp8 come from `cedlm.quant` (288 / 68 / 528 at 512 / 128 / 512).
    v4_fp8 is DeepSeek V4's MODEL1 layout: FP8 NoPE + BF16 RoPE + one UE8M0 per 64 NoPE dims +
    1 pad byte (584 at 512 dims, kv-layouts.md section 2). bf16 is 2 bytes per dim.
    """
    from cedlm.quant import FORMATS, bytes_per_entry
    if fmt in FORMATS:
        return bytes_per_entry(fmt, dim)
    if fmt == "v4_fp8":
        nope = dim - cfg.qk_rope_head_dim
        if nope % 64:
            raise ConfigError(f"head_dim: v4_fp8 needs NoPE dims ({nope}) in whole 64-dim tiles")
        return nope + 2 * cfg.qk_rope_head_dim + nope // 64 + 1
    if fmt == "bf16":
        return 2 * dim
    raise ConfigError(f"main_kv_format: no byte size for KV format {fmt!r}")


def _mla_fp8_sparse_bytes(cfg: ModelConfig) -> int:
    """V3.2 FP8 sparse MLA entry: FP8 latent + BF16 RoPE + one FP32 scale per 128 (656 for V3)."""
    return cfg.kv_lora_rank + 2 * cfg.qk_rope_head_dim + cfg.kv_lora_rank // 128 * 4


def kv_bytes_per_token(cfg: ModelConfig) -> dict:
    """Global (context-proportional) KV bytes per token.

    Returns {"total", "parts": [{part, format, ratio, layers, n_layers, entry_bytes,
    bytes_per_token}], "headline", "alternatives": {name: total}, "assumptions": [...]}.
    "ced"/"v4": per KV-source layer, main KV entry / ratio, plus index keys / ratio where the source
    owns them; parts grouped by (kind, ratio) in layer order. "mla": the V3.2 FP8 sparse latent
    (headline) or BF16 MLA latent per layer. "llama": K and V, BF16, per KV head per layer.
    """
    assumptions: list[str] = []
    parts: list[dict] = []
    alternatives: dict = {}
    fam = cfg.family
    if fam in ("ced", "v4"):
        headline = f"compressed main KV ({cfg.main_kv_format}) + index keys ({cfg.index_kv_format})"
        groups: dict[tuple, list[int]] = {}
        for s in cfg.kv_source_layer_ids:
            groups.setdefault(("main_kv", cfg.compress_ratios[s]), []).append(s)
        for s in cfg.index_key_layer_ids:
            groups.setdefault(("index_keys", cfg.compress_ratios[s]), []).append(s)
        fmts = {"main_kv": (cfg.main_kv_format, cfg.head_dim),
                "index_keys": (cfg.index_kv_format, cfg.index_head_dim)}
        for (kind, r), layers in sorted(groups.items(), key=lambda kv: (kv[0][0] != "main_kv",
                                                                         kv[1][0])):
            fmt, dim = fmts[kind]
            eb = entry_bytes(cfg, fmt, dim)
            parts.append({"part": kind, "format": fmt, "ratio": r, "layers": layers,
                          "n_layers": len(layers), "entry_bytes": eb,
                          "bytes_per_token": _num(Fraction(eb * len(layers), r))})
        if fam == "v4":
            assumptions.append(V4_INDEX_ASSUMPTION)
            eb = entry_bytes(cfg, cfg.main_kv_format, cfg.head_dim)
            assumptions.append(f"V4-Flash main KV: {eb} B {cfg.main_kv_format} entries (MODEL1 "
                               "layout: FP8 NoPE, BF16 RoPE) on every compressed layer, each its "
                               "own KV source")
    elif fam == "mla":
        eb = _mla_fp8_sparse_bytes(cfg)
        bf16 = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
        L = cfg.n_layers
        headline = "V3.2 FP8 sparse MLA latent (656 B layout)"
        parts.append({"part": "mla_latent", "format": "v32_fp8_sparse", "ratio": 1,
                      "layers": list(range(L)), "n_layers": L, "entry_bytes": eb,
                      "bytes_per_token": eb * L})
        alternatives["mla_bf16"] = bf16 * L
        assumptions.append(f"V3 headline uses the V3.2 FP8 sparse MLA layout ({eb} B/token/layer x "
                           f"{L}); the BF16 MLA cache ({cfg.kv_lora_rank}+{cfg.qk_rope_head_dim} "
                           f"dims x 2 B = {bf16} B/token/layer) gives {bf16 * L:,} B/token")
        assumptions.append("V3 MTP layer's own KV (one more layer, used only for speculative "
                           "decoding) is not included")
    elif fam == "llama":
        L, kvh, hd = cfg.n_layers, cfg.num_key_value_heads, cfg.head_dim
        headline = "K and V, BF16, every layer (full KV)"
        for kind in ("k", "v"):
            parts.append({"part": kind, "format": "bf16", "ratio": 1, "layers": list(range(L)),
                          "n_layers": L, "entry_bytes": kvh * hd * 2,
                          "bytes_per_token": kvh * hd * 2 * L})
    else:                                             # pragma: no cover (validate() rejects it)
        raise ConfigError(f"family: unknown {fam!r}")
    total = sum(Fraction(p["bytes_per_token"]) for p in parts)
    return {"total": _num(total), "parts": parts, "headline": headline,
            "alternatives": alternatives, "assumptions": assumptions}


def window_bytes_per_sequence(cfg: ModelConfig) -> dict:
    """Fixed per-sequence bytes (independent of context length once the ring is full).

    window: every layer's SWA ring, n_layers x sliding_window x window entry bytes (the ring is
    allocated whole, as `SequenceState` does). dspark_window: the same for the
    num_nextn_predict_layers DSpark/MTP blocks (SWA only; not built by cedlm yet).
    compressor_state: the largest pending state, (r - 1) fp32 rows of kv and gate projections
    (head_dim each) per ratio-r (> 1) KV source: what `SequenceState.pending` holds just before a
    group completes. mla/llama keep full KV in every layer: all zero.
    """
    out = {"window": 0, "dspark_window": 0, "compressor_state": 0, "assumptions": []}
    if cfg.family not in ("ced", "v4"):
        return out
    wb = entry_bytes(cfg, cfg.window_kv_format, cfg.head_dim)
    out["window_entry_bytes"] = wb
    out["window"] = cfg.n_layers * cfg.sliding_window * wb
    out["dspark_window"] = cfg.num_nextn_predict_layers * cfg.sliding_window * wb
    out["compressor_state"] = sum((cfg.compress_ratios[s] - 1) * 2 * cfg.head_dim * 4
                                  for s in cfg.kv_source_layer_ids if cfg.compress_ratios[s] > 1)
    if cfg.family == "v4":
        out["assumptions"].append(
            f"V4-Flash window and MTP rings use the config's window format "
            f"({cfg.window_kv_format}, {wb} B/entry) as cedlm's twin stores them; V4's own SWA "
            f"cache uses the 584 B MODEL1 layout (+{(584 - wb) * (cfg.n_layers + cfg.num_nextn_predict_layers) * cfg.sliding_window:,} B/sequence)"
            if cfg.head_dim == 512 else
            f"V4 window format: the config's {cfg.window_kv_format} ({wb} B/entry)")
        out["assumptions"].append(
            "V4-Flash compressor state: cedlm's twin (non-overlapping groups, no indexer "
            "compressor); V4's overlapping ratio-4 compressor and indexer compressor hold more")
    return out


# ============================================================================ parameters
Tensor = namedtuple("Tensor", "name shape group layer")
"""group: embed | head | norm | hc | attn | compressor | indexer | router | shared_expert |
routed_expert | engram_table | engram | dspark | vision. layer: decoder layer index, or None."""

# Parts of the global-KV source (the first decoder layer) that run on EVERY prompt token in the
# encoder pass (`Block.write_global`): attn_norm, the window projection and the compressor / index
# keys. Its hc_attn is not needed: the collapse uses the pre carried from the previous layer.
GLOBAL_KV_PARTS = ("attn_norm.weight", "attn.wkv.weight", "attn.kv_norm.weight",
                   "attn.compressor.", "attn.indexer.wk.weight", "attn.indexer.k_norm.weight")


def _numel(shape) -> int:
    return math.prod(shape)


def _ced_block(cfg: ModelConfig, L: int | None, prefix: str, group: str | None, *,
               swa_only: bool, n_experts: int, checkpoint: bool):
    """One CED/V4 block's tensors (mirrors cedlm.model.model.Block)."""
    D, n, H, hd = cfg.hidden_size, cfg.hc_mult, cfg.num_attention_heads, cfg.head_dim
    q, G, o, I = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank, cfg.moe_intermediate_size
    out = []

    def t(name, shape, g):
        out.append(Tensor(prefix + name, tuple(shape), group or g, L))

    t("attn_norm.weight", (D,), "norm")
    t("ffn_norm.weight", (D,), "norm")
    for sub in ("attn", "ffn"):
        t(f"hc_{sub}_fn", ((2 + n) * n, n * D), "hc")
        t(f"hc_{sub}_base", ((2 + n) * n,), "hc")
        t(f"hc_{sub}_scale", (3,), "hc")
    t("attn.attn_sink", (H,), "attn")
    t("attn.wq_a.weight", (q, D), "attn")
    t("attn.q_norm.weight", (q,), "attn")
    t("attn.wq_b.weight", (H * hd, q), "attn")
    t("attn.wkv.weight", (hd, D), "attn")
    t("attn.kv_norm.weight", (hd,), "attn")
    t("attn.wo_a.weight", (G * o, H * hd // G), "attn")
    t("attn.wo_b.weight", (D, G * o), "attn")
    v4 = checkpoint and cfg.family == "v4"
    if not swa_only:
        r = cfg.compress_ratios[L]
        ih, idim = cfg.index_n_heads, cfg.index_head_dim
        if cfg.role(L) == "full":
            # V4 (checkpoint): the ratio-4 compressor overlaps windows (2 x head_dim wide) and
            # carries an absolute position bias `ape` [ratio, width]; V4.1 dropped both.
            w = hd * (2 if v4 and r == 4 else 1)
            t("attn.compressor.wkv.weight", (w, D), "compressor")
            if r > 1:
                t("attn.compressor.wgate.weight", (w, D), "compressor")
            t("attn.compressor.norm.weight", (hd,), "compressor")
            if v4:
                t("attn.compressor.ape", (r, w), "compressor")
        if L in cfg.index_source_layer_ids:
            t("attn.indexer.wq_b.weight", (ih * idim, q), "indexer")
            t("attn.indexer.weights_proj.weight", (ih, D), "indexer")
            if v4:      # V4 index keys come from the indexer's own compressor, not from wk
                wi = idim * (2 if r == 4 else 1)
                t("attn.indexer.compressor.wkv.weight", (wi, D), "indexer")
                t("attn.indexer.compressor.wgate.weight", (wi, D), "indexer")
                t("attn.indexer.compressor.norm.weight", (idim,), "indexer")
                t("attn.indexer.compressor.ape", (r, wi), "indexer")
            elif L in cfg.index_key_layer_ids:
                t("attn.indexer.wk.weight", (idim, hd), "indexer")
                t("attn.indexer.k_norm.weight", (idim,), "indexer")
    t("ffn.gate.weight", (n_experts, D), "router")
    for e in range(n_experts):
        for w, shape in (("w1", (I, D)), ("w2", (D, I)), ("w3", (I, D))):
            t(f"ffn.experts.{e}.{w}.weight", shape, "routed_expert")
    if cfg.n_shared_experts:
        Is = I * cfg.n_shared_experts
        for w, shape in (("w1", (Is, D)), ("w2", (D, Is)), ("w3", (Is, D))):
            t(f"ffn.shared_experts.{w}.weight", shape, "shared_expert")
    if not swa_only and L in cfg.engram_layer_ids:
        i = cfg.engram_layer_ids.index(L)
        buckets = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        t("engram.embed.weight", (cfg.engram_num_embeddings[i], cfg.engram_head_dim), "engram_table")
        t("engram.wkv.weight", (D * (n + 1), buckets * cfg.engram_head_dim), "engram")
        t("engram.q_weight", (n, D), "engram")
        t("engram.k_weight", (n, D), "engram")
    return out


def _ced_inventory(cfg: ModelConfig, checkpoint: bool) -> list[Tensor]:
    D, V, n = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    inv = [Tensor("embed.weight", (V, D), "embed", None)]
    for L in range(cfg.n_layers):
        inv += _ced_block(cfg, L, f"layers.{L}.", None, swa_only=False,
                          n_experts=cfg.n_routed_experts, checkpoint=checkpoint)
    inv.append(Tensor("norm.weight", (D,), "norm", None))
    inv.append(Tensor("head.weight", (V, D), "head", None))
    if checkpoint and cfg.family == "v4":          # V4 head collapses the copies with hc_head_*
        inv += [Tensor("hc_head_fn", (n, n * D), "hc", None),
                Tensor("hc_head_base", (n,), "hc", None),
                Tensor("hc_head_scale", (1,), "hc", None)]
    return inv


def _dspark_inventory(cfg: ModelConfig) -> list[Tensor]:
    """DSpark (V4.1, names of reference/v41-weight-names.txt) or V4 MTP blocks; not built by cedlm."""
    D, V, n = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    S = cfg.num_nextn_predict_layers
    inv: list[Tensor] = []
    if cfg.family == "ced":
        for s in range(S):
            inv += _ced_block(cfg, None, f"mtp.{s}.", "dspark", swa_only=True,
                              n_experts=cfg.dspark_n_routed_experts, checkpoint=True)
        if S:
            taps = len(cfg.dspark_target_layer_ids) or 1
            r = cfg.dspark_markov_rank
            inv += [Tensor("mtp.0.main_proj.weight", (D, taps * D), "dspark", None),
                    Tensor("mtp.0.main_norm.weight", (D,), "dspark", None),
                    Tensor(f"mtp.{S - 1}.norm.weight", (D,), "dspark", None),
                    Tensor(f"mtp.{S - 1}.markov_head.embed.weight", (V, r), "dspark", None),
                    Tensor(f"mtp.{S - 1}.markov_head.head.weight", (V, r), "dspark", None),
                    Tensor(f"mtp.{S - 1}.confidence_head.proj.weight", (1, D + r), "dspark", None)]
    elif cfg.family == "v4":
        for s in range(S):
            p = f"mtp.{s}."
            inv += _ced_block(cfg, None, p, "dspark", swa_only=True,
                              n_experts=cfg.n_routed_experts, checkpoint=True)
            inv += [Tensor(p + "e_proj.weight", (D, D), "dspark", None),
                    Tensor(p + "h_proj.weight", (D, D), "dspark", None),
                    Tensor(p + "enorm.weight", (D,), "dspark", None),
                    Tensor(p + "hnorm.weight", (D,), "dspark", None),
                    Tensor(p + "norm.weight", (D,), "dspark", None),
                    Tensor(p + "hc_head_fn", (n, n * D), "dspark", None),
                    Tensor(p + "hc_head_base", (n,), "dspark", None),
                    Tensor(p + "hc_head_scale", (1,), "dspark", None)]
    return inv


def _mla_layer(cfg: ModelConfig, L, prefix: str, group: str | None, moe: bool) -> list[Tensor]:
    D, H = cfg.hidden_size, cfg.num_attention_heads
    rope, nope = cfg.qk_rope_head_dim, cfg.head_dim - cfg.qk_rope_head_dim
    vdim = cfg.extra.get("flat", {}).get("v_head_dim", nope)
    q, c, I = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.moe_intermediate_size
    out = []

    def t(name, shape, g):
        out.append(Tensor(prefix + name, tuple(shape), group or g, L))

    t("input_layernorm.weight", (D,), "norm")
    t("post_attention_layernorm.weight", (D,), "norm")
    t("self_attn.q_a_proj.weight", (q, D), "attn")
    t("self_attn.q_a_layernorm.weight", (q,), "attn")
    t("self_attn.q_b_proj.weight", (H * (nope + rope), q), "attn")
    t("self_attn.kv_a_proj_with_mqa.weight", (c + rope, D), "attn")
    t("self_attn.kv_a_layernorm.weight", (c,), "attn")
    t("self_attn.kv_b_proj.weight", (H * (nope + vdim), c), "attn")
    t("self_attn.o_proj.weight", (D, H * vdim), "attn")
    if not moe:
        Id = cfg.intermediate_size
        for w, shape in (("gate_proj", (Id, D)), ("up_proj", (Id, D)), ("down_proj", (D, Id))):
            t(f"mlp.{w}.weight", shape, "dense_mlp")
        return out
    t("mlp.gate.weight", (cfg.n_routed_experts, D), "router")
    for e in range(cfg.n_routed_experts):
        for w, shape in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
            t(f"mlp.experts.{e}.{w}.weight", shape, "routed_expert")
    Is = I * cfg.n_shared_experts
    for w, shape in (("gate_proj", (Is, D)), ("up_proj", (Is, D)), ("down_proj", (D, Is))):
        t(f"mlp.shared_experts.{w}.weight", shape, "shared_expert")
    return out


def _mla_inventory(cfg: ModelConfig, mtp: bool) -> list[Tensor]:
    D, V = cfg.hidden_size, cfg.vocab_size
    if mtp:
        inv = []
        for s in range(cfg.num_nextn_predict_layers):
            p = f"model.layers.{cfg.n_layers + s}."
            inv += _mla_layer(cfg, None, p, "dspark", moe=True)
            inv += [Tensor(p + "eh_proj.weight", (D, 2 * D), "dspark", None),
                    Tensor(p + "enorm.weight", (D,), "dspark", None),
                    Tensor(p + "hnorm.weight", (D,), "dspark", None),
                    Tensor(p + "shared_head.norm.weight", (D,), "dspark", None)]
        return inv
    inv = [Tensor("model.embed_tokens.weight", (V, D), "embed", None)]
    for L in range(cfg.n_layers):
        inv += _mla_layer(cfg, L, f"model.layers.{L}.", None, moe=L >= cfg.first_k_dense_replace)
    inv += [Tensor("model.norm.weight", (D,), "norm", None),
            Tensor("lm_head.weight", (V, D), "head", None)]
    return inv


def _llama_inventory(cfg: ModelConfig) -> list[Tensor]:
    D, V, H, kvh, hd = (cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads,
                        cfg.num_key_value_heads, cfg.head_dim)
    Id = cfg.intermediate_size
    inv = [Tensor("model.embed_tokens.weight", (V, D), "embed", None)]
    for L in range(cfg.n_layers):
        p = f"model.layers.{L}."
        inv += [Tensor(p + "input_layernorm.weight", (D,), "norm", L),
                Tensor(p + "post_attention_layernorm.weight", (D,), "norm", L),
                Tensor(p + "self_attn.q_proj.weight", (H * hd, D), "attn", L),
                Tensor(p + "self_attn.k_proj.weight", (kvh * hd, D), "attn", L),
                Tensor(p + "self_attn.v_proj.weight", (kvh * hd, D), "attn", L),
                Tensor(p + "self_attn.o_proj.weight", (D, H * hd), "attn", L),
                Tensor(p + "mlp.gate_proj.weight", (Id, D), "dense_mlp", L),
                Tensor(p + "mlp.up_proj.weight", (Id, D), "dense_mlp", L),
                Tensor(p + "mlp.down_proj.weight", (D, Id), "dense_mlp", L)]
    inv += [Tensor("model.norm.weight", (D,), "norm", None)]
    if not cfg.tie_word_embeddings:
        inv.append(Tensor("lm_head.weight", (V, D), "head", None))
    return inv


def vision_config(cfg: ModelConfig) -> dict | None:
    extra = cfg.extra or {}
    return (extra.get("top") or {}).get("vision_config") or (extra.get("flat") or {}).get(
        "vision_config")


def _vision_inventory(cfg: ModelConfig) -> list[Tensor]:
    """DeepSeek-ViT + aligner + image delimiter rows (reference/v41-weight-names.txt)."""
    vc = vision_config(cfg)
    if not vc:
        return []
    Dv, Iv, p = vc["hidden_size"], vc["intermediate_size"], vc["patch_size"]
    k, D = vc.get("downsample_ratio", 1), cfg.hidden_size
    inv = [Tensor("vision.patch_embed.proj.weight", (Dv, 3 * p * p), "vision", None),
           Tensor("vision.patch_embed.proj.bias", (Dv,), "vision", None)]
    for b in range(vc["num_hidden_layers"]):
        q = f"vision.blocks.{b}."
        inv += [Tensor(q + "norm1.weight", (Dv,), "vision", None),
                Tensor(q + "norm2.weight", (Dv,), "vision", None),
                Tensor(q + "attn.wqkv.weight", (3 * Dv, Dv), "vision", None),
                Tensor(q + "attn.wqkv.bias", (3 * Dv,), "vision", None),
                Tensor(q + "attn.wo.weight", (Dv, Dv), "vision", None),
                Tensor(q + "attn.wo.bias", (Dv,), "vision", None),
                Tensor(q + "mlp.w1.weight", (2 * Iv, Dv), "vision", None),
                Tensor(q + "mlp.w2.weight", (Dv, Iv), "vision", None)]
    inv += [Tensor("vision.norm.weight", (Dv,), "vision", None),
            Tensor("aligner.w1.weight", (D, Dv * k * k), "vision", None),
            Tensor("aligner.w1.bias", (D,), "vision", None),
            Tensor("aligner.w2.weight", (D, D), "vision", None),
            Tensor("aligner.w2.bias", (D,), "vision", None)]
    inv += [Tensor(name, (D,), "vision", None)
            for name in ("image_start", "image_end", "image_newline")]
    return inv


def param_inventory(cfg: ModelConfig, part: str = "main", as_built: bool = False) -> list[Tensor]:
    """Every parameter tensor of one part: "main" (the decoder stack incl. Engram), "dspark"
    (DSpark / MTP blocks) or "vision".

    as_built=True gives exactly what `CEDModel(cfg)` builds (names and shapes of
    `named_parameters()`); the default follows the checkpoint, which differs only for the "v4"
    family (V4's overlapping compressor with `ape`, its indexer compressor, `hc_head_*`).
    """
    if part == "vision":
        return _vision_inventory(cfg)
    if part == "dspark":
        if cfg.family == "mla":
            return _mla_inventory(cfg, mtp=True)
        return _dspark_inventory(cfg) if cfg.family in ("ced", "v4") else []
    if part != "main":
        raise ValueError(f"part: {part!r} is not main, dspark or vision")
    if cfg.family in ("ced", "v4"):
        return _ced_inventory(cfg, checkpoint=not as_built)
    if cfg.family == "mla":
        return _mla_inventory(cfg, mtp=False)
    return _llama_inventory(cfg)


def _active_numel(cfg: ModelConfig, t: Tensor, topk: int, n_experts: int) -> Fraction:
    """Per-token active elements of one tensor: the token's embedding row, top-k of the routed
    experts, the looked-up rows of an Engram table, everything else whole."""
    n = _numel(t.shape)
    if t.group == "embed":
        return Fraction(t.shape[1])
    if t.group == "routed_expert" or (t.group == "dspark" and ".experts." in t.name):
        return Fraction(n * topk, n_experts)
    if t.group == "engram_table":
        buckets = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        return Fraction(buckets * t.shape[1])
    return Fraction(n)


def param_counts(cfg: ModelConfig) -> dict:
    """Analytic parameter counts (no model is built).

    total   every parameter of the main stack, Engram tables included; DSpark/MTP and vision
            excluded (equal to `CEDModel(cfg).num_parameters()` for the runnable presets).
    engram  the Engram tables (sum of rows x engram_head_dim); its projections are in `total` only.
    dspark  the DSpark (V4.1) or MTP (V4, V3) blocks; not built by cedlm; embed/head shared.
    vision  DeepSeek-ViT + aligner + delimiter rows, from `vision_config` (0 without one).

    Active parameters per token (DSpark and vision excluded):

    decode  everything a token passes, in the usual MoE convention: every non-expert parameter
            (attention, norms, mHC, routers, the head matrix whole), the shared experts and
            top-k of the routed experts in every layer. Lookup tables count only the rows read:
            one embedding row (hidden_size), and per Engram layer (max_ngram - 1) x n_heads
            buckets x head_dim; Engram's wkv and norm weights count whole. (Counting the whole
            embedding matrix instead adds (vocab_size - 1) x hidden_size to both figures.)
    prefill the per-token average over a long prompt in cedlm's bounded/exact prefill: the
            layers below `decoder_start` (the encoder), the embedding and Engram, and of the
            global-KV source (`decoder_start`) only what runs on every token in the encoder pass
            (`GLOBAL_KV_PARTS`: attn_norm, attn.wkv/kv_norm for its window rows, the compressor,
            indexer.wk/k_norm). The other decoder layers, the final norm and the head run on the
            trailing tokens only, ~0 per prompt token. Families without a decoder split
            ("v4", "mla", "llama") run every layer and the head on every token: prefill = decode.
    """
    main = param_inventory(cfg, "main")
    dspark = param_inventory(cfg, "dspark")
    vision = param_inventory(cfg, "vision")
    k, E = cfg.num_experts_per_tok, cfg.n_routed_experts
    ds = cfg.decoder_start if cfg.family in ("ced", "v4") else cfg.n_layers
    detail: dict[str, int] = {}
    decode = prefill = Fraction(0)
    for t in main:
        n = _numel(t.shape)
        detail[t.group] = detail.get(t.group, 0) + n
        a = _active_numel(cfg, t, k, E)
        decode += a
        layer = t.layer
        if layer is None:
            runs_every_token = t.group == "embed" or ds >= cfg.n_layers
        elif layer < ds:
            runs_every_token = True
        elif layer == ds:
            rel = t.name.split(".", 2)[2]
            runs_every_token = rel.startswith(GLOBAL_KV_PARTS)
        else:
            runs_every_token = False
        if runs_every_token:
            prefill += a
    total = sum(detail.values())
    dspark_total = sum(_numel(t.shape) for t in dspark)
    dspark_active = Fraction(0)
    kd = cfg.dspark_num_experts_per_tok if cfg.family == "ced" else k
    Ed = cfg.dspark_n_routed_experts if cfg.family == "ced" else E
    for t in dspark:
        dspark_active += (Fraction(_numel(t.shape) * kd, Ed) if ".experts." in t.name
                          else Fraction(_numel(t.shape)))
    return {
        "total": total,
        "engram": detail.get("engram_table", 0),
        "dspark": dspark_total,
        "vision": sum(_numel(t.shape) for t in vision),
        "active_decode": _num(decode),
        "active_prefill": _num(prefill),
        "dspark_active": _num(dspark_active),
        "detail": dict(sorted(detail.items())),
        "n_tensors": len(main),
    }


# ============================================================================ capacity
def sequence_bytes(cfg: ModelConfig, context: int) -> int:
    """Bytes one sequence of `context` tokens holds: the global entries allocated at that
    length (floor(context / r) per source, main KV + index keys), the SWA rings, the DSpark rings
    and the largest compressor pending state."""
    kv = kv_bytes_per_token(cfg)
    glob = 0
    for p in kv["parts"]:
        glob += (context // p["ratio"]) * p["entry_bytes"] * p["n_layers"]
    w = window_bytes_per_sequence(cfg)
    return glob + w["window"] + w["dspark_window"] + w["compressor_state"]


def max_sequences(memory_bytes: float, bytes_per_sequence: int) -> int:
    return int(memory_bytes // bytes_per_sequence) if bytes_per_sequence > 0 else 0


def concurrency_example(devices: dict = DEVICES, models=EXAMPLE_MODELS,
                        contexts=EXAMPLE_CONTEXTS) -> dict:
    """Sequences that fit on one accelerator, KV only: (memory - reserve) // bytes_per_sequence."""
    from cedlm.presets import PRESETS
    cfgs = {m: PRESETS[m]() for m in models}
    rows = []
    for m, cfg in cfgs.items():
        for ctx in contexts:
            b = sequence_bytes(cfg, ctx)
            row = {"model": m, "context": ctx, "bytes_per_sequence": b, "sequences": {}}
            for dev, d in devices.items():
                kv_mem = d["memory_gib"] * (1 - d["reserve_fraction"]) * GIB
                row["sequences"][dev] = max_sequences(kv_mem, b)
            rows.append(row)
    return {
        "devices": {dev: dict(d, kv_memory_gib=_num(Fraction(d["memory_gib"]) * (
            1 - Fraction(d["reserve_fraction"]).limit_denominator(1000)))) for dev, d in devices.items()},
        "rows": rows,
        "assumptions": [
            "one device; model weights excluded (held by other devices of an expert/tensor-"
            "parallel group or in host memory): KV memory = nominal HBM GiB x (1 - reserve)",
            "reserve (runtime, activations, workspace) = "
            + ", ".join(f"{int(d['reserve_fraction'] * 100)}% on {dev}" for dev, d in devices.items()),
            "bytes per sequence = global KV at the context + SWA/DSpark rings + compressor state "
            "(per each model's planner); one sequence's KV is not split across devices",
            "DeepSeek LLM 67B was trained at 4k context: its rows are memory arithmetic only",
        ],
    }


def plan(cfg: ModelConfig, context: int | None = None, memory_gib: float | None = None,
         name: str | None = None, example: bool = True) -> dict:
    """The whole account of `cfg` (JSON-stable keys, see PLAN_KEYS); max_sequences is
    floor(memory_gib GiB / bytes_per_sequence), None unless both context and memory are given."""
    if context is not None and context < 0:
        raise ValueError(f"context: must be >= 0, got {context}")
    if memory_gib is not None and memory_gib < 0:
        raise ValueError(f"memory_gib: must be >= 0, got {memory_gib}")
    kv = kv_bytes_per_token(cfg)
    win = window_bytes_per_sequence(cfg)
    pc = param_counts(cfg)
    assumptions = [
        "GiB = 2^30 bytes; global KV per token = sum over KV-source layers of entry bytes / "
        "compress ratio (main KV + owned index keys)",
        "bytes_per_sequence = allocated global entries at the context (floor(context/ratio) per "
        "source) + every layer's SWA ring + DSpark/MTP rings + the largest compressor pending "
        "state; token ids, ring positions and allocator slack excluded; weights excluded",
        "parameters: learnable weights (elements); router selection-bias buffers and checkpoint "
        ".scale tensors not counted; active decode = non-expert weights (head whole) + top-k "
        "routed + shared experts + only the embedding row and Engram rows a token reads; active "
        "prefill = per prompt token over a long prompt (decoder layers after the global-KV "
        "source, the final norm and the head run only on trailing tokens)",
    ] + kv["assumptions"] + win["assumptions"]
    if cfg.family == "v4":
        assumptions.append("V4-Flash parameters follow the checkpoint layout per the V4 notes "
                           "(overlapping ratio-4 compressor + ape, indexer compressor, hc_head); "
                           "its MTP block is counted V3-style (e_proj, h_proj, norms) plus a "
                           "full MoE SWA block")
    if cfg.family == "mla":
        assumptions.append("V3 MTP counted as one MoE layer + eh_proj + enorm/hnorm/shared_head "
                           "norm (embedding and head shared)")
    if cfg.family == "ced" and cfg.num_nextn_predict_layers:
        assumptions.append("DSpark blocks are not built by cedlm yet: params_dspark is analytic "
                           "(reference/v41-weight-names.txt layout)")
    bps = sequence_bytes(cfg, context) if context is not None else None
    ms = (max_sequences(memory_gib * GIB, bps) if bps is not None and memory_gib is not None
          else None)
    out = {
        "model": name or cfg.model_type,
        "family": cfg.family,
        "kv_bytes_per_token": kv["total"],
        "kv_bytes_per_token_parts": kv["parts"],
        "kv_bytes_headline": kv["headline"],
        "kv_bytes_alternatives": kv["alternatives"],
        "window_bytes_per_sequence": win["window"],
        "window_entry_bytes": win.get("window_entry_bytes"),
        "sliding_window": cfg.sliding_window if cfg.family in ("ced", "v4") else None,
        "n_layers": cfg.n_layers,
        "dspark_layers": cfg.num_nextn_predict_layers if cfg.family in ("ced", "v4") else 0,
        "dspark_window_bytes_per_sequence": win["dspark_window"],
        "compressor_state_bytes_per_sequence": win["compressor_state"],
        "params_total": pc["total"],
        "params_engram": pc["engram"],
        "params_dspark": pc["dspark"],
        "params_vision": pc["vision"],
        "params_active_prefill": pc["active_prefill"],
        "params_active_decode": pc["active_decode"],
        "params_detail": dict(pc["detail"], dspark_active=pc["dspark_active"]),
        "context": context,
        "memory_gib": memory_gib,
        "bytes_per_sequence": bps,
        "max_sequences": ms,
        "assumptions": assumptions,
        "concurrency_example": concurrency_example() if example else None,
    }
    return out


# ============================================================================ human table
def _b(n) -> str:
    """Bytes with separators, plus MiB/GiB where useful."""
    if n is None:
        return "-"
    s = f"{n:,.2f}".rstrip("0").rstrip(".") if isinstance(n, float) else f"{n:,}"
    s += " B"
    if n >= GIB:
        s += f" ({n / GIB:,.2f} GiB)"
    elif n >= MIB:
        s += f" ({n / MIB:,.2f} MiB)"
    return s


def _p(n) -> str:
    if n is None:
        return "-"
    n = round(n) if isinstance(n, float) else n
    s = f"{n:,}"
    if n >= 10 ** 9:
        s += f" ({n / 1e9:,.2f} B)"
    elif n >= 10 ** 6:
        s += f" ({n / 1e6:,.2f} M)"
    return s


def _table(rows: list[tuple], header: tuple | None = None) -> list[str]:
    """Align columns: the first left, the rest right; None rows are section titles."""
    body = [r for r in rows if isinstance(r, tuple)]
    allr = ([header] if header else []) + body
    ncol = max(len(r) for r in allr)
    w = [max(len(str(r[i])) for r in allr if i < len(r)) for i in range(ncol)]
    out = []

    def line(r):
        cells = [str(r[0]).ljust(w[0])] + [str(c).rjust(w[i + 1]) for i, c in enumerate(r[1:])]
        return "  ".join(cells).rstrip()

    if header:
        out.append(line(header))
        out.append("  ".join("-" * x for x in w))
    for r in rows:
        out.append(line(r) if isinstance(r, tuple) else r)
    return out


def _layers(ls: list[int]) -> str:
    if len(ls) > 6:
        return f"{len(ls)} layers"
    return "layer" + ("s " if len(ls) > 1 else " ") + ",".join(map(str, ls))


def format_plan(p: dict) -> str:
    out = [f"cedlm plan: {p['model']} (family {p['family']})", ""]
    rows: list = ["Global KV per token (" + p.get("kv_bytes_headline", "") + ")"]
    for part in p["kv_bytes_per_token_parts"]:
        formula = (f"{part['n_layers']} x {part['entry_bytes']} B" +
                   (f" / {part['ratio']}" if part["ratio"] != 1 else ""))
        rows.append((f"  {part['part']} ({part['format']}), {_layers(part['layers'])}"
                     + (f", ratio {part['ratio']}" if p["family"] in ("ced", "v4") else ""),
                     formula, _b(part["bytes_per_token"])))
    rows.append(("  total", "", _b(p["kv_bytes_per_token"])))
    for k, v in (p.get("kv_bytes_alternatives") or {}).items():
        rows.append((f"  alternative: {k}", "", _b(v)))
    rows.append("Per-sequence fixed")
    if p.get("window_entry_bytes"):
        rows.append(("  SWA rings", f"{p['n_layers']} x {p['sliding_window']} x "
                     f"{p['window_entry_bytes']} B", _b(p["window_bytes_per_sequence"])))
        rows.append(("  DSpark/MTP rings", f"{p['dspark_layers']} x {p['sliding_window']} x "
                     f"{p['window_entry_bytes']} B", _b(p["dspark_window_bytes_per_sequence"])))
    else:
        rows.append(("  SWA rings", "(full KV model)", _b(p["window_bytes_per_sequence"])))
    rows.append(("  compressor state (max)", "", _b(p["compressor_state_bytes_per_sequence"])))
    rows.append("Parameters")
    rows.append(("  total (main stack incl. Engram)", "", _p(p["params_total"])))
    rows.append(("  Engram tables", "", _p(p["params_engram"])))
    rows.append(("  total without Engram tables", "", _p(p["params_total"] - p["params_engram"])))
    rows.append(("  DSpark / MTP blocks", "(separate)", _p(p["params_dspark"])))
    rows.append(("  vision", "(separate)", _p(p["params_vision"])))
    rows.append(("  active per token, prefill", "", _p(p["params_active_prefill"])))
    rows.append(("  active per token, decode", "", _p(p["params_active_decode"])))
    rows.append("Capacity")
    rows.append(("  context", "", "-" if p["context"] is None else f"{p['context']:,} tokens"))
    rows.append(("  bytes per sequence", "", _b(p["bytes_per_sequence"])))
    rows.append(("  memory", "", "-" if p["memory_gib"] is None else f"{p['memory_gib']:,g} GiB"))
    rows.append(("  max sequences", "", "-" if p["max_sequences"] is None
                 else f"{p['max_sequences']:,}"))
    out += _table(rows)
    out += ["", "Assumptions:"] + [f"  - {a}" for a in p["assumptions"]]
    ex = p.get("concurrency_example")
    if ex:
        devs = list(ex["devices"])
        out += ["", "Concurrency example (one device, KV only; sequences that fit):"]
        header = ("model", "context", "bytes/sequence",
                  *[f"{d} ({ex['devices'][d]['kv_memory_gib']:g} GiB KV)" for d in devs])
        erows = [(r["model"], f"{r['context']:,}", _b(r["bytes_per_sequence"]),
                  *[f"{r['sequences'][d]:,}" for d in devs]) for r in ex["rows"]]
        out += _table(erows, header)
        out += [f"  - {a}" for a in ex["assumptions"]]
    return "\n".join(out)


# ============================================================================ CLI
def _int_tokens(s: str) -> int:
    """An integer token count; k/K = x1024, m/M = x1048576 (e.g. 128k, 1M)."""
    mult = {"k": 1 << 10, "m": 1 << 20}.get(s[-1:].lower(), 1)
    try:
        v = int(s[:-1] if mult > 1 else s) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {s!r} (e.g. 131072, 128k, 1M)")
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {s!r}")
    return v


def _add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", metavar="PATH", help="a config.json (V4.1, V4, V3 or llama schema)")
    src.add_argument("--preset", metavar="NAME", help="a named preset (cedlm.presets.PRESETS)")
    p.add_argument("--context", type=_int_tokens, metavar="N",
                   help="tokens per sequence (e.g. 1048576, 128k, 1M)")
    p.add_argument("--memory-gib", type=float, metavar="M", help="memory for KV, in GiB")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="KV bytes, parameter counts and sequences that fit",
                              description="KV bytes, parameter counts and sequences that fit. "
                                          "Exactly one of --config / --preset.")
    _add_arguments(p)
    return p


def run(args) -> int:
    try:
        if args.config:
            cfg = ModelConfig.from_json(args.config)
            path = Path(args.config)
            name = (path.parent.name if path.name == "config.json" or path.is_dir()
                    else path.name.removesuffix(".json").removesuffix(".config"))
        else:
            cfg, name = ModelConfig.preset(args.preset), args.preset
        p = plan(cfg, context=args.context, memory_gib=args.memory_gib, name=name)
    except (ConfigError, ValueError) as e:
        raise SystemExit(f"cedlm plan: error: {e}")
    print(json.dumps(p, indent=2) if args.json else format_plan(p))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cedlm.plan", description="cedlm capacity planner. "
                                "Exactly one of --config / --preset.")
    _add_arguments(p)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
