"""Parameter accounting from a `ModelConfig` alone, in pure Python (no model is built, no torch).

    param_inventory(cfg, part)   every parameter tensor (name, shape, group, layer) of the main
                                 stack, the DSpark/MTP blocks or the vision tower
    param_counts(cfg)            totals (main, Engram tables, DSpark, vision) and active
                                 parameters per token at decode and prefill

For the runnable presets `param_inventory(cfg, as_built=True)` names exactly the tensors of
`CEDModel(cfg).named_parameters()` and `param_counts(cfg)["total"]` equals
`CEDModel(cfg).num_parameters()`. `cedlm.plan` builds its report on these functions.
"""
from __future__ import annotations

import math
from collections import namedtuple
from fractions import Fraction

from cedlm.config.schema import ModelConfig


def json_number(x):
    """A Fraction/int as a JSON number: an int when integral (890, not 890.0), else a float."""
    x = Fraction(x)
    return int(x) if x.denominator == 1 else float(x)


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
    """DSpark (V4.1 checkpoint names) or V4 MTP blocks; not built by cedlm."""
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
    """DeepSeek-ViT + aligner + image delimiter rows (V4.1 checkpoint names)."""
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
        "active_decode": json_number(decode),
        "active_prefill": json_number(prefill),
        "dspark_active": json_number(dspark_active),
        "detail": dict(sorted(detail.items())),
        "n_tensors": len(main),
    }

