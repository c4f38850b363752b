"""Token cache: a corpus file tokenised once into a flat binary file of token ids.

`token_cache(text, tokenizer)` tokenises a corpus file (documents separated by the EOS line, see
`cedlm.text.documents`) into token ids, each document followed by EOS. The file name carries the
tokenizer hash and the corpus sha256, so a changed corpus or vocabulary never reads stale tokens;
it is written to a temp file and renamed (never half-written), and read back with `np.memmap`
(the 42 MB corpus is ~10M tokens, 20 MB as uint16). Training and the unigram baseline of
`cedlm eval` read corpora through it.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from cedlm.data.corpus import sha256_file
from cedlm.text.documents import iter_documents
from cedlm.util import atomic_open

CACHE_VERSION = 1
ENCODE_CHUNK = 256          # documents per encode_batch call


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the tokenizer's serialised form (vocabulary, merges, pre-tokenizer)."""
    return hashlib.sha256(tokenizer.hf.to_str(pretty=False).encode("utf-8")).hexdigest()


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


def cache_path(text: Path, tokenizer, cache_dir: Path) -> Path:
    key = f"v{CACHE_VERSION}-{tokenizer_hash(tokenizer)[:16]}-{sha256_file(text)[:16]}"
    dt = np.dtype(token_dtype(tokenizer.vocab_size)).name
    return Path(cache_dir) / f"{Path(text).stem}-{key}.{dt}.bin"


def tokenize_to_file(text: Path, tokenizer, out: Path, progress: bool = False) -> int:
    """Encode every document of `text` (+ EOS after each) into `out`, atomically; returns #tokens."""
    dtype = token_dtype(tokenizer.vocab_size)
    n = 0
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=os.path.getsize(text), unit="B", unit_scale=True, desc=f"tokenise {Path(text).name}")
    try:
        with atomic_open(out, "wb") as f:
            docs: list[str] = []

            def flush():
                nonlocal n
                for ids in tokenizer.encode_batch(docs):
                    arr = np.asarray(ids + [tokenizer.eos_id], dtype=dtype)
                    f.write(arr.tobytes())
                    n += arr.size
                if bar is not None:
                    bar.update(sum(len(d.encode("utf-8")) for d in docs))
                docs.clear()

            for doc in iter_documents(text):
                docs.append(doc)
                if len(docs) >= ENCODE_CHUNK:
                    flush()
            flush()
    finally:
        if bar is not None:
            bar.close()
    return n


def token_cache(text: str | Path, tokenizer, cache_dir: str | Path | None = None,
                build: bool = True, progress: bool = False) -> np.ndarray:
    """Token ids of a corpus file as a read-only memmap, tokenising it on first use.

    `cache_dir` defaults to `<text's dir>/tokens`. With `build=False` the cache must exist (DDP
    ranks other than 0 wait for rank 0 to build it, then read it).
    """
    text = Path(text)
    if not text.exists():
        raise FileNotFoundError(f"data: no such file {text}")
    path = cache_path(text, tokenizer, Path(cache_dir) if cache_dir else text.parent / "tokens")
    if not path.exists():
        if not build:
            raise FileNotFoundError(f"token cache {path} missing")
        tokenize_to_file(text, tokenizer, path, progress=progress)
    return np.memmap(path, dtype=token_dtype(tokenizer.vocab_size), mode="r")
