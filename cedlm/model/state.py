"""Per-sequence inference state, held in the byte formats (uint8 storage).

What a sequence owns:
- window ring buffers, one per layer: `n_win` slots of `window_fp8` bytes + the position in each;
- per KV-source layer: the compressed main KV (`kv_fp4` bytes, one row per entry) and, for
  index-key layers, the index keys (`index_fp4` bytes), both growing with context;
- per ratio>1 source: the compressor's pending rows (fp32 projections of an incomplete group);
- the token ids (Engram history; what persistence stores with the global KV).
Reuse and Reindex layers own nothing. `nbytes()` reports what is allocated, by kind.
This is the contiguous reference store; the engine's paged pool keeps the same rows in blocks.
"""
from __future__ import annotations

import torch

from cedlm.kv_layout import KVLayout
from cedlm.kernels import decode, encode


# A ByteRows' capacity is a multiple of this many rows, as the engine's paged pools are whole
# blocks: a whole number of the indexer's candidate blocks (8 rows in the official config; any
# size dividing 64), so a compiled step sees the same divisibility whatever holds the rows (its
# graph guards on it: a graph built on paged rows recompiled for contiguous rows of another
# capacity).
ROW_QUANTUM = 64


def _whole(n: int) -> int:
    return -(-max(n, 1) // ROW_QUANTUM) * ROW_QUANTUM


class ByteRows:
    """A growable [n, width] uint8 matrix (amortised doubling, capacity a multiple of
    `ROW_QUANTUM` rows) on `device`; `nbytes` counts used rows, `allocated` the buffer."""

    def __init__(self, width: int, capacity: int = 16, device: torch.device | str = "cpu"):
        self.width = width
        self.buf = torch.zeros(_whole(capacity), width, dtype=torch.uint8, device=device)
        self.n = 0

    def append(self, rows: torch.Tensor) -> None:
        k = rows.shape[0]
        self.reserve(self.n + k)
        self.buf[self.n: self.n + k] = rows
        self.n += k

    def reserve(self, n: int) -> None:
        """Room for at least n rows (grows by doubling; the rows kept)."""
        if n > self.buf.shape[0]:
            cap = _whole(max(self.buf.shape[0] * 2, n))
            new = torch.zeros(cap, self.width, dtype=torch.uint8, device=self.buf.device)
            new[: self.n] = self.buf[: self.n]
            self.buf = new

    def view(self) -> torch.Tensor:
        return self.buf[: self.n]

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows at entry indices idx [...] -> [..., width] (indices must be < n)."""
        return self.buf[idx]

    def blocks(self) -> tuple[torch.Tensor, list[int]]:
        """The rows as a pool of blocks and this sequence's block ids: ([1, capacity, width],
        [0]): one block (the compiled decode step reads paged and contiguous rows alike)."""
        return self.buf.unsqueeze(0), [0]

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)

    def set_len(self, n: int) -> None:
        """The first n rows are valid (rows written elsewhere, e.g. adopted paged blocks)."""
        if n > self.buf.shape[0]:
            raise ValueError(f"set_len: {n} rows exceed the {self.buf.shape[0]} allocated")
        self.n = n

    @property
    def nbytes(self) -> int:
        return self.n * self.width

    @property
    def allocated(self) -> int:
        return self.buf.numel()


class SequenceState:
    """`rows(spec)` makes the store of one row kind (a `RowSpec` of the KV layout): contiguous
    `ByteRows` by default, or the engine's paged rows (cedlm.cache.block_pool, whose pool must
    be on the same device). Every tensor of the state lives on `device` (the model's); the token
    ids and counts are host-side Python values."""

    def __init__(self, layout: KVLayout, rows=None, device: torch.device | str = "cpu"):
        self.layout = layout
        self.device = torch.empty(0, device=device).device      # "cuda" -> the current "cuda:N"
        # positions 0..num_tokens-1 seen by the encoder, and their ids (Engram history; what
        # persistence stores): written only through `advance`, `truncate` and `set_tokens`
        self._num_tokens = 0
        self._token_ids: list[int] = []
        # Image spans of the prompt (vision models): (start position, embeddings [L, D]); read
        # by prefill and replay to splice the image rows in (cedlm.model.vision.splice).
        self.images: list = []
        win, wb = layout.window_slots, layout.window_entry_bytes
        # One tensor of every layer's ring ([layers, slots, bytes] and [layers, slots]); the
        # per-layer rings are views of it (the compiled decode step reads and writes it whole).
        self.window_all = torch.zeros(layout.n_layers, win, wb, dtype=torch.uint8, device=self.device)
        self.window_pos_all = torch.full((layout.n_layers, win), -1, dtype=torch.int64, device=self.device)
        self._ring_views()
        rows = rows or (lambda spec: ByteRows(spec.width, device=self.device))
        self.kv = {spec.layer: rows(spec) for spec in layout.rows_of("kv")}
        self.index = {spec.layer: rows(spec) for spec in layout.rows_of("idx")}
        for r in (*self.kv.values(), *self.index.values()):
            if r.blocks()[0].device != self.device:
                raise ValueError(f"rows: the row store is on {r.blocks()[0].device} and the state on "
                                 f"{self.device}; a block pool must be on the model's device")
        # Incomplete compressor group: fp32 [k, dim] projections and gate logits.
        self.pending = {s: (torch.zeros(0, d, device=self.device), torch.zeros(0, d, device=self.device))
                        for s, _, d in layout.pending}

    # ---------------------------------------------------------------- tokens
    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The ids of positions 0..num_tokens-1 (read it; `advance` / `truncate` change it)."""
        return self._token_ids

    def advance(self, ids) -> None:
        """The tokens `ids` (ints, in order) have been through the model at positions
        num_tokens, num_tokens + 1, ...: the prefill, the decode step (eager or compiled), a
        verified block and replay all record them here, after their pass (a pass reads the
        history before its first position only)."""
        ids = [int(t) for t in ids]
        self._token_ids.extend(ids)
        self._num_tokens += len(ids)

    def truncate(self, n: int) -> None:
        """Forget the tokens from position n on (a rejected draft); the caches are the caller's
        (`rollback.rollback` restores the windows and rows)."""
        if not 0 <= n <= self._num_tokens:
            raise ValueError(f"truncate: {n} not in [0, {self._num_tokens}]")
        self._num_tokens = n
        del self._token_ids[n:]

    def set_tokens(self, ids) -> None:
        """Start from these tokens, whose rows are already in place (a prefix-cache hit, a
        restored session, a copy, a benchmark's synthetic context)."""
        self._token_ids = [int(t) for t in ids]
        self._num_tokens = len(self._token_ids)

    # ---------------------------------------------------------------- window ring
    def _ring_views(self) -> None:
        self.window = {l: self.window_all[l] for l in range(self.window_all.shape[0])}
        self.window_pos = {l: self.window_pos_all[l] for l in range(self.window_pos_all.shape[0])}

    def window_before(self, layer: int, first_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantised ring entries with position < first_pos: ([W, hd] fp32, [W] positions)."""
        pos = self.window_pos[layer]
        keep = (pos >= 0) & (pos < first_pos)
        order = torch.argsort(pos[keep])
        rows = self.window[layer][keep][order]
        return decode(rows, self.layout.window_fmt, self.layout.window_dim), pos[keep][order]

    def window_write(self, layer: int, kv: torch.Tensor, pos: torch.Tensor) -> None:
        """kv [T, hd] (already window-quantised values), pos [T] contiguous: keep the last n_win."""
        win = self.layout.window_slots
        kv, pos = kv[-win:], pos[-win:]
        slots = pos % win
        self.window[layer][slots] = encode(kv, self.layout.window_fmt)
        self.window_pos[layer][slots] = pos

    def adopt_prefix(self, token_ids: list[int]) -> None:
        """Take a cached prefix whose global rows are already in place (prefix-cached blocks):
        the rows of every kind cover len(token_ids) tokens; the windows still need a replay."""
        n = len(token_ids)
        for spec in self.layout.rows:
            (self.kv if spec.kind == "kv" else self.index)[spec.layer].set_len(n // spec.ratio)
        self.set_tokens(token_ids)

    def copy_windows_from(self, other: "SequenceState") -> None:
        """Clone the per-sequence rows of `other` (window rings, compressor pending rows): what a
        forked sample needs beside the shared global rows."""
        self.window_all = other.window_all.clone()
        self.window_pos_all = other.window_pos_all.clone()
        self._ring_views()
        self.pending = {k: (kv.clone(), g.clone()) for k, (kv, g) in other.pending.items()}
        self.images = list(other.images)

    # ---------------------------------------------------------------- compressed entries
    def n_entries(self, src: int) -> int:
        return self.kv[src].n

    def pending_bytes(self) -> int:
        return sum(self.layout.pending_bytes(kv.shape[0], kv.shape[1]) for kv, _ in self.pending.values())

    def nbytes(self) -> dict[str, int]:
        return {
            "main_kv": sum(r.nbytes for r in self.kv.values()),
            "index_keys": sum(r.nbytes for r in self.index.values()),
            "window": sum(w.numel() for w in self.window.values()),
            "compressor_state": self.pending_bytes(),
        }
