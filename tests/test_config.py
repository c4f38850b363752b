"""Config: the official schema round-trips; roles derive from the lists; bad configs name the field."""
import json

import pytest

from cedlm.config import CONFIG_DIR, ConfigError, ModelConfig

V41 = CONFIG_DIR / "deepseek-v4.1-flash.config.json"


def test_official_v41_roundtrip():
    raw = json.loads(V41.read_text())
    cfg = ModelConfig.from_json(V41)
    assert cfg.to_dict() == raw
    assert list(cfg.to_dict()) == list(raw)                          # key order kept
    assert list(cfg.to_dict()["text_config"]) == list(raw["text_config"])


def test_official_v41_roles():
    cfg = ModelConfig.from_json(V41)
    roles = cfg.roles
    assert roles[:2] == ["swa", "swa"]
    assert [i for i, r in enumerate(roles) if r == "full"] == [2, 8, 14, 20]
    assert [i for i, r in enumerate(roles) if r == "reindex"] == [24, 28, 32, 36]
    assert roles.count("reuse") == 40 - 2 - 4 - 4
    assert cfg.decoder_start == 20 and cfg.n_decoder_layers == 20
    assert cfg.kv_source_of(19) == 14 and cfg.kv_source_of(39) == 20
    assert cfg.index_source_of(27) == 24 and cfg.index_source_of(23) == 20
    assert cfg.index_key_layer_ids == [2, 8, 14, 20]
    assert cfg.rope_theta_of(0) == 10000 and cfg.rope_theta_of(2) == 160000
    assert cfg.exact_prefill_tokens == 19 * 127 + 1


@pytest.mark.parametrize("name", ["deepseek-v4-flash", "deepseek-v3", "deepseek-llm-67b"])
def test_other_configs_load_and_roundtrip(name):
    path = CONFIG_DIR / f"{name}.config.json"
    cfg = ModelConfig.from_json(path)
    assert cfg.to_dict() == json.loads(path.read_text())


def test_v4_mapping():
    cfg = ModelConfig.preset("deepseek-v4-flash")
    assert cfg.family == "v4" and cfg.main_kv_format == "v4_fp8"
    assert len(cfg.kv_source_layer_ids) == 41              # 21 ratio-4 + 20 ratio-128
    assert len(cfg.index_source_layer_ids) == 21
    assert cfg.decoder_start == cfg.n_layers               # no decoder


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_presets_keep_official_structure(name):
    cfg = ModelConfig.preset(name)
    roles = cfg.roles
    assert roles[0] == "swa"
    d = cfg.decoder_start
    assert roles[d] == "full" and cfg.compress_ratios[d] == 1
    assert cfg.candidate_source_layer_id == d
    assert "reindex" in roles[d:] and "reuse" in roles[d:]
    enc = [cfg.compress_ratios[i] for i in range(d) if roles[i] != "swa"]
    assert set(enc) == {2} and roles.count("full") >= 3
    assert cfg.engram_layer_ids and cfg.hc_mult >= 2 and cfg.n_shared_experts == 1
    # the saved file is the official nested schema and loads back identically
    again = ModelConfig.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()


def _bad(**kw):
    d = ModelConfig.preset("tiny").to_dict()
    d["text_config"].update(kw)
    return d


@pytest.mark.parametrize("change, field", [
    (dict(kv_source_layer_ids=[0, 2, 4, 6]), "kv_source_layer_ids"),          # ratio-0 source
    (dict(candidate_source_layer_id=7), "candidate_source_layer_id"),         # not a KV source
    (dict(head_dim=40, qk_rope_head_dim=8), "head_dim"),                      # not a multiple of 16/32
    (dict(index_head_dim=48), "index_head_dim"),                             # not a multiple of 32
    (dict(compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1]), "compress_ratios"),   # wrong length
    (dict(engram_num_embeddings=[10]), "engram_num_embeddings"),              # mismatched lengths
    (dict(kv_source_layer_ids=[4, 2, 6]), "kv_source_layer_ids"),             # not sorted
    (dict(o_groups=3), "o_groups"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(engram_layer_ids=[1, 7], engram_num_embeddings=[10, 10]), "engram_layer_ids"),
    (dict(compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 2, 1, 0]), "compress_ratios"),
])
def test_invalid_configs_name_the_field(change, field):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(_bad(**change))
    assert str(e.value).startswith(field), str(e.value)


def test_unknown_preset_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="preset"):
        ModelConfig.preset("nope")
    with pytest.raises(ConfigError, match="no such file"):
        ModelConfig.from_json(tmp_path / "x.json")


def test_save_json_roundtrip(tmp_path):
    cfg = ModelConfig.preset("small")
    cfg.save_json(tmp_path / "config.json")
    assert ModelConfig.from_json(tmp_path).to_dict() == cfg.to_dict()


# ----------------------------------------------------------------------------- published variants
V4 = CONFIG_DIR / "deepseek-v4-flash.config.json"


def _v41_text(**change):
    d = json.loads(V41.read_text())
    d["text_config"].update(change)
    return d


def test_v41_draft_blocks_and_taps():
    cfg = ModelConfig.from_json(V41)
    assert len(cfg.compress_ratios) == 43 and cfg.n_layers == 40          # 40 layers + 3 drafts
    assert cfg.num_nextn_predict_layers == 3 and cfg.dspark_target_layer_ids == [37, 38, 39]
    assert cfg.engram_token_map == "v41"                                   # absent -> v41
    # one draft layer fed by three taps (the V4-Flash-0731 shape) is valid in the V4.1 schema
    one = ModelConfig.from_dict(_v41_text(num_nextn_predict_layers=1))
    assert one.num_nextn_predict_layers == 1 and one.dspark_target_layer_ids == [37, 38, 39]
    assert one.to_dict() == _v41_text(num_nextn_predict_layers=1)


@pytest.mark.parametrize("change, field", [
    (dict(compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0] * 4), "compress_ratios"),   # 40 + 4
    (dict(compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 0, 1]), "compress_ratios"),  # draft != 0
    (dict(compress_ratios=[0, 0] + [2] * 18 + [1] * 19), "compress_ratios"),             # 39 < 40
    (dict(dspark_target_layer_ids=[37, 38, 40]), "dspark_target_layer_ids"),             # >= layers
    (dict(dspark_target_layer_ids=[38, 37]), "dspark_target_layer_ids"),                 # unsorted
    (dict(engram_token_map="v2"), "engram_token_map"),
])
def test_v41_variants_rejected_name_the_field(change, field):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(_v41_text(**change))
    assert str(e.value).startswith(field), str(e.value)


def test_v4_flash_base_and_0731():
    base = ModelConfig.from_json(V4)
    assert base.n_layers == 43 and len(base.compress_ratios) == 44
    assert base.num_nextn_predict_layers == 1 and base.dspark_target_layer_ids == []
    # -0731 (delta from shared/reference/deepseek-v4-flash.config.notes.md): 46 schedule
    # entries and DSpark with 3 taps, still one draft layer
    d = json.loads(V4.read_text())
    d.update(compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0, 0, 0], dspark_block_size=5,
             dspark_noise_token_id=128799, dspark_target_layer_ids=[40, 41, 42],
             dspark_markov_rank=256)
    v0731 = ModelConfig.from_dict(d)
    assert v0731.num_nextn_predict_layers == 1
    assert v0731.dspark_target_layer_ids == [40, 41, 42] and len(v0731.compress_ratios) == 46
    assert v0731.roles == base.roles and v0731.to_dict() == d
    d["compress_ratios"] = d["compress_ratios"] + [0]                     # 47: too long
    with pytest.raises(ConfigError, match="^compress_ratios"):
        ModelConfig.from_dict(d)


# ----------------------------------------------------------------------------- rope_parameters
ROPE_FIELDS = ("rope_theta", "compress_rope_theta", "rope_scaling")


def _rope_of(cfg):
    return {k: getattr(cfg, k) for k in ROPE_FIELDS}


def _nest_rope(d_text: dict, params) -> dict:
    for k in ("rope_theta", "rope_scaling"):
        d_text.pop(k, None)
    d_text["rope_parameters"] = params
    return d_text


def test_rope_parameters_flat_is_read_and_round_trips():
    ref = ModelConfig.from_json(V41)
    d = json.loads(V41.read_text())
    _nest_rope(d["text_config"], {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16,
                                  "beta_fast": 32, "beta_slow": 1,
                                  "original_max_position_embeddings": 65536})
    cfg = ModelConfig.from_dict(d)
    assert cfg.rope_theta == ref.rope_theta and cfg.compress_rope_theta == ref.compress_rope_theta
    assert {k: cfg.rope_scaling[k] for k in ref.rope_scaling} == ref.rope_scaling
    assert cfg.to_dict() == d                                   # no rope_scaling/rope_theta added
    # values that differ from the defaults are read, not defaulted
    d["text_config"]["rope_parameters"].update(factor=8, rope_theta=20000.0)
    cfg = ModelConfig.from_dict(d)
    assert cfg.rope_scaling["factor"] == 8 and cfg.rope_theta == 20000.0
    # a changed config writes its values back into rope_parameters
    out = cfg.replace(rope_theta=30000.0).to_dict()["text_config"]
    assert out["rope_parameters"]["rope_theta"] == 30000.0 and "rope_theta" not in out


def test_rope_parameters_split_by_layer_kind():
    d = json.loads(V41.read_text())
    _nest_rope(d["text_config"], {
        "main": {"rope_type": "default", "rope_theta": 12345.0},
        "compress": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4, "beta_fast": 32,
                     "beta_slow": 1, "original_max_position_embeddings": 8192}})
    d["text_config"].pop("compress_rope_theta")
    cfg = ModelConfig.from_dict(d)
    assert cfg.rope_theta == 12345.0 and cfg.compress_rope_theta == 150000.0
    assert cfg.rope_scaling["factor"] == 4 and cfg.rope_scaling["original_max_position_embeddings"] == 8192
    assert cfg.rope_theta_of(0) == 12345.0 and cfg.rope_theta_of(2) == 150000.0 and cfg.uses_yarn(2)
    assert cfg.to_dict() == d
    # plain RoPE everywhere
    d["text_config"]["rope_parameters"]["compress"] = {"rope_type": "default", "rope_theta": 1e5}
    cfg = ModelConfig.from_dict(d)
    assert cfg.rope_scaling is None and not cfg.uses_yarn(2) and cfg.to_dict() == d


def test_rope_parameters_small_model_and_v4_flat():
    tiny = ModelConfig.preset("tiny")
    d = tiny.to_dict()
    _nest_rope(d["text_config"], {"rope_type": "yarn", "rope_theta": tiny.rope_theta,
                                  **{k: v for k, v in tiny.rope_scaling.items() if k != "rope_type"}})
    again = ModelConfig.from_dict(d)
    assert again.rope_theta == tiny.rope_theta and again.rope_scaling["factor"] == tiny.rope_scaling["factor"]
    flat = json.loads(V4.read_text())
    flat.pop("rope_scaling"), flat.pop("rope_theta")
    flat["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000, "factor": 4,
                               "beta_fast": 32, "beta_slow": 1,
                               "original_max_position_embeddings": 65536}
    v4 = ModelConfig.from_dict(flat)
    assert v4.rope_scaling["factor"] == 4 and v4.to_dict() == flat


@pytest.mark.parametrize("params, extra", [
    ({"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8}, {}),          # unsupported
    ({"rope_type": "yarn", "rope_theta": 10000.0}, {}),                          # YaRN lacks factor
    ({"rope_type": "default", "rope_theta": 10000.0}, {"rope_theta": 20000.0}),  # contradicts
    ("yarn", {}),                                                                # not an object
])
def test_rope_parameters_errors(params, extra):
    d = json.loads(V41.read_text())
    _nest_rope(d["text_config"], params)
    d["text_config"].update(extra)
    with pytest.raises(ConfigError, match="^rope_parameters"):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize("field", ["main_kv_format", "window_kv_format", "index_kv_format"])
def test_kv_format_none_is_refused_by_name(field):
    """'none' has no byte layout (the model raised on it deep inside the cache): config
    validation refuses it, naming the field and the alternative."""
    with pytest.raises(ConfigError, match=rf"{field}: 'none' is not a KV storage format.*bf16"):
        ModelConfig.preset("tiny").replace(**{field: "none"})
    with pytest.raises(ConfigError, match=rf"{field}: unknown 'fp3'"):
        ModelConfig.preset("tiny").replace(**{field: "fp3"})
