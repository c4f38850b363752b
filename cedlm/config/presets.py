"""Named configurations: the official reference configs and small runnable presets.

The small presets keep the official V4.1 structure scaled down: SWA-only layers first, an
encoder of CSA2 ratio-2 groups each headed by a Full layer and followed by Reuse layers, a decoder
whose first layer is the ratio-1 global-KV source and the candidate source, then Reindex and
Reuse layers; Engram layers, mHC, MoE with a shared expert, DSpark schedule entries.
"""
from __future__ import annotations

from cedlm.config.engram_sizes import engram_table_rows
from cedlm.config.schema import CONFIG_DIR, ModelConfig


def _official(name: str):
    return lambda: ModelConfig.from_json(CONFIG_DIR / f"{name}.config.json")


def _scaled(**kw) -> ModelConfig:
    """A scaled-down V4.1: Engram row counts derived exactly as the official ones are."""
    engram_layers = kw["engram_layer_ids"]
    kw["engram_num_embeddings"] = engram_table_rows(
        engram_layers, kw["engram_vocab_size"], kw["engram_max_ngram_size"], kw["engram_n_heads"])
    kw.setdefault("rope_scaling", {"rope_type": "yarn", "factor": 16, "beta_fast": 32,
                                   "beta_slow": 1, "original_max_position_embeddings": 4096})
    kw.setdefault("max_position_embeddings", 65536)
    kw.setdefault("rope_precision", "float64")          # cedlm's own models
    return ModelConfig(**kw)


def tiny() -> ModelConfig:
    """< 1M parameters, for tests. 10 layers: swa, swa+engram, enc 2 groups, dec 4 layers."""
    return _scaled(
        vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=10,
        num_attention_heads=4, head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_lora_rank=32,
        o_groups=2, rms_norm_eps=1e-6, n_routed_experts=4, num_experts_per_tok=2,
        sliding_window=8,
        compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0],
        kv_source_layer_ids=[2, 4, 6], index_source_layer_ids=[2, 4, 6, 8],
        index_n_heads=2, index_head_dim=32, index_topk=4,
        candidate_source_layer_id=6, candidate_topk_blocks=3, candidate_block_size=2,
        hc_mult=2, engram_layer_ids=[1, 4], engram_max_ngram_size=3, engram_vocab_size=53,
        engram_n_heads=2, engram_head_dim=8, engram_compressed_vocab_size=512,
        num_nextn_predict_layers=1, dspark_block_size=3, dspark_noise_token_id=511,
        dspark_target_layer_ids=[9], dspark_markov_rank=8, dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=2, image_token_id=None, max_position_embeddings=4096,
        rope_scaling={"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": 1024})


def small() -> ModelConfig:
    """10-30M parameters: the default trained model's shape (12 layers, width 256)."""
    return _scaled(
        vocab_size=4096, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=12,
        num_attention_heads=4, head_dim=128, qk_rope_head_dim=32, q_lora_rank=128,
        o_lora_rank=128, o_groups=2, rms_norm_eps=1e-6, n_routed_experts=8,
        num_experts_per_tok=2, sliding_window=64,
        compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0],
        kv_source_layer_ids=[2, 4, 6], index_source_layer_ids=[2, 4, 6, 8, 10],
        index_n_heads=4, index_head_dim=64, index_topk=64,
        candidate_source_layer_id=6, candidate_topk_blocks=32, candidate_block_size=8,
        hc_mult=4, engram_layer_ids=[1, 4], engram_max_ngram_size=3, engram_vocab_size=10007,
        engram_n_heads=4, engram_head_dim=32, engram_compressed_vocab_size=4096,
        num_nextn_predict_layers=1, dspark_block_size=5, dspark_noise_token_id=4095,
        dspark_target_layer_ids=[11], dspark_markov_rank=32, dspark_n_routed_experts=8,
        dspark_num_experts_per_tok=2, image_token_id=None)


def small40() -> ModelConfig:
    """The official V4.1 layer schedule and KV geometry at small width: 40 layers (2 SWA, an
    encoder of 3 CSA2 groups of 6, a decoder of 20 led by the global-KV source), the official
    sources, candidate pool, Engram layers and DSpark taps, head_dim 512 / index_head_dim 128 /
    window 128 (so its KV bytes per token, 890, and window rings are the official ones), hidden
    size 256 and a small MoE. For capacity, prefill and decode figures that need the real
    schedule; the 12-layer `small` stays the trained default."""
    official = ModelConfig.preset("deepseek-v4.1-flash")
    return _scaled(
        vocab_size=4096, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=40,
        num_attention_heads=4, head_dim=512, qk_rope_head_dim=64, q_lora_rank=128,
        o_lora_rank=128, o_groups=2, rms_norm_eps=1e-6, n_routed_experts=8,
        num_experts_per_tok=2, sliding_window=official.sliding_window,
        compress_ratios=list(official.compress_ratios), kv_source_layer_ids=list(official.kv_source_layer_ids),
        index_source_layer_ids=list(official.index_source_layer_ids),
        index_n_heads=4, index_head_dim=official.index_head_dim, index_topk=64,
        candidate_source_layer_id=official.candidate_source_layer_id, candidate_topk_blocks=32,
        candidate_block_size=official.candidate_block_size, hc_mult=official.hc_mult,
        engram_layer_ids=list(official.engram_layer_ids), engram_max_ngram_size=3,
        engram_vocab_size=10007, engram_n_heads=4, engram_head_dim=32,
        engram_compressed_vocab_size=4096, num_nextn_predict_layers=official.num_nextn_predict_layers,
        dspark_block_size=official.dspark_block_size, dspark_noise_token_id=4095,
        dspark_target_layer_ids=list(official.dspark_target_layer_ids), dspark_markov_rank=32,
        dspark_n_routed_experts=8, dspark_num_experts_per_tok=2, image_token_id=None)


def retrieval() -> ModelConfig:
    """A purpose-built small retrieval model: the CSA2 roles of `small` (SWA layers, an
    encoder Full + Reuse group of ratio 2, a decoder led by the ratio-1 global-KV source, which
    is also the candidate source, then Reindex and Reuse layers; Engram, mHC, MoE, a DSpark tap)
    at width 128 and 8 layers, with a short window (32) and a small top-k (16) with a candidate
    pool of 8 blocks of 4. At 256-1024 tokens most compressed entries are then NOT selected, so
    retrieval beyond the window depends on what the lightning indexer selects. Cheap enough to
    train on a CPU (FIDELITY.md, "Retrieval beyond the window: a model that can retrieve")."""
    return _scaled(
        vocab_size=4096, hidden_size=128, moe_intermediate_size=128, num_hidden_layers=8,
        num_attention_heads=4, head_dim=64, qk_rope_head_dim=16, q_lora_rank=64, o_lora_rank=64,
        o_groups=2, rms_norm_eps=1e-6, n_routed_experts=4, num_experts_per_tok=2,
        sliding_window=32,
        compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1, 0],
        kv_source_layer_ids=[2, 4], index_source_layer_ids=[2, 4, 6],
        index_n_heads=4, index_head_dim=32, index_topk=16,
        candidate_source_layer_id=4, candidate_topk_blocks=8, candidate_block_size=4,
        hc_mult=2, engram_layer_ids=[1], engram_max_ngram_size=3, engram_vocab_size=10007,
        engram_n_heads=2, engram_head_dim=16, engram_compressed_vocab_size=4096,
        num_nextn_predict_layers=1, dspark_block_size=3, dspark_noise_token_id=4095,
        dspark_target_layer_ids=[7], dspark_markov_rank=16, dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=2, image_token_id=None)


# The width of `small40` (everything but the layer schedule and the KV geometry).
_SMALL_WIDTH = dict(vocab_size=4096, hidden_size=256, moe_intermediate_size=128, num_attention_heads=4,
                    q_lora_rank=128, o_lora_rank=128, o_groups=2, rms_norm_eps=1e-6, n_routed_experts=8,
                    num_experts_per_tok=2, index_n_heads=4, index_topk=64, max_position_embeddings=65536)


def small40_v4flash() -> ModelConfig:
    """The V4-Flash counterpart of `small40`: DeepSeek-V4-Flash's official schedule and KV
    geometry (43 layers: 2 SWA, then CSA ratio 4 with index keys and HCA ratio 128 alternating,
    each compressed layer its own KV source, 584-byte v4_fp8 main-KV entries, window 128) at the
    same small width as `small40`. Runnable as a V4-style stack (family "v4")."""
    cfg = ModelConfig.preset("deepseek-v4-flash")
    flat = dict(cfg.extra.get("flat", {}))
    out = cfg.replace(**_SMALL_WIDTH)
    if flat:
        flat.update(_SMALL_WIDTH)
        out.extra = {**cfg.extra, "flat": flat}
    return out


PRESETS = {
    "tiny": tiny,
    "small": small,
    "small40": small40,
    "retrieval": retrieval,
    "small40-v4flash": small40_v4flash,
    "deepseek-v4.1-flash": _official("deepseek-v4.1-flash"),
    "deepseek-v4-flash": _official("deepseek-v4-flash"),
    "deepseek-v3": _official("deepseek-v3"),
    "deepseek-llm-67b": _official("deepseek-llm-67b"),
}
