"""The static-shape KV backend: the caches of B sequences as tensors whose shapes do not depend on
the data, read and written by the model's step (`model.decode_step`, what `compiled_step.py`
compiles) and by the DSpark verify and draft steps.

`ByteKVCache` (kv_cache.py) walks Python objects: per-sequence window rings, growing byte rows,
pending compressor rows, data-dependent entry counts. The step sees the same caches as:

- window: every layer's ring bytes [B, S, wb] and positions [B, S] as they were before the step;
  the new row replaces slot pos % S (a ring slot is overwritten only by a position S later, which
  the window mask excludes anyway), and a mask (kp >= 0, kp <= pos, kp > pos - sliding_window)
  says which slots count (`window`). The keys are attended in slot order, not position order:
  same set, another summation order.
- compressed entries: each row kind is a pool of blocks [nblocks, per_block, width] read through
  the batch's block table [B, nb]; the table always has a spare column (block 0 where nothing is
  allocated), so entry n (the one this token may complete) has a place. The completed entry is
  not stored yet: its bytes are put in at index n with a mask (`selected_rows`); entries
  j < n + emit are visible.
- the compressor's pending rows of an incomplete group arrive padded [B, r-1, hd] (the phase
  arithmetic is `Compressor.step`'s).

Nothing here synchronises with the host (no .item(), .tolist() or branch on a value). The host
writes back what the step returns (`CompiledDecode.write_back`). Rows move as words
(`words`): the same bytes, but inductor's CPU code moves whole words where it would handle a byte
lane at a time.

Kernels kept opaque (torch.ops.cedlm: codecs, index scores, top-k, attention) are custom ops
(`cedlm/kernels/ops.py`); everything else is the modules' own torch code, traced.
"""
from __future__ import annotations

import torch

from cedlm.kernels import ops as _ops  # noqa: F401  (registers torch.ops.cedlm.*)

cedlm_ops = torch.ops.cedlm


def stored(x: torch.Tensor, fmt: str | None) -> torch.Tensor:
    """The stored value of x in `fmt` (quantise-dequantise), float32."""
    if fmt is None or fmt == "none":
        return x.float()
    return cedlm_ops.quant_dequant(x.float().contiguous(), fmt)


def encode_rows(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return cedlm_ops.encode(x.float().contiguous(), fmt)


def words(b: torch.Tensor) -> torch.Tensor:
    """Packed rows uint8 [..., w] viewed as the widest integers that tile a row (int64, int32 or
    int16), for the step's gathers, selects and concatenations of rows: the same bytes moved, but
    inductor's CPU code handles a byte lane at a time where it moves whole words. ``unwords``
    views them back."""
    w = b.shape[-1]
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if w % size == 0:
            return b.view(dt)
    return b


def unwords(t: torch.Tensor) -> torch.Tensor:
    """The uint8 rows of ``words(b)``."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def gather_rows(pool: torch.Tensor, table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows at entry indices idx [B, ...] of a block pool [nblocks, per_block, width] through the
    block table [B, nb] -> [B, ..., width] (idx past the table is clamped; callers mask it)."""
    per = pool.shape[1]
    col = (idx // per).clamp(max=table.shape[1] - 1)
    blocks = torch.gather(table, 1, col.flatten(1)).view(col.shape)
    return pool[blocks, idx % per]


def all_rows(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Every slot the table covers: [B, nb * per_block, width]."""
    B, nb = table.shape
    return unwords(words(pool)[table]).reshape(B, nb * pool.shape[1], pool.shape[2])


def window(ring: torch.Tensor, ring_pos: torch.Tensor, row: torch.Tensor, p1: torch.Tensor,
           sliding_window: int):
    """A layer's window for the call's rows row [B, T, wb] at positions p1 [B, T], over its ring
    [B, S, wb] (positions ring_pos [B, S]) as it was: (key rows [R, wb], their index [B, K] into
    them, which count for each query row [B, T or 1, K]). One row (decode): written into its slot
    (slot order). Several (verify, draft): the ring as it was, then the rows (a ring slot a later
    row would overwrite may still be in an earlier row's window); row t sees (p_t - window, p_t]."""
    B, T = p1.shape
    S = ring.shape[1]
    dev = row.device
    if T == 1:
        r = row[:, 0]
        at = (torch.arange(S, device=dev) == (p1 % S))                           # [B, S]
        ring = unwords(torch.where(at.unsqueeze(-1), words(r).unsqueeze(1), words(ring)))  # = stored
        idx = torch.arange(B * S, device=dev).view(B, S)  # rows of ring.view(B * S, wb)
        kp = torch.where(at, p1, ring_pos)
        valid = ((kp >= 0) & (kp <= p1) & (kp > p1 - sliding_window)).unsqueeze(1)       # [B, 1, S]
        return ring.reshape(B * S, -1), idx, valid
    keys = unwords(torch.cat((words(ring).reshape(B * S, -1), words(row).reshape(B * T, -1))))
    idx = torch.cat((torch.arange(B * S, device=dev).view(B, S),
                     B * S + torch.arange(B * T, device=dev).view(B, T)), 1)     # [B, S + T]
    kp = torch.cat((ring_pos, p1), 1).unsqueeze(1)                               # [B, 1, S + T]
    q_at = p1.unsqueeze(-1)
    valid = (kp >= 0) & (kp <= q_at) & (kp > q_at - sliding_window)              # [B, T, S + T]
    return keys, idx, valid


def selected_rows(kv_pool: torch.Tensor, table: torch.Tensor, idx: torch.Tensor, n: torch.Tensor,
                  main: torch.Tensor) -> torch.Tensor:
    """The main-KV rows of entries idx [B, T, k] ([B, T * k, w]): stored ones from the pool, the
    ones this call made (main [B, G, w], not stored yet) at their indices n, n + 1, ..."""
    B = idx.shape[0]
    rows = gather_rows(words(kv_pool), table, idx.reshape(B, -1))                # [B, T * k, w]
    G, made = main.shape[1], words(main)
    off = idx.reshape(B, -1) - n.view(B, 1)
    new = (off >= 0) & (off < G)
    made = made.gather(1, off.clamp(0, G - 1).unsqueeze(-1).expand(-1, -1, made.shape[-1]))
    return unwords(torch.where(new.unsqueeze(-1), made, rows))


class StepShapes:
    """What the step's shapes depend on, per model: roles, sources, formats (read once), and
    whether this call's rows are one contiguous buffer (`flat`; a graph of its own), and whether
    it returns the DSpark taps (`taps`: the verify step's)."""

    flat = False
    taps = False

    def __init__(self, model):
        cfg = model.cfg
        self.cfg, self.model = cfg, model
        lay = model.kv_layout
        self.window_fmt, self.window_dim = lay.window_fmt, lay.window_dim
        self.sources = list(cfg.kv_source_layer_ids)
        self.key_sources = set(cfg.index_key_layer_ids)
        self.kv_fmt = {s: lay.row("kv", s).fmt for s in self.sources}
        self.idx_fmt = {s: lay.row("idx", s).fmt for s in self.key_sources}
        self.ratio = {s: cfg.compress_ratios[s] for s in self.sources}
        self.row_width = {s: lay.row("kv", s).width for s in self.sources}
