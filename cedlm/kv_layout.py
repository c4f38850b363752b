"""The KV layout: every stored row kind of a CED model and every byte count derived from it.

One object, derived from the config, answers "how many bytes": per entry, per token, per paged
block and per sequence. The block pool allocates from it, `SequenceState` sizes its rings and
rows from it, the engine budgets with it, the planner reports it and the benchmarks compare
live allocations against it; nothing else computes these numbers.

What a CED / V4-style model stores:
- global rows (context-proportional), per KV-source layer s with compress ratio r:
    "kv"  one main-KV entry (`main_kv_format`, head_dim values) per r tokens;
    "idx" one index-key entry (`index_kv_format`, index_head_dim values) per r tokens, on the
          sources that own index keys;
- window rings (fixed per sequence): every layer keeps its last `sliding_window` positions in
  `window_kv_format`; DSpark draft layers keep rings of the same size;
- compressor pending rows (fixed per sequence): a ratio-r source holds up to r-1 fp32
  projections of kv and gate (head_dim each) of its incomplete group.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from math import lcm

from cedlm.config import ConfigError, ModelConfig
from cedlm.quant import bytes_per_entry

ROW_KINDS = ("kv", "idx")
PART_OF_KIND = {"kv": "main_kv", "idx": "index_keys"}
PENDING_ITEM_BYTES = 4                   # fp32 projections


@dataclass(frozen=True)
class RowSpec:
    """One kind of global row of one KV-source layer."""
    kind: str                            # "kv" | "idx"
    layer: int                           # the KV-source layer that produces it
    ratio: int                           # tokens per entry
    fmt: str                             # storage format
    dim: int                             # values per entry
    width: int                           # bytes per entry

    @property
    def key(self) -> tuple[str, int]:
        return (self.kind, self.layer)

    def entries_per_block(self, block_tokens: int) -> int:
        return block_tokens // self.ratio

    @property
    def bytes_per_token(self) -> Fraction:
        return Fraction(self.width, self.ratio)


@dataclass(frozen=True)
class KVLayout:
    rows: tuple[RowSpec, ...]
    n_layers: int                        # layers with a window ring
    window_slots: int                    # sliding_window
    window_fmt: str
    window_dim: int
    window_entry_bytes: int
    dspark_layers: int                   # DSpark draft layers (rings of the same size)
    pending: tuple[tuple[int, int, int], ...]   # (source layer, ratio, dim) of ratio > 1 sources

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "KVLayout":
        if cfg.family not in ("ced", "v4"):
            raise ConfigError(f"family: {cfg.family!r} keeps full per-layer KV; the KV layout "
                              "describes CED / V4-style caches")
        hd, r = cfg.head_dim, cfg.compress_ratios
        rows = [RowSpec("kv", s, r[s], cfg.main_kv_format, hd, bytes_per_entry(cfg.main_kv_format, hd))
                for s in cfg.kv_source_layer_ids]
        rows += [RowSpec("idx", s, r[s], cfg.index_kv_format, cfg.index_head_dim,
                         bytes_per_entry(cfg.index_kv_format, cfg.index_head_dim))
                 for s in cfg.index_key_layer_ids]
        return cls(rows=tuple(rows), n_layers=cfg.n_layers, window_slots=cfg.sliding_window,
                   window_fmt=cfg.window_kv_format, window_dim=hd,
                   window_entry_bytes=bytes_per_entry(cfg.window_kv_format, hd),
                   dspark_layers=cfg.num_nextn_predict_layers,
                   pending=tuple((s, r[s], hd) for s in cfg.kv_source_layer_ids if r[s] > 1))

    # ---------------------------------------------------------------- rows
    def row(self, kind: str, layer: int) -> RowSpec:
        for spec in self.rows:
            if spec.key == (kind, layer):
                return spec
        raise KeyError(f"no {kind!r} rows at layer {layer}")

    def rows_of(self, kind: str) -> tuple[RowSpec, ...]:
        return tuple(s for s in self.rows if s.kind == kind)

    # ---------------------------------------------------------------- per token / block
    @property
    def bytes_per_token(self) -> Fraction:
        """Global KV bytes per token (exact; 890 for the official V4.1 config)."""
        return sum((s.bytes_per_token for s in self.rows), Fraction(0))

    def bytes_per_token_of(self, kind: str) -> Fraction:
        return sum((s.bytes_per_token for s in self.rows if s.kind == kind), Fraction(0))

    @property
    def min_block_tokens(self) -> int:
        """Smallest block every compress ratio divides."""
        return lcm(*[s.ratio for s in self.rows]) if self.rows else 1

    def check_block_tokens(self, block_tokens: int) -> None:
        m = self.min_block_tokens
        if block_tokens <= 0 or block_tokens % m:
            raise ValueError(f"block_tokens: {block_tokens} must be a positive multiple of {m} "
                             "(every compress ratio divides it)")

    def round_block_tokens(self, block_tokens: int) -> int:
        """The smallest valid block size >= block_tokens."""
        m = self.min_block_tokens
        return -(-block_tokens // m) * m

    def bytes_per_block(self, block_tokens: int) -> int:
        self.check_block_tokens(block_tokens)
        return sum(s.entries_per_block(block_tokens) * s.width for s in self.rows)

    def bytes_per_block_of(self, kind: str, block_tokens: int) -> int:
        return sum(s.entries_per_block(block_tokens) * s.width for s in self.rows if s.kind == kind)

    # ---------------------------------------------------------------- per sequence
    @property
    def window_bytes_per_sequence(self) -> int:
        """Every layer's ring, allocated whole."""
        return self.n_layers * self.window_slots * self.window_entry_bytes

    @property
    def dspark_window_bytes_per_sequence(self) -> int:
        return self.dspark_layers * self.window_slots * self.window_entry_bytes

    @staticmethod
    def pending_bytes(n_rows: int, dim: int) -> int:
        """Bytes of n pending rows (kv and gate projections, fp32)."""
        return n_rows * 2 * dim * PENDING_ITEM_BYTES

    @property
    def max_pending_bytes(self) -> int:
        """The largest compressor state: r-1 pending rows per ratio-r source."""
        return sum(self.pending_bytes(r - 1, d) for _, r, d in self.pending)

    def sequence_bytes(self, context: int, block_tokens: int | None = None) -> int:
        """Bytes one sequence of `context` tokens holds: global rows (whole blocks when
        block_tokens is given, else exact entries) + window rings + the largest pending state."""
        if block_tokens is None:
            glob = sum((context // s.ratio) * s.width for s in self.rows)
        else:
            glob = -(-context // block_tokens) * self.bytes_per_block(block_tokens)
        return glob + self.window_bytes_per_sequence + self.max_pending_bytes
