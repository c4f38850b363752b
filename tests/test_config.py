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
