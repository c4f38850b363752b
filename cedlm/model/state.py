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

from cedlm.config import ModelConfig
from cedlm.quant import bytes_per_entry, decode, encode


class ByteRows:
    """A growable [n, width] uint8 matrix (amortised doubling); `nbytes` counts used rows."""

    def __init__(self, width: int, capacity: int = 16):
        self.width = width
        self.buf = torch.zeros(capacity, width, dtype=torch.uint8)
        self.n = 0

    def append(self, rows: torch.Tensor) -> None:
        k = rows.shape[0]
        if self.n + k > self.buf.shape[0]:
            cap = max(self.buf.shape[0] * 2, self.n + k)
            new = torch.zeros(cap, self.width, dtype=torch.uint8)
            new[: self.n] = self.buf[: self.n]
            self.buf = new
        self.buf[self.n: self.n + k] = rows
        self.n += k

    def view(self) -> torch.Tensor:
        return self.buf[: self.n]

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows at entry indices idx [...] -> [..., width] (indices must be < n)."""
        return self.buf[idx]

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)

    @property
    def nbytes(self) -> int:
        return self.n * self.width

    @property
    def allocated(self) -> int:
        return self.buf.numel()


class SequenceState:
    """`rows(kind, src, width)` makes the store of one kind ("kv" or "idx") of one source layer:
    contiguous `ByteRows` by default, or the engine's paged rows (cedlm.cache.block_pool)."""

    def __init__(self, cfg: ModelConfig, rows=None):
        self.cfg = cfg
        hd, win = cfg.head_dim, cfg.sliding_window
        self.num_tokens = 0                       # positions 0..num_tokens-1 seen by the encoder
        self.token_ids: list[int] = []
        self.win_fmt, self.main_fmt, self.idx_fmt = cfg.window_kv_format, cfg.main_kv_format, cfg.index_kv_format
        wb = bytes_per_entry(self.win_fmt, hd)
        self.window = {l: torch.zeros(win, wb, dtype=torch.uint8) for l in range(cfg.n_layers)}
        self.window_pos = {l: torch.full((win,), -1, dtype=torch.int64) for l in range(cfg.n_layers)}
        rows = rows or (lambda kind, src, width: ByteRows(width))
        self.kv = {s: rows("kv", s, bytes_per_entry(self.main_fmt, hd)) for s in cfg.kv_source_layer_ids}
        self.index = {s: rows("idx", s, bytes_per_entry(self.idx_fmt, cfg.index_head_dim))
                      for s in cfg.index_key_layer_ids}
        # Incomplete compressor group: fp32 [k, head_dim] projections and gate logits.
        self.pending = {s: (torch.zeros(0, hd), torch.zeros(0, hd))
                        for s in cfg.kv_source_layer_ids if cfg.compress_ratios[s] > 1}

    # ---------------------------------------------------------------- window ring
    def window_before(self, layer: int, first_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantised ring entries with position < first_pos: ([W, hd] fp32, [W] positions)."""
        pos = self.window_pos[layer]
        keep = (pos >= 0) & (pos < first_pos)
        order = torch.argsort(pos[keep])
        rows = self.window[layer][keep][order]
        return decode(rows, self.win_fmt, self.cfg.head_dim), pos[keep][order]

    def window_write(self, layer: int, kv: torch.Tensor, pos: torch.Tensor) -> None:
        """kv [T, hd] (already window-quantised values), pos [T] contiguous: keep the last n_win."""
        win = self.cfg.sliding_window
        kv, pos = kv[-win:], pos[-win:]
        slots = pos % win
        self.window[layer][slots] = encode(kv, self.win_fmt)
        self.window_pos[layer][slots] = pos

    # ---------------------------------------------------------------- compressed entries
    def n_entries(self, src: int) -> int:
        return self.kv[src].n

    def nbytes(self) -> dict[str, int]:
        pend = sum(a.numel() * 4 + b.numel() * 4 for a, b in self.pending.values())
        return {
            "main_kv": sum(r.nbytes for r in self.kv.values()),
            "index_keys": sum(r.nbytes for r in self.index.values()),
            "window": sum(w.numel() for w in self.window.values()),
            "compressor_state": pend,
        }
