"""Validation of a `ModelConfig`: every error is a `ConfigError` whose message starts with the
offending field's name (``"compress_ratios: ..."``).

The "mla" and "llama" families are accounting-only and get only the family/arch checks. For the
runnable families the layer roles are checked for consistency: KV / index / candidate sources
compress, each compressed layer has a KV source of the same ratio at or below it, the decoder
(from the ratio-1 global-KV source on) is ratio 1 throughout, Engram sits in the encoder, and every
quantized dimension is a multiple of its KV format's scale block.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cedlm.config.schema import ModelConfig


# Engram compressed-token maps (built in cedlm.text.engram_map): the official V4.1 map, and
# cedlm's first map kept for checkpoints trained with it.
ENGRAM_TOKEN_MAPS = ("v41", "legacy-v0")


class ConfigError(ValueError):
    """An invalid configuration; the message names the offending field."""


def validate(cfg: "ModelConfig") -> None:
    """Raise `ConfigError` naming the first invalid field of `cfg`."""
    if cfg.family not in ("ced", "v4", "mla", "llama"):
        raise ConfigError(f"family: unknown {cfg.family!r}")
    if cfg.arch not in ("ced", "decoder_only"):
        raise ConfigError(f"arch: {cfg.arch!r} is not 'ced' or 'decoder_only'")
    if cfg.family in ("mla", "llama"):
        return
    L = cfg.num_hidden_layers

    def need(cond: bool, fld: str, msg: str):
        if not cond:
            raise ConfigError(f"{fld}: {msg}")

    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "head_dim", "q_lora_rank", "o_lora_rank", "o_groups", "sliding_window",
                 "hc_mult", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok"):
        need(getattr(cfg, name) > 0, name, f"must be positive, got {getattr(cfg, name)}")
    need(cfg.num_nextn_predict_layers >= 0, "num_nextn_predict_layers", "must be >= 0")
    # One entry per main layer, optionally followed by SWA-only (0) entries for the draft blocks.
    # The trailing count is num_nextn_predict_layers in V4.1 (40 + 3 = 43) but the number of
    # DSpark taps in V4-Flash-0731 (43 layers + 3 entries, one draft layer): either is accepted.
    extra_max = max(cfg.num_nextn_predict_layers, len(cfg.dspark_target_layer_ids))
    need(L <= len(cfg.compress_ratios) <= L + extra_max, "compress_ratios",
         f"has {len(cfg.compress_ratios)} entries; expected num_hidden_layers ({L}) plus at most "
         f"max(num_nextn_predict_layers, len(dspark_target_layer_ids)) = {extra_max} trailing "
         f"draft-block entries, i.e. {L}..{L + extra_max}")
    for i in range(L, len(cfg.compress_ratios)):
        need(cfg.compress_ratios[i] == 0, "compress_ratios",
             f"entry {i} is a DSpark/MTP block and must be 0 (SWA only)")
    need(all(r >= 0 for r in cfg.compress_ratios), "compress_ratios", "must be >= 0")
    need(cfg.qk_rope_head_dim % 2 == 0 and 0 < cfg.qk_rope_head_dim <= cfg.head_dim,
         "qk_rope_head_dim", f"must be even and in (0, head_dim={cfg.head_dim}]")
    need(cfg.num_attention_heads % cfg.o_groups == 0, "o_groups",
         f"num_attention_heads ({cfg.num_attention_heads}) must be a multiple of o_groups")
    need(cfg.num_key_value_heads == 1, "num_key_value_heads",
         "must be 1 (single shared latent as K and V)")
    need(cfg.num_experts_per_tok <= cfg.n_routed_experts, "num_experts_per_tok",
         f"{cfg.num_experts_per_tok} > n_routed_experts {cfg.n_routed_experts}")
    need(cfg.scoring_func in ("sqrtsoftplus", "sigmoid", "softmax"), "scoring_func",
         f"unsupported {cfg.scoring_func!r}")

    def ids_ok(fld: str, ids: list[int]):
        need(ids == sorted(set(ids)), fld, f"must be strictly increasing, got {ids}")
        need(all(0 <= i < L for i in ids), fld, f"ids must be in [0, {L}), got {ids}")

    ids_ok("kv_source_layer_ids", cfg.kv_source_layer_ids)
    ids_ok("index_source_layer_ids", cfg.index_source_layer_ids)
    ids_ok("engram_layer_ids", cfg.engram_layer_ids)
    for s in cfg.kv_source_layer_ids:
        need(cfg.compress_ratios[s] > 0, "kv_source_layer_ids",
             f"layer {s} has compress_ratio 0; a KV source must compress (ratio >= 1)")
    for i in range(L):
        if cfg.compress_ratios[i] > 0:
            src = cfg.kv_source_of(i)
            need(src is not None, "kv_source_layer_ids",
                 f"layer {i} (ratio {cfg.compress_ratios[i]}) has no KV source at or below it")
            need(cfg.compress_ratios[src] == cfg.compress_ratios[i], "compress_ratios",
                 f"layer {i} has ratio {cfg.compress_ratios[i]} but its KV source {src} "
                 f"has ratio {cfg.compress_ratios[src]}")
    for s in cfg.index_source_layer_ids:
        need(cfg.compress_ratios[s] > 0, "index_source_layer_ids",
             f"layer {s} has compress_ratio 0")
    for s in cfg.index_source_layer_ids:
        if s not in cfg.kv_source_layer_ids:        # a Reindex layer scores its source's keys
            need(cfg.kv_source_of(s) in cfg.index_source_layer_ids, "index_source_layer_ids",
                 f"Reindex layer {s} needs index keys, but its KV source "
                 f"{cfg.kv_source_of(s)} is not an index source")
    # A compressed layer whose latest index source scores another KV source (V4's HCA
    # layers) attends to every visible entry of its own source instead.
    c = cfg.candidate_source_layer_id
    if c is not None:
        need(c in cfg.kv_source_layer_ids, "candidate_source_layer_id",
             f"layer {c} is not a KV source ({cfg.kv_source_layer_ids})")
        need(c in cfg.index_source_layer_ids, "candidate_source_layer_id",
             f"layer {c} is not an index source")
        need(cfg.candidate_block_size > 0 and cfg.candidate_topk_blocks > 0,
             "candidate_block_size", "candidate_block_size and candidate_topk_blocks must be > 0")
    if cfg.index_source_layer_ids:
        need(cfg.index_topk > 0, "index_topk", f"must be positive, got {cfg.index_topk}")
    d0 = cfg.decoder_start
    for i in range(d0, L):
        need(cfg.compress_ratios[i] == 1, "compress_ratios",
             f"decoder layer {i} (after global-KV source {d0}) must have ratio 1")
    need(len([i for i in cfg.kv_source_layer_ids if cfg.compress_ratios[i] == 1]) <= 1,
         "kv_source_layer_ids", "at most one ratio-1 (global KV) source is supported")
    for e in cfg.engram_layer_ids:
        need(e < d0, "engram_layer_ids",
             f"layer {e} is in the decoder (>= {d0}); decoder layers see only trailing tokens "
             "at prefill, so Engram must sit in the encoder")
    need(len(cfg.engram_num_embeddings) == len(cfg.engram_layer_ids), "engram_num_embeddings",
         f"has {len(cfg.engram_num_embeddings)} entries for "
         f"{len(cfg.engram_layer_ids)} engram_layer_ids")
    if cfg.engram_layer_ids:
        need(cfg.engram_max_ngram_size >= 2, "engram_max_ngram_size", "must be >= 2")
        need(cfg.engram_n_heads > 0 and cfg.engram_head_dim > 0, "engram_n_heads",
             "engram_n_heads and engram_head_dim must be positive")
        need(cfg.engram_vocab_size >= 3, "engram_vocab_size", "must be >= 3")
    # The taps (main layers whose states feed the drafter) are counted independently of the
    # draft layers: V4.1 has 3 and 3, V4-Flash-0731 has 3 taps for 1 draft layer.
    need(cfg.dspark_target_layer_ids == sorted(set(cfg.dspark_target_layer_ids)),
         "dspark_target_layer_ids", f"must be strictly increasing, got {cfg.dspark_target_layer_ids}")
    need(all(0 <= i < L for i in cfg.dspark_target_layer_ids), "dspark_target_layer_ids",
         f"ids must be in [0, {L}), got {cfg.dspark_target_layer_ids}")
    need(cfg.rope_precision in ("float32", "float64"), "rope_precision",
         f"{cfg.rope_precision!r} is not 'float32' or 'float64'")
    need(cfg.engram_token_map in ENGRAM_TOKEN_MAPS, "engram_token_map",
         f"unknown {cfg.engram_token_map!r} (expected one of {ENGRAM_TOKEN_MAPS})")
    # Byte formats: every quantized dim must be a multiple of its scale block.
    from cedlm.quant import FORMATS
    from cedlm.quant.formats import EXTRA_FORMATS
    for fld, fmt, dim in (("head_dim", cfg.main_kv_format, cfg.head_dim),
                          ("head_dim", cfg.window_kv_format, cfg.head_dim),
                          ("index_head_dim", cfg.index_kv_format, cfg.index_head_dim)):
        if fmt in FORMATS and dim % FORMATS[fmt].block != 0:
            raise ConfigError(f"{fld}: {dim} is not a multiple of the {fmt} scale block "
                              f"({FORMATS[fmt].block})")
    # Every cache row is stored as bytes in one of these formats; there is no unquantised
    # "none" layout (the caches, the compressor and the byte layout all need a format).
    for fld in ("main_kv_format", "window_kv_format", "index_kv_format"):
        need(getattr(cfg, fld) != "none", fld,
             "'none' is not a KV storage format (the caches store bytes); use 'bf16' for "
             "unquantised entries")
    need(cfg.main_kv_format in ("kv_fp4", "v4_fp8", "window_fp8", "bf16"),
         "main_kv_format", f"unknown {cfg.main_kv_format!r} (expected kv_fp4, v4_fp8, window_fp8 or bf16)")
    known = sorted({*FORMATS, *EXTRA_FORMATS})          # what the codecs store (get_format)
    for fld in ("window_kv_format", "index_kv_format"):
        need(getattr(cfg, fld) in known, fld, f"unknown {getattr(cfg, fld)!r} (expected one of {known})")

