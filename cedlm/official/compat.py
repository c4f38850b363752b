"""What an engine that follows the official config would read differently from cedlm.

An official-layout export is read by other engines (vLLM's `deepseek_v41`, the reference code)
from the official fields of config.json and the tokenizer files alone; cedlm's own block of
config.json (`"cedlm": {...}`) is invisible to them. Three things then change the model's output
without any error there:

- the Engram token map: an official engine builds the V4.1 map from the tokenizer
  (`cedlm.text.engram_map`, "v41"); a model trained with another map (`engram_token_map`,
  e.g. "legacy-v0") hashes other n-grams there;
- the RoPE precision: the published code computes the frequencies and angles in float32; a
  model trained with `rope_precision: "float64"` gets other angles at long positions;
- the tokenizer: the config's bos / eos ids must be the tokenizer's, and with a vision tower the
  tokenizer's `<｜deepseek_image｜>` must be `image_token_id` (vLLM's
  `deepseek_v41/common/mm_preprocess.py`, `validate_image_sentinel_ids`, refuses it otherwise).

`official_differences(cfg, tokenizer)` lists each difference as one phrase that says what
would change; `cedlm.official.export.export_official` refuses to write a model that has any
(unless told to), `cedlm export --format official --allow-cedlm-fields` writes it anyway.
"""
from __future__ import annotations

from cedlm.config import ModelConfig

IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"


def _engram_difference(cfg: ModelConfig, tokenizer) -> str | None:
    from cedlm.text.engram_map import V41, build_token_map
    kind = getattr(cfg, "engram_token_map", V41) or V41
    if kind == V41 or not cfg.engram_layer_ids or tokenizer is None:
        return None
    own, _ = build_token_map(tokenizer, kind)
    off, n_off = build_token_map(tokenizer, V41)
    k = min(len(own), len(off), cfg.vocab_size)
    moved = sum(1 for a, b in zip(own[:k], off[:k]) if a != b)
    size = (f"; its {n_off:,} compressed ids vs engram_compressed_vocab_size "
            f"{cfg.engram_compressed_vocab_size:,}" if n_off != cfg.engram_compressed_vocab_size else "")
    return (f"Engram token map {kind!r}: an official engine builds the 'v41' map from the tokenizer, "
            f"{moved:,} of {k:,} token ids would hash with another compressed id{size}")


def _rope_difference(cfg: ModelConfig) -> str | None:
    prec = getattr(cfg, "rope_precision", "float32")
    if prec == "float32":
        return None
    # float32 angles: the frequency (relative error 2^-24) times the position, rounded again
    pos = cfg.max_position_embeddings
    return (f"RoPE precision {prec!r}: an official engine computes the angles in float32 "
            f"(off by up to ~{pos * 2.0 ** -23:.1e} rad at position {pos:,})")


def _tokenizer_difference(cfg: ModelConfig, tokenizer) -> list[str]:
    if tokenizer is None:
        return ["tokenizer: none given, none written (an official engine reads it from the directory)"]
    out = []
    for field, have in (("bos_token_id", tokenizer.bos_id), ("eos_token_id", tokenizer.eos_id)):
        want = getattr(cfg, field)
        ids = want if isinstance(want, list) else [want]
        if have not in ids:
            out.append(f"tokenizer: its {field.split('_')[0]} is id {have}, config.json says {want}")
    if tokenizer.vocab_size > cfg.vocab_size:
        out.append(f"tokenizer: {tokenizer.vocab_size:,} tokens, vocab_size is {cfg.vocab_size:,}")
    from cedlm.config.vision import vision_enabled
    if vision_enabled(cfg):
        img = tokenizer.token_to_id(IMAGE_PLACEHOLDER)
        if img != cfg.image_token_id:
            out.append(f"tokenizer: {IMAGE_PLACEHOLDER} is id {img}, image_token_id is "
                       f"{cfg.image_token_id} (an official engine refuses image requests)")
    return out


def official_differences(cfg: ModelConfig, tokenizer) -> list[str]:
    """Each way an engine following the official config and tokenizer would read this model
    differently from cedlm (empty: it reads it the same)."""
    out = [d for d in (_engram_difference(cfg, tokenizer), _rope_difference(cfg)) if d]
    return out + _tokenizer_difference(cfg, tokenizer)
