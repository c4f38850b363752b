"""Training data: deterministic batch samplers over a token cache (`cedlm.data.tokens`).

`BatchSampler` draws random windows of seq_len + 1 tokens from a seeded numpy generator. Its state
(the generator state and the number of batches drawn) goes into the checkpoint, so a resumed run
draws exactly the batches the uninterrupted run would have. Under DDP every rank draws the same
global batch of window starts and keeps its own contiguous slice: N ranks see exactly the batch one
process would. `val_windows` gives a fixed, evenly spaced set of windows for validation.
"""
from __future__ import annotations

import numpy as np
import torch


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
