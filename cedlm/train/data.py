"""Training data: a token file cache and deterministic batch samplers.

`token_cache(text, tokenizer)` tokenises a corpus file (documents separated by the EOS line, see
`cedlm.data.corpus`) once into a flat binary file of token ids, each document followed by EOS. The
file name carries the tokenizer hash and the corpus sha256, so a changed corpus or vocabulary never
reads stale tokens; it is written to a temp file and renamed (never half-written), and read back
with `np.memmap` (the 42 MB corpus is ~10M tokens, 20 MB as uint16).

`BatchSampler` draws random windows of seq_len + 1 tokens from a seeded numpy generator. Its state
(the generator state and the number of batches drawn) goes into the checkpoint, so a resumed run
draws exactly the batches the uninterrupted run would have. Under DDP every rank draws the same
global batch of window starts and keeps its own contiguous slice: N ranks see exactly the batch one
process would. `val_windows` gives a fixed, evenly spaced set of windows for validation.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from cedlm.data.corpus import atomic_open, iter_documents, sha256_file

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


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int):
    """Stack windows of seq_len + 1 tokens -> (inputs, targets), int64 [len(starts), seq_len]."""
    buf = np.stack([np.asarray(tokens[s: s + seq_len + 1], dtype=np.int64) for s in starts])
    t = torch.from_numpy(buf)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class BatchSampler:
    """Random windows of seq_len + 1 tokens; the global batch is sliced across ranks."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int,
                 rank: int = 0, world_size: int = 1):
        if global_batch % world_size:
            raise ValueError(f"batch_size: {global_batch} is not divisible by {world_size} ranks")
        if len(tokens) < seq_len + 2:
            raise ValueError(f"data: {len(tokens)} tokens is too few for seq_len {seq_len}")
        self.tokens, self.seq_len, self.global_batch = tokens, seq_len, global_batch
        self.rank, self.world_size = rank, world_size
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.batches = 0                    # batches drawn so far

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.world_size

    def next_batch(self):
        """(inputs, targets) of this rank: int64 [global_batch / world_size, seq_len]."""
        starts = self.rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.global_batch)
        self.batches += 1
        b = self.local_batch
        return _windows(self.tokens, starts[self.rank * b: (self.rank + 1) * b], self.seq_len)

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state, "batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.batches = state["batches"]


def val_windows(tokens: np.ndarray, seq_len: int, n_windows: int) -> np.ndarray:
    """Fixed window starts, evenly spaced over the split (deterministic, no RNG)."""
    last = len(tokens) - seq_len - 1
    if last < 0:
        raise ValueError(f"data: {len(tokens)} validation tokens is too few for seq_len {seq_len}")
    return np.unique(np.linspace(0, last, n_windows).astype(np.int64))


def val_batches(tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int,
                rank: int = 0, world_size: int = 1):
    """Yield this rank's slice of each fixed validation batch (the same on every call)."""
    starts = val_windows(tokens, seq_len, batch_size * n_batches)
    for i in range(0, len(starts), batch_size):
        chunk = starts[i: i + batch_size]
        mine = np.array_split(chunk, world_size)[rank]
        if len(mine):
            yield _windows(tokens, mine, seq_len)
