"""The seam between attention and storage: one small protocol, two cache backends.

Attention, the compressor and the indexer read and write caches only through `KVCache`:
- window rows: `window` (write this pass's rows, get the keys visible to it; `window_keys`, the
  same keys possibly still packed for the attention kernel) and, for the
  global-KV source whose rows are written in the encoder pass and read in the decoder pass,
  `push_stash` / `global_window`;
- compressed entries of a KV-source layer: `add_entries`, `entry_ends`, `index_keys` (or, for
  the indexer's fused scoring, the packed keys themselves: `index_bytes`), and the
  main KV as every entry (`all_kv`, the dense reference) or only the selected ones (`gather_kv`
  decoded; `selected_kv`, possibly still packed: `PackedKeys`, which the attention kernel decodes
  inside its loop);
- the compressor's pending rows (`pending`, `set_pending`) and the token history Engram needs.

`TrainingKVCache` keeps fp32 tensors of one call, already rounded to the storage formats
(differentiable); attention then runs the dense reference path. `ByteKVCache` serves a list of
`SequenceState`s, whose rows are bytes (contiguous or paged in the engine's block pool), and
decodes only what a query selects. A cache backend lives for one model call (both passes).
"""
from __future__ import annotations

from typing import Protocol

import torch

from cedlm.kv_layout import KVLayout
from cedlm.model.state import SequenceState
from cedlm.kernels import decode, encode
from cedlm.kernels.attention import PackedKeys
from cedlm.kernels.gate import reference_kernels

BIG = 1 << 62    # "never visible" end position of padding entries


class KVCache(Protocol):
    dense: bool                           # attention over all entries (reference) or a gather

    def window(self, layer: int, kv: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def window_keys(self, layer: int, kv: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor | PackedKeys, torch.Tensor]: ...
    def push_stash(self, layer: int, kv: torch.Tensor, pos: torch.Tensor) -> None: ...
    def global_window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def pending(self, src: int, b: int): ...
    def set_pending(self, src: int, b: int, pend) -> None: ...
    def add_entries(self, src: int, b: int, kv: torch.Tensor, idx: torch.Tensor | None) -> None: ...
    def entry_ends(self, src: int) -> torch.Tensor: ...
    def index_keys(self, src: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def index_bytes(self, src: int) -> tuple[torch.Tensor, torch.Tensor, object] | None: ...
    def all_kv(self, src: int) -> torch.Tensor: ...
    def gather_kv(self, src: int, idx: torch.Tensor) -> torch.Tensor: ...
    def selected_kv(self, src: int, idx: torch.Tensor) -> torch.Tensor | PackedKeys: ...
    def history(self, first_pos: list[int], n: int) -> list[list[int]]: ...


class _Stash:
    """Window rows of the global-KV source, kept from the encoder pass for the decoder pass
    (rows at positions >= keep_from; all sequences share the chunk layout)."""

    def __init__(self, keep_from: int):
        self.keep_from = keep_from
        self.stash: tuple[torch.Tensor, torch.Tensor] | None = None

    def push_stash(self, layer: int, kv: torch.Tensor, pos: torch.Tensor) -> None:
        """Call before the rows are written to the layer's ring."""
        if self.stash is not None:
            kv, pos = torch.cat((self.stash[0], kv), 1), torch.cat((self.stash[1], pos), 1)
        keep = pos[0] >= self.keep_from
        self.stash = (kv[:, keep], pos[:, keep])


def _ends(ratio: int, counts: list[int], device: torch.device) -> torch.Tensor:
    """[B, N] position of the last token of each entry (BIG for padding), on `device`."""
    N = max(counts) if counts else 0
    entry = torch.arange(N, dtype=torch.int64, device=device)
    n = torch.tensor(counts, dtype=torch.int64, device=device).view(-1, 1)
    return torch.where(entry < n, entry * ratio + (ratio - 1), BIG)


class TrainingKVCache(_Stash):
    """One call's rows as fp32 tensors (training forward, and the dense reference)."""
    dense = True

    def __init__(self, layout: KVLayout, batch_size: int, device: torch.device | str = "cpu"):
        super().__init__(keep_from=0)
        self.layout, self.B, self.device = layout, batch_size, torch.device(device)
        self._ent: dict[int, dict[str, list[list[torch.Tensor]]]] = {}
        self._idx: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def window(self, layer, kv, pos):
        return kv, pos                            # this call's rows are the whole context

    window_keys = window

    def push_stash(self, layer, kv, pos):
        """Every row is kept: a training call starts at position 0 (keep_from 0), so the stash
        needs no selection by position (no data-dependent shape for torch.compile)."""
        if self.stash is not None:
            kv, pos = torch.cat((self.stash[0], kv), 1), torch.cat((self.stash[1], pos), 1)
        self.stash = (kv, pos)

    def global_window(self, layer):
        return self.stash

    def pending(self, src, b):
        return None                               # a training call starts at position 0

    def set_pending(self, src, b, pend):
        pass

    def add_entries(self, src, b, kv, idx):
        e = self._ent.setdefault(src, {"kv": [[] for _ in range(self.B)], "idx": [[] for _ in range(self.B)]})
        e["kv"][b].append(kv)
        if idx is not None:
            e["idx"][b].append(idx)
        self._idx.pop(src, None)

    def _counts(self, src):
        e = self._ent.get(src)
        return [sum(t.shape[0] for t in e["kv"][b]) if e else 0 for b in range(self.B)]

    def _stack(self, src, kind):
        return torch.stack([torch.cat(rows) for rows in self._ent[src][kind]])   # equal lengths

    def entry_ends(self, src):
        return _ends(self.layout.row("kv", src).ratio, self._counts(src), self.device)

    def index_keys(self, src):
        if src not in self._idx:
            self._idx[src] = (self._stack(src, "idx"), self.entry_ends(src))
        return self._idx[src]

    def index_bytes(self, src):
        return None                               # fp32 rows of one call: no bytes to read

    def all_kv(self, src):
        return self._stack(src, "kv")

    def gather_kv(self, src, idx):
        B = idx.shape[0]
        return self.all_kv(src)[torch.arange(B, device=idx.device)[:, None, None], idx]

    selected_kv = gather_kv

    def history(self, first_pos, n):
        return [[] for _ in first_pos]


class ByteKVCache(_Stash):
    """The sequences' byte caches (`SequenceState`, rows contiguous or paged)."""
    dense = False

    def __init__(self, layout: KVLayout, states: list[SequenceState], keep_stash_from: int = 0):
        super().__init__(keep_from=keep_stash_from)
        self.layout, self.states = layout, states
        self.device = states[0].device if states else torch.device("cpu")
        self._idx: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._idx_bytes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._kv_bytes: dict[int, torch.Tensor] = {}
        self._ends: dict[int, torch.Tensor] = {}
        self._olds: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._tables: dict[tuple[int, int, int], torch.Tensor] = {}    # block ids on the device

    # ---------------------------------------------------------------- windows
    def window(self, layer, kv, pos):
        if not reference_kernels():
            return self._window_batched(layer, kv, pos)
        olds = [st.window_before(layer, int(pos[b, 0])) for b, st in enumerate(self.states)]
        for b, st in enumerate(self.states):
            st.window_write(layer, kv[b], pos[b])
        return self._cat_padded(olds, kv, pos)

    def window_keys(self, layer, kv, pos):
        """`window` for the attention: on the fast path at one new position per sequence (decode),
        the keys stay packed: this call's rows are written to the rings first and every ring slot
        is a key (`PackedKeys` over the stacked rings, index [B, slots]), its position beside it
        (-1 for an empty slot; the caller's validity mask keeps the slots inside the window). The
        ring then holds exactly the rows `window` returns: the sliding window's positions up to
        this one, stored, with no decoded float32 copy. Else (a longer chunk, whose early queries
        need rows the ring overwrites, or the reference switch) `window`."""
        if reference_kernels() or kv.shape[1] != 1:
            return self.window(layer, kv, pos)
        for b, st in enumerate(self.states):
            st.window_write(layer, kv[b], pos[b])
        rings = [st.window[layer] for st in self.states]
        ring = rings[0].unsqueeze(0) if len(rings) == 1 else torch.stack(rings)     # [B, slots, wb]
        rpos = torch.stack([st.window_pos[layer] for st in self.states])          # [B, slots]
        B, slots, wb = ring.shape
        keys = PackedKeys(ring.view(B * slots, wb), torch.arange(B * slots, device=ring.device).view(B, slots),
                          self.layout.window_fmt, self.layout.window_dim)
        return keys, rpos

    def _window_batched(self, layer, kv, pos):
        """`window` for every sequence at once (the fast path; same result as the per-sequence
        `window_before` + `_cat_padded` above, which stays the reference): the rings are stacked,
        each row's entries older than its first position are sorted by position with the others
        in front, the last W columns (W = the most any row keeps) are gathered, decoded in one
        call, and the front padding set to zero keys at position -1."""
        B = len(self.states)
        lay = self.layout
        rpos = torch.stack([st.window_pos[layer] for st in self.states])           # [B, slots]
        ring = torch.stack([st.window[layer] for st in self.states])               # [B, slots, wb]
        keep = (rpos >= 0) & (rpos < pos[:, :1])
        key = torch.where(keep, rpos, -1)
        W = int(keep.sum(1).max())
        sel = torch.argsort(key, dim=1)[:, key.shape[1] - W:]                       # [B, W]
        kpos_old = torch.gather(key, 1, sel)
        rows = torch.gather(ring, 1, sel.unsqueeze(-1).expand(-1, -1, ring.shape[-1]))
        old = decode(rows.reshape(B * W, ring.shape[-1]), lay.window_fmt, lay.window_dim).view(B, W, lay.window_dim)
        old = torch.where((kpos_old >= 0).unsqueeze(-1), old, 0.0)
        for b, st in enumerate(self.states):
            st.window_write(layer, kv[b], pos[b])
        return torch.cat((old, kv.float()), 1), torch.cat((kpos_old, pos), 1)

    def push_stash(self, layer, kv, pos):
        # The ring rows older than this call, read before this call's rows overwrite them: the
        # decoder pass needs them and the encoder pass has already written the ring.
        if self._olds is None:
            win = self.layout.window_slots
            self._olds = []
            for st, p0 in zip(self.states, pos[:, 0].tolist()):      # one host read per call
                k, p = st.window_before(layer, p0)
                keep = p > p0 - win
                self._olds.append((k[keep], p[keep]))
        super().push_stash(layer, kv, pos)

    def global_window(self, layer):
        kv, pos = self.stash
        return self._cat_padded(self._olds, kv, pos)

    @staticmethod
    def _cat_padded(olds, kv, pos):
        W = max(o[0].shape[0] for o in olds)
        B, T, hd = kv.shape
        keys = torch.zeros(B, W + T, hd, device=kv.device)
        kpos = torch.full((B, W + T), -1, dtype=torch.int64, device=kv.device)
        for b, (k, p) in enumerate(olds):
            n = k.shape[0]
            keys[b, W - n: W], kpos[b, W - n: W] = k, p
        keys[:, W:], kpos[:, W:] = kv.float(), pos
        return keys, kpos

    # ---------------------------------------------------------------- compressor state
    def pending(self, src, b):
        return self.states[b].pending.get(src)

    def set_pending(self, src, b, pend):
        self.states[b].pending[src] = pend

    # ---------------------------------------------------------------- entries
    def add_entries(self, src, b, kv, idx):
        st = self.states[b]
        st.kv[src].append(encode(kv, self.layout.row("kv", src).fmt))
        if idx is not None:
            st.index[src].append(encode(idx, self.layout.row("idx", src).fmt))
        self._idx.pop(src, None)
        self._idx_bytes.pop(src, None)
        self._kv_bytes.pop(src, None)
        self._ends.pop(src, None)

    def _counts(self, src):
        return [st.kv[src].n for st in self.states]

    def entry_ends(self, src):
        """Computed once per source and call (the indexer, its index keys and the attention
        layers of a source all ask), until the source's entries change."""
        if src not in self._ends:
            self._ends[src] = _ends(self.layout.row("kv", src).ratio, self._counts(src), self.device)
        return self._ends[src]

    def index_bytes(self, src):
        """(packed index keys uint8 [B, N, entry bytes] (zero bytes past a sequence's entries),
        ends [B, N], format): what `index_keys` decodes, for scoring straight from the bytes."""
        if src not in self._idx_bytes:
            ends = self.entry_ends(src)
            raw = _padded([st.index[src].view() for st in self.states], ends.shape[1])
            self._idx_bytes[src] = (raw, ends)
        return (*self._idx_bytes[src], self.layout.row("idx", src).fmt)

    def index_keys(self, src):
        if src not in self._idx:
            raw, ends, fmt = self.index_bytes(src)
            self._idx[src] = (decode(raw, fmt, self.layout.row("idx", src).dim), ends)
        return self._idx[src]

    def all_kv(self, src):
        if src not in self._kv_bytes:
            self._kv_bytes[src] = _padded([st.kv[src].view() for st in self.states], max(self._counts(src)))
        spec = self.layout.row("kv", src)
        return decode(self._kv_bytes[src], spec.fmt, spec.dim)

    def gather_kv(self, src, idx):
        """Decode only the selected rows: idx [B, T, k] -> [B, T, k, hd] fp32 (cost independent
        of context length)."""
        B, T, k = idx.shape
        raw = []
        for b, st in enumerate(self.states):
            rows = st.kv[src]
            raw.append(rows.gather(idx[b].clamp(0, max(rows.n - 1, 0))) if rows.n else
                       torch.zeros(T, k, rows.width, dtype=torch.uint8, device=idx.device))
        spec = self.layout.row("kv", src)
        return decode(torch.stack(raw), spec.fmt, spec.dim)

    def selected_kv(self, src, idx):
        """The selected entries for the attention: on the fast path still packed, as `PackedKeys`
        over the sequences' row store (the engine's pool: its rows are read in place; contiguous
        rows of several sequences: only the selected rows' bytes are gathered), which the
        attention kernel decodes inside its loop; under the reference switch, or while no
        sequence has an entry yet, `gather_kv`'s decoded rows."""
        rows = [st.kv[src] for st in self.states]
        if reference_kernels() or not any(r.n for r in rows):
            return self.gather_kv(src, idx)
        spec = self.layout.row("kv", src)
        stores, ids = [], []
        for b, r in enumerate(rows):                   # row ids in each sequence's block store
            data, blocks = r.blocks()
            per = data.shape[1]
            i = idx[b].clamp(0, max(r.n - 1, 0))
            table = self._table(b, blocks if r.n else [0], data.device)
            stores.append(data)
            ids.append(table[i // per] * per + i % per if r.n else torch.zeros_like(i))
        if all(d.data_ptr() == stores[0].data_ptr() and d.shape == stores[0].shape for d in stores):
            store, index = stores[0].view(-1, spec.width), torch.stack(ids)        # one pool
        else:                                          # separate stores: gather the bytes
            raw = torch.stack([d.view(-1, spec.width)[i] for d, i in zip(stores, ids)])
            store, index = raw.view(-1, spec.width), torch.arange(idx.numel(), device=raw.device).view(idx.shape)
        return PackedKeys(store, index, spec.fmt, spec.dim)

    def _table(self, b: int, blocks: list[int], device) -> torch.Tensor:
        """Sequence b's block ids as a device tensor, copied once per call and table length (every
        row kind of a sequence shares its block table, which only grows during a call)."""
        key = (b, len(blocks), blocks[-1])
        if key not in self._tables:
            self._tables[key] = torch.tensor(blocks, dtype=torch.int64, device=device)
        return self._tables[key]

    def history(self, first_pos, n):
        return [st.token_ids[max(0, p - n): p] for st, p in zip(self.states, first_pos)]


def _padded(rows: list[torch.Tensor], n: int) -> torch.Tensor:
    if len(rows) == 1 and rows[0].shape[0] == n:
        return rows[0].unsqueeze(0)
    out = torch.zeros(len(rows), n, rows[0].shape[1], dtype=torch.uint8, device=rows[0].device)
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r
    return out
