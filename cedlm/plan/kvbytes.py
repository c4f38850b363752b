"""Bytes: entry sizes, global KV bytes per token by part, fixed per-sequence bytes."""
from __future__ import annotations

from fractions import Fraction

from cedlm.config import ConfigError, ModelConfig
from cedlm.kv_layout import PART_OF_KIND, KVLayout
from cedlm.config.params import json_number as _num

GIB = 1 << 30
MIB = 1 << 20


# ============================================================================ KV bytes
V4_INDEX_ASSUMPTION = ("V4-Flash index keys: format unverified; assumed FP4 like V4.1 "
                       "(index_fp4, 68 B per 128-dim entry); FP8 + FP32 scale (132 B) would add "
                       "about twice as much")


def entry_bytes(cfg: ModelConfig, fmt: str, dim: int) -> int:
    """Bytes of one stored entry of `dim` values in KV format `fmt`.

    kv_fp4 / index_fp4 / window_fp8 come from `cedlm.quant` (288 / 68 / 528 at 512 / 128 / 512).
    v4_fp8 is DeepSeek V4's MODEL1 layout: FP8 NoPE + BF16 RoPE + one UE8M0 per 64 NoPE dims +
    1 pad byte (448 + 128 + 7 + 1 = 584 at 512 dims, 64 of them RoPE). bf16 is 2 bytes per dim.
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
        groups: dict[tuple, list] = {}
        for spec in KVLayout.from_config(cfg).rows:
            groups.setdefault((PART_OF_KIND[spec.kind], spec.ratio), []).append(spec)
        for (kind, r), specs in sorted(groups.items(), key=lambda kv: (kv[0][0] != "main_kv",
                                                                        kv[1][0].layer)):
            parts.append({"part": kind, "format": specs[0].fmt, "ratio": r,
                          "layers": [s.layer for s in specs], "n_layers": len(specs),
                          "entry_bytes": specs[0].width,
                          "bytes_per_token": _num(sum(s.bytes_per_token for s in specs))})
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
    num_nextn_predict_layers DSpark/MTP blocks (SWA only; `cedlm.model.dspark.DraftState`).
    compressor_state: the largest pending state, (r - 1) fp32 rows of kv and gate projections
    (head_dim each) per ratio-r (> 1) KV source: what `SequenceState.pending` holds just before a
    group completes. mla/llama keep full KV in every layer: all zero.
    """
    out = {"window": 0, "dspark_window": 0, "compressor_state": 0, "assumptions": []}
    if cfg.family not in ("ced", "v4"):
        return out
    layout = KVLayout.from_config(cfg)
    wb = layout.window_entry_bytes
    out["window_entry_bytes"] = wb
    out["window"] = layout.window_bytes_per_sequence
    out["dspark_window"] = layout.dspark_window_bytes_per_sequence
    out["compressor_state"] = layout.max_pending_bytes
    if cfg.family == "v4":
        out["assumptions"].append(
            f"V4-Flash window and MTP rings use the config's window format "
            f"({cfg.window_kv_format}, {wb} B/entry) as cedlm's V4-Flash-style baseline stores them; V4's own SWA "
            f"cache uses the 584 B MODEL1 layout (+{(584 - wb) * (cfg.n_layers + cfg.num_nextn_predict_layers) * cfg.sliding_window:,} B/sequence)"
            if cfg.head_dim == 512 else
            f"V4 window format: the config's {cfg.window_kv_format} ({wb} B/entry)")
        out["assumptions"].append(
            "V4-Flash compressor state: cedlm's V4-Flash-style baseline (non-overlapping groups, no indexer "
            "compressor); V4's overlapping ratio-4 compressor and indexer compressor hold more")
    return out


