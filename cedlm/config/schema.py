"""The `ModelConfig` dataclass: the official `deepseek_v41` config.json schema, its derived layer
roles, and JSON reading/writing that round-trips the official file.

`ModelConfig.from_json` reads the official V4.1 file (fields under `text_config`, the rest kept
for round-trip), the flat V4-Flash schema (mapped onto the same roles: every compressed layer is
its own KV source, ratio-4 layers own index keys, FP8 main KV) and, for accounting only, the
V3 (MLA) and llama schemas. Layer roles are always derived from the lists, never hard-coded.
RoPE settings nested under `rope_parameters` (newer HF schema; flat, or split into "main" and
"compress") are read into rope_theta / compress_rope_theta / rope_scaling and written back in the
same shape. `engram_token_map` (cedlm metadata) names the Engram compressed-token map the weights
were trained with (see `cedlm.text.engram_map`).
"""
from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cedlm.config.validate import ConfigError, validate as _validate

# The official config.json files shipped with the package (`ModelConfig.preset` names them).
CONFIG_DIR = Path(__file__).parent / "official"

# Families: "ced" (V4.1 schema; runnable), "v4" (V4-Flash schema; runnable as a V4-style CSA/HCA baseline),
# "mla" (V3; accounting only), "llama" (dense GQA; accounting only).
RUNNABLE_FAMILIES = ("ced", "v4")


# RoPE settings in the newer HF schema: one `rope_parameters` object instead of `rope_theta` +
# `rope_scaling`. Either flat ({"rope_type", "rope_theta", "factor", ...}, shared by every layer;
# `compress_rope_theta` stays its own field) or split by layer kind ({"main": {...} for the
# ratio-0 SWA layers, "compress": {...} for compressed layers}). Only the compressed layers
# use YaRN (as `uses_yarn`), so the scaling is read from "compress"; "main" gives `rope_theta`.
_YARN_TYPES = ("yarn", "deepseek_yarn")


def _rope_parts(rp) -> tuple[dict, dict]:
    """(main, compress) parts of a `rope_parameters` object (the same dict when flat)."""
    if not isinstance(rp, dict):
        raise ConfigError(f"rope_parameters: expected an object, got {rp!r}")
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return rp["main"], rp["compress"]
    return rp, rp


def _read_rope_parameters(rp) -> dict[str, Any]:
    """The cedlm fields (rope_theta, compress_rope_theta, rope_scaling) a `rope_parameters`
    object sets; `ConfigError` for a rope type cedlm does not implement."""
    main, comp = _rope_parts(rp)
    out: dict[str, Any] = {}
    if "rope_theta" in main:
        out["rope_theta"] = main["rope_theta"]
    if comp is not main and "rope_theta" in comp:
        out["compress_rope_theta"] = comp["rope_theta"]
    rtype = comp.get("rope_type", comp.get("type", "default"))
    if rtype in (None, "default"):
        out["rope_scaling"] = None
    elif rtype in _YARN_TYPES:
        missing = [k for k in ("factor", "original_max_position_embeddings") if k not in comp]
        if missing:
            raise ConfigError(f"rope_parameters: YaRN settings lack {missing}")
        out["rope_scaling"] = {k: v for k, v in comp.items() if k != "rope_theta"}
    else:
        raise ConfigError(f"rope_parameters: unsupported rope_type {rtype!r} (cedlm implements "
                          f"'default' and {_YARN_TYPES})")
    return out


_YARN_KEYS = ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings")


def _same_rope_value(k: str, a, b) -> bool:
    if k != "rope_scaling":
        return a == b
    if not a or not b:
        return not a and not b
    return all(a.get(x) == b.get(x) for x in _YARN_KEYS)


def _write_rope_parameters(src, cfg: "ModelConfig") -> dict:
    """`src` (the file's rope_parameters) with cfg's RoPE fields written back, keys in order."""
    src = copy.deepcopy(src)
    main, comp = _rope_parts(src)
    if "rope_theta" in main:
        main["rope_theta"] = cfg.rope_theta
    if comp is not main and "rope_theta" in comp:
        comp["rope_theta"] = cfg.compress_rope_theta
    new = dict(cfg.rope_scaling) if cfg.rope_scaling else {"rope_type": "default"}
    kept = {k: v for k, v in comp.items() if k == "rope_theta" or k in new}
    updated = {k: (new[k] if k in new else v) for k, v in kept.items()}
    updated.update({k: v for k, v in new.items() if k not in updated})
    comp.clear()
    comp.update(updated)
    return src


def _apply_rope_parameters(d: dict, kw: dict) -> None:
    """Set kw's RoPE fields from d["rope_parameters"]; a field also given directly in `d` must
    agree with it (a file that states two different values is an error, not a guess)."""
    if "rope_parameters" not in d:
        return
    for k, v in _read_rope_parameters(d["rope_parameters"]).items():
        if k in d and not _same_rope_value(k, d[k], v):
            raise ConfigError(f"rope_parameters: gives {k} = {v!r} but the file also sets "
                              f"{k} = {d[k]!r}")
        kw[k] = v


@dataclass
class ModelConfig:
    # --- official text_config fields (names as in config.json) ---
    model_type: str = "deepseek_v41_text"
    vocab_size: int = 129280
    hidden_size: int = 5120
    moe_intermediate_size: int = 2304
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_lora_rank: int = 1024
    o_groups: int = 8
    hidden_act: str = "silu"
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    attention_bias: bool = False
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    use_cache: bool = True
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default_factory=lambda: {
        "rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
        "original_max_position_embeddings": 65536})
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    sliding_window: int = 128
    compress_ratios: list[int] = field(default_factory=lambda: [0, 0] + [2] * 18 + [1] * 20 + [0] * 3)
    compress_rope_theta: float = 160000.0
    kv_source_layer_ids: list[int] = field(default_factory=lambda: [2, 8, 14, 20])
    index_source_layer_ids: list[int] = field(default_factory=lambda: [2, 8, 14, 20, 24, 28, 32, 36])
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer_id: int | None = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: list[int] = field(default_factory=lambda: [1, 14])
    engram_num_embeddings: list[int] = field(default_factory=lambda: [384006168, 384016682])
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: list[int] = field(default_factory=lambda: [37, 38, 39])
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3

    # --- top-level fields of the official file (kept so the file round-trips) ---
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    image_token_id: int | None = 129264

    # --- cedlm fields (not in the official schema; written under "cedlm" on save) ---
    family: str = "ced"
    main_kv_format: str = "kv_fp4"        # kv_fp4 (V4.1, 288 B/512) | v4_fp8 (V4, 584 B/512) | bf16
    index_kv_format: str = "index_fp4"    # index keys: 68 B/128
    window_kv_format: str = "window_fp8"  # 528 B/512
    # A weightless per-head RMS norm of the queries: V4 applied one; vLLM's V4.1 and the PyPTO
    # port do not. Off by default to match V4.1; kept as an option.
    q_head_norm: bool = False
    # Which stack to build from this config: "ced" (the CED model) or "decoder_only" (the
    # decoder-only baseline: full causal attention, per-layer BF16 KV, same width, depth and MoE).
    # "twin", this field's old name for the baseline, is read as "decoder_only".
    arch: str = "ced"
    # Which Engram compressed-token map the weights were trained with (cedlm.text.engram_map):
    # "v41" (the official map; absent from a file means this) or "legacy-v0" (cedlm's first map,
    # kept only for checkpoints that say so, e.g. the shipped default model).
    engram_token_map: str = "v41"
    # dtype of the RoPE frequencies and angles: "float32" as the published V4.1 inference code
    # computes them (the default, so official configs get it), "float64" for cedlm's own models
    # (exact angles at any position; the presets and the shipped model were trained with it).
    rope_precision: str = "float32"
    kv_lora_rank: int = 0                 # mla family only
    intermediate_size: int = 0            # llama / dense MLP (accounting)
    first_k_dense_replace: int = 0        # mla family only
    num_hash_layers: int = 0              # v4 family only (hash-routed MoE; accounting)

    # Everything else in the source file, by path, so `to_dict` round-trips it.
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.arch == "twin":
            self.arch = "decoder_only"
        self.validate()

    # ------------------------------------------------------------------ derived roles
    @property
    def n_layers(self) -> int:
        return self.num_hidden_layers

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def kv_source_of(self, layer: int) -> int | None:
        """The most recent KV source at or below `layer` (None for ratio-0 layers)."""
        if self.compress_ratios[layer] == 0:
            return None
        srcs = [s for s in self.kv_source_layer_ids if s <= layer]
        return srcs[-1] if srcs else None

    def index_source_of(self, layer: int) -> int | None:
        if self.compress_ratios[layer] == 0:
            return None
        srcs = [s for s in self.index_source_layer_ids if s <= layer]
        return srcs[-1] if srcs else None

    def role(self, layer: int) -> str:
        """'swa' | 'full' (own KV + index keys) | 'reindex' (own indexer queries) | 'reuse'."""
        if self.compress_ratios[layer] == 0:
            return "swa"
        if layer in self.kv_source_layer_ids:
            return "full"
        if layer in self.index_source_layer_ids:
            return "reindex"
        return "reuse"

    @property
    def roles(self) -> list[str]:
        return [self.role(i) for i in range(self.n_layers)]

    @property
    def index_key_layer_ids(self) -> list[int]:
        """Layers that store index keys: index sources that are also KV sources."""
        return [i for i in self.kv_source_layer_ids if i in self.index_source_layer_ids]

    @property
    def decoder_start(self) -> int:
        """First decoder layer: the ratio-1 KV source (the global-KV projection).

        Equals n_layers when the config has no decoder (V4-style: every layer sees every token).
        """
        ones = [i for i in self.kv_source_layer_ids if self.compress_ratios[i] == 1]
        return ones[0] if ones else self.n_layers

    @property
    def n_decoder_layers(self) -> int:
        return self.n_layers - self.decoder_start

    @property
    def exact_prefill_tokens(self) -> int:
        """Decoder tokens that make prefill exact.

        Each decoder layer's window reaches n_win - 1 tokens back, so L_dec stacked windows give
        L_dec * (n_win - 1) + 1. The first decoder layer (the global-KV source) writes its window
        KV for every prompt token in the encoder pass (as vLLM's decoder replay does), so its
        window is always complete and one window less suffices: (L_dec - 1) * (n_win - 1) + 1.
        """
        return max(self.n_decoder_layers - 1, 0) * (self.sliding_window - 1) + 1

    def rope_theta_of(self, layer: int) -> float:
        return self.rope_theta if self.compress_ratios[layer] == 0 else self.compress_rope_theta

    def uses_yarn(self, layer: int) -> bool:
        return self.compress_ratios[layer] > 0 and bool(self.rope_scaling)

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise `ConfigError` naming the first invalid field (see `cedlm.config.validate`)."""
        _validate(self)

    # ------------------------------------------------------------------ (de)serialisation
    _TOP_LEVEL = ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id")
    _CEDLM = ("family", "main_kv_format", "index_kv_format", "window_kv_format", "q_head_norm", "arch",
              "engram_token_map", "rope_precision")

    @classmethod
    def _field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)} - {"extra"}

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = copy.deepcopy(d)
        mt = d.get("model_type", "")
        if "text_config" in d:                      # official V4.1 (nested HF-style)
            return cls._from_nested(d)
        if mt == "deepseek_v4":
            return cls._from_v4(d)
        if mt in ("deepseek_v3", "deepseek_v32"):
            return cls._from_flat(d, family="mla", known=(
                "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "qk_rope_head_dim", "q_lora_rank", "kv_lora_rank",
                "moe_intermediate_size", "intermediate_size", "n_routed_experts",
                "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace",
                "num_nextn_predict_layers", "bos_token_id", "eos_token_id", "max_position_embeddings",
                "rms_norm_eps", "rope_theta", "routed_scaling_factor", "scoring_func",
                "tie_word_embeddings", "model_type"),
                extra_fix={"head_dim": d.get("qk_nope_head_dim", 128) + d.get("qk_rope_head_dim", 64)})
        if mt == "llama" or "num_key_value_heads" in d and "compress_ratios" not in d:
            hd = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
            return cls._from_flat(d, family="llama", known=(
                "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "bos_token_id", "eos_token_id",
                "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
                "model_type", "head_dim"), extra_fix={"head_dim": hd})
        if "compress_ratios" in d:                  # a flat cedlm/V4.1-style dict
            return cls._from_flat_ced(d)
        raise ConfigError(f"model_type: unsupported {mt!r} (expected deepseek_v41, deepseek_v4, "
                          "deepseek_v3 or llama)")

    @classmethod
    def _from_nested(cls, d: dict) -> "ModelConfig":
        top_keys = [k for k in d if k != "cedlm"]
        tc = d.pop("text_config")
        kw: dict[str, Any] = {}
        names = cls._field_names()
        extra: dict[str, Any] = {"top": {}, "text": {}}
        for k, v in tc.items():
            (kw.__setitem__(k, v) if k in names else extra["text"].__setitem__(k, v))
        _apply_rope_parameters(tc, kw)
        ced = d.pop("cedlm", {})
        for k, v in d.items():
            if k in cls._TOP_LEVEL:
                kw[k] = v
            else:
                extra["top"][k] = v
        extra["text_keys"] = list(tc.keys())
        extra["top_keys"] = top_keys
        for k in cls._CEDLM:
            if k in ced:
                kw[k] = ced[k]
        kw["family"] = ced.get("family", "ced")
        return cls(**kw, extra=extra)

    @classmethod
    def _from_flat_ced(cls, d: dict) -> "ModelConfig":
        names = cls._field_names()
        unknown = sorted(set(d) - names - {"rope_parameters"})
        if unknown:
            raise ConfigError(f"{unknown[0]}: unknown config field")
        kw = {k: v for k, v in d.items() if k != "rope_parameters"}
        _apply_rope_parameters(d, kw)
        return cls(**kw)

    @classmethod
    def _from_flat(cls, d: dict, family: str, known: tuple, extra_fix: dict) -> "ModelConfig":
        kw = {k: d[k] for k in known if k in d}
        kw.update(extra_fix)
        kw["family"] = family
        return cls(**kw, extra={"flat": d})

    @classmethod
    def _from_v4(cls, d: dict) -> "ModelConfig":
        """V4-Flash: every compressed layer owns its KV; ratio-4 (CSA) layers own index keys."""
        names = cls._field_names()
        kw = {k: v for k, v in d.items() if k in names}
        L = d["num_hidden_layers"]
        ratios = d["compress_ratios"]
        kw["kv_source_layer_ids"] = [i for i in range(L) if ratios[i] > 0]
        kw["index_source_layer_ids"] = [i for i in range(L) if 0 < ratios[i] <= 4]
        kw["candidate_source_layer_id"] = None
        kw["engram_layer_ids"], kw["engram_num_embeddings"] = [], []
        # DSpark taps as the file gives them (V4-Flash-0731: 3 taps for 1 draft layer).
        kw["dspark_target_layer_ids"] = list(d.get("dspark_target_layer_ids") or [])
        kw["family"] = "v4"
        kw["main_kv_format"] = "v4_fp8"
        kw["image_token_id"] = None
        kw["model_type"] = "deepseek_v4"
        # The draft-layer count as the file states it; without it, one per trailing schedule
        # entry. (V4-Flash-0731 lists 3 trailing entries for 1 draft layer.)
        kw["num_nextn_predict_layers"] = d.get("num_nextn_predict_layers", len(ratios) - L)
        _apply_rope_parameters(d, kw)
        return cls(**kw, extra={"flat": d})

    def to_dict(self) -> dict:
        """The official nested schema (round-trips a file read by `from_json`)."""
        if self.family != "ced":
            return copy.deepcopy(self.extra["flat"])
        vals = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}
        extra = self.extra or {}
        top_keys = extra.get("top_keys") or ["architectures", "model_type", "dtype",
                                              *self._TOP_LEVEL, "text_config"]
        top_extra = extra.get("top", {"architectures": ["DeepseekV41ForCausalLM"],
                                      "model_type": "deepseek_v41", "dtype": "bfloat16"})
        text_fields = [f.name for f in dataclasses.fields(self)
                       if f.name not in self._TOP_LEVEL and f.name not in self._CEDLM
                       and f.name not in ("extra", "kv_lora_rank", "intermediate_size",
                                          "first_k_dense_replace", "num_hash_layers")]
        text_keys = extra.get("text_keys") or text_fields
        text = {}
        for k in text_keys:
            text[k] = vals[k] if k in vals else extra.get("text", {}).get(k)
        carried: set[str] = set()          # fields the file states only inside rope_parameters
        if isinstance(text.get("rope_parameters"), dict):
            carried = set(_read_rope_parameters(text["rope_parameters"]))
            text["rope_parameters"] = _write_rope_parameters(text["rope_parameters"], self)
        for k in text_fields:              # fields the source file did not list
            if k not in carried:
                text.setdefault(k, vals[k])
        out: dict[str, Any] = {}
        for k in top_keys:
            if k == "text_config":
                out[k] = text
            elif k in self._TOP_LEVEL:
                out[k] = vals[k]
            else:
                out[k] = top_extra.get(k)
        out.setdefault("text_config", text)
        for k, v in top_extra.items():
            out.setdefault(k, v)
        for k in self._TOP_LEVEL:
            out.setdefault(k, vals[k])
        ced = {k: vals[k] for k in self._CEDLM if vals[k] != getattr(ModelConfig, k, None)}
        if ced:
            out["cedlm"] = ced
        return out

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config: no such file {path}") from None
        return cls.from_dict(d)

    def save_json(self, path: str | Path) -> None:
        from cedlm.util import atomic_write_text
        atomic_write_text(Path(path), json.dumps(self.to_dict(), indent=2) + "\n")

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        from cedlm.config.presets import PRESETS
        if name not in PRESETS:
            raise ConfigError(f"preset: unknown {name!r}; choose from {sorted(PRESETS)}")
        return PRESETS[name]()
