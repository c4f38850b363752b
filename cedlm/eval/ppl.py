"""Perplexity and bits per byte of a text under a model, and a unigram baseline.

`evaluate_ppl` tokenises the whole text, prepends one EOS token as context (training sequences see
the previous document's EOS before a document starts), and scores every token of the text exactly
once with non-overlapping windows of `seq_len` tokens (each window sees only its own prefix):

    perplexity    = exp(total nats / tokens)
    bits_per_byte = total nats / ln 2 / UTF-8 bytes of the text

Bits per byte does not depend on the vocabulary, so it compares models with different tokenizers
(and the unigram baseline, which uses the same formula on the same tokens).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

DEFAULT_SEQ_LEN = 256


def resolve_model(spec: str | Path | None, device=None):
    """--model value -> (model, tokenizer, name): a checkpoint or run directory, a preset, or
    None for the shipped default model, on `device` (a resolved `torch.device`; None: the CPU).
    The decoder-only baseline loads too (for comparisons)."""
    from cedlm.config.presets import PRESETS
    from cedlm.engine.loader import DEFAULT_MODEL, load_any
    if spec is not None and str(spec) not in PRESETS:
        from cedlm.checkpoint import load_model, resolve_checkpoint
        path = resolve_checkpoint(spec)
        model, tok = load_model(path, device="cpu" if device is None else device)
        return model, tok, str(path)
    model, tok = load_any(spec, device=device)
    return model, tok, str(spec or DEFAULT_MODEL)


def trained_seq_len(path: str | Path) -> int | None:
    """The seq_len a checkpoint was trained with (from its training_args.json), if recorded."""
    import json
    f = Path(path) / "training_args.json"
    if f.exists():
        return json.loads(f.read_text()).get("seq_len")
    return None


@torch.no_grad()
def evaluate_ppl(model, tokenizer, text: str, seq_len: int = DEFAULT_SEQ_LEN, batch_size: int = 8,
                 progress: bool = False, model_name: str | None = None) -> dict:
    """Score `text` under `model` (on its device): {perplexity, bits_per_byte, tokens, bytes, nats,
    model}."""
    ids = tokenizer.encode(text)
    n_bytes = len(text.encode("utf-8"))
    if not ids:
        raise ValueError("text: nothing to score (empty after tokenisation)")
    dev = next(model.parameters()).device
    seq = torch.tensor([tokenizer.eos_id] + ids, dtype=torch.int64, device=dev)
    starts = list(range(0, len(ids), seq_len))              # window i predicts seq[s+1 : s+L+1]
    was = model.training
    model.eval()
    nats = 0.0
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(ids), unit="tok", desc="eval ppl", dynamic_ncols=True)
    # Full windows in batches, then the (shorter) last window on its own.
    full = [s for s in starts if s + seq_len <= len(ids)]
    rest = [s for s in starts if s + seq_len > len(ids)]
    groups = [full[i: i + batch_size] for i in range(0, len(full), batch_size)] + [[s] for s in rest]
    for group in groups:
        L = min(seq_len, len(ids) - group[0])
        x = torch.stack([seq[s: s + L] for s in group])
        y = torch.stack([seq[s + 1: s + L + 1] for s in group])
        logits = model(x)
        nats += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").double().item()
        if bar is not None:
            bar.update(y.numel())
    if bar is not None:
        bar.close()
    model.train(was)
    return _result(nats, len(ids), n_bytes, model_name)


def _result(nats: float, tokens: int, n_bytes: int, model_name: str | None) -> dict:
    return {"model": model_name, "perplexity": math.exp(nats / tokens),
            "bits_per_byte": nats / math.log(2) / max(n_bytes, 1),
            "tokens": tokens, "bytes": n_bytes, "nats": nats}


# ---------------------------------------------------------------------------- unigram baseline
def fit_unigram(token_ids, vocab_size: int) -> np.ndarray:
    """Log-probabilities of an add-one smoothed unigram model: log((count_i + 1) / (N + V))."""
    counts = np.bincount(np.asarray(token_ids, dtype=np.int64), minlength=vocab_size).astype(np.float64)
    return np.log(counts + 1.0) - np.log(counts.sum() + vocab_size)


def evaluate_unigram(logp: np.ndarray, tokenizer, text: str, model_name: str = "unigram") -> dict:
    """Score the same tokens `evaluate_ppl` scores (every token of the text) under a unigram."""
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    if ids.size == 0:
        raise ValueError("text: nothing to score (empty after tokenisation)")
    nats = float(-logp[ids].sum())
    return _result(nats, int(ids.size), len(text.encode("utf-8")), model_name)


def unigram_baseline(train_file: str | Path, text: str, tokenizer, cache_dir: str | Path | None = None) -> dict:
    """Fit on `train_file` (corpus format or plain text; tokenised through the token cache)."""
    from cedlm.data.tokens import token_cache
    tokens = token_cache(train_file, tokenizer, cache_dir)
    logp = fit_unigram(tokens, tokenizer.vocab_size)
    out = evaluate_unigram(logp, tokenizer, text)
    out["train_tokens"] = int(len(tokens))
    return out
