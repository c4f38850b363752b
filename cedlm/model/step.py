"""Per-step metadata: the one explicit argument that carries caches and positions to attention.

A `Step` covers one model call (a training forward, a prefill or a decode step) over B sequences
that each process T new tokens. The model runs it in two passes: the encoder pass (every new
token; ends with the global-KV projection) and the decoder pass (all, or only the trailing
tokens at prefill). Attention asks the step for window keys, compressed entries and index keys;
the step serves them either from the sequences' byte caches (`states`) or, without states (the
training forward), from fp32 tensors of this step alone, fake-quantised exactly like the bytes.
"""
from __future__ import annotations

import torch

from cedlm.config import ModelConfig
from cedlm.quant import decode, encode, quant_dequant

BIG = 1 << 62    # "never visible" position for padding entries


class Step:
    def __init__(self, cfg: ModelConfig, token_ids: torch.Tensor, states=None):
        self.cfg = cfg
        self.states = states                      # list[SequenceState] | None
        self.replay = False                        # rebuilding windows: entries already exist
        self.B = token_ids.shape[0]
        self.pos: torch.Tensor | None = None      # [B, T] positions of the current pass
        self.topk: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool: torch.Tensor | None = None     # candidate pool [B, T, N] of the current pass
        self._ent: dict[int, dict[str, torch.Tensor]] = {}      # stateless entries
        self._idx_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._kv_bytes: dict[int, torch.Tensor] = {}
        self._win: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # stateless window rows
        self.stash: tuple[torch.Tensor, torch.Tensor] | None = None   # global source window
        self.stash_from = 0                        # keep stash rows at positions >= this

    def begin_pass(self, pos: torch.Tensor) -> None:
        self.pos = pos
        self.topk, self.pool = {}, None
        self._idx_cache, self._kv_bytes = {}, {}

    # ---------------------------------------------------------------- windows
    def window(self, layer: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New window rows kv [B, T, hd] at self.pos -> keys visible to this chunk (older ring
        entries ++ new rows) as ([B, W, hd], positions [B, W]; -1 marks padding); stores them."""
        pos = self.pos
        if self.states is None:
            return kv, pos
        olds = [st.window_before(layer, int(pos[b, 0])) for b, st in enumerate(self.states)]
        for b, st in enumerate(self.states):
            st.window_write(layer, kv[b], pos[b])
        return self._cat_padded(olds, kv, pos)

    def _cat_padded(self, olds, kv, pos):
        W = max(o[0].shape[0] for o in olds)
        B, T, hd = kv.shape
        keys = torch.zeros(B, W + T, hd)
        kpos = torch.full((B, W + T), -1, dtype=torch.int64)
        for b, (k, p) in enumerate(olds):
            n = k.shape[0]
            keys[b, W - n: W], kpos[b, W - n: W] = k, p
        keys[:, W:], kpos[:, W:] = kv.float(), pos
        return keys, kpos

    def push_stash(self, kv: torch.Tensor) -> None:
        """Window rows of the global-KV source, written in the encoder pass for every token and
        read by the same layer in the decoder pass (whose rows may be only the trailing ones)."""
        pos = self.pos
        if self.stash is not None:
            kv, pos = torch.cat((self.stash[0], kv), 1), torch.cat((self.stash[1], pos), 1)
        keep = pos[0] >= self.stash_from        # all sequences share the chunk layout here
        self.stash = (kv[:, keep], pos[:, keep])

    def global_window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv, pos = self.stash
        if self.states is None:
            return kv, pos
        olds = [st.window_before(layer, int(pos[b, 0])) for b, st in enumerate(self.states)]
        return self._cat_padded(olds, kv, pos)

    # ---------------------------------------------------------------- compressed entries
    def add_entries(self, src: int, b: int, kv: torch.Tensor, idx: torch.Tensor | None) -> None:
        """Append sequence b's new entries of source `src` (fp32, already quantise-dequantised)."""
        if self.states is not None:
            st = self.states[b]
            st.kv[src].append(encode(kv, self.cfg.main_kv_format))
            if idx is not None:
                st.index[src].append(encode(idx, self.cfg.index_kv_format))
            return
        e = self._ent.setdefault(src, {"kv": [[] for _ in range(self.B)], "idx": [[] for _ in range(self.B)]})
        e["kv"][b].append(kv)
        if idx is not None:
            e["idx"][b].append(idx)

    def entry_ends(self, src: int) -> torch.Tensor:
        """[B, N] position of the last token of each entry (BIG for padding)."""
        r = self.cfg.compress_ratios[src]
        counts = self._counts(src)
        N = max(counts) if counts else 0
        ends = torch.arange(N, dtype=torch.int64) * r + (r - 1)
        ends = ends.expand(self.B, N).clone()
        for b, n in enumerate(counts):
            ends[b, n:] = BIG
        return ends

    def _counts(self, src: int) -> list[int]:
        if self.states is not None:
            return [st.kv[src].n for st in self.states]
        e = self._ent.get(src)
        return [sum(t.shape[0] for t in e["kv"][b]) if e else 0 for b in range(self.B)]

    def _stack(self, src: int, kind: str) -> torch.Tensor:
        e = self._ent[src][kind]
        return torch.stack([torch.cat(rows) for rows in e])    # training: equal lengths

    def index_keys(self, src: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All entries' index keys [B, N, di] fp32 and their end positions [B, N]."""
        if src not in self._idx_cache:
            ends = self.entry_ends(src)
            if self.states is None:
                keys = self._stack(src, "idx")
            else:
                keys = decode(self._padded_bytes([st.index[src].view() for st in self.states], ends.shape[1]),
                              self.cfg.index_kv_format, self.cfg.index_head_dim)
            self._idx_cache[src] = (keys, ends)
        return self._idx_cache[src]

    def all_kv(self, src: int) -> torch.Tensor:
        """Every entry's main KV [B, N, hd] fp32 (reference path / training)."""
        if self.states is None:
            return self._stack(src, "kv")
        return decode(self.kv_bytes(src), self.cfg.main_kv_format, self.cfg.head_dim)

    def kv_bytes(self, src: int) -> torch.Tensor:
        if src not in self._kv_bytes:
            n = max(self._counts(src))
            self._kv_bytes[src] = self._padded_bytes([st.kv[src].view() for st in self.states], n)
        return self._kv_bytes[src]

    @staticmethod
    def _padded_bytes(rows: list[torch.Tensor], n: int) -> torch.Tensor:
        if len(rows) == 1 and rows[0].shape[0] == n:
            return rows[0].unsqueeze(0)
        out = torch.zeros(len(rows), n, rows[0].shape[1], dtype=torch.uint8)
        for b, r in enumerate(rows):
            out[b, : r.shape[0]] = r
        return out

    def gather_kv(self, src: int, idx: torch.Tensor) -> torch.Tensor:
        """Main KV of the selected entries: idx [B, T, k] -> [B, T, k, hd] fp32, decoding only
        the selected rows from bytes (the fast path: cost independent of context length)."""
        B, T, k = idx.shape
        if self.states is None:
            kv = self.all_kv(src)
            return kv[torch.arange(B)[:, None, None], idx]
        raw = []
        for b, st in enumerate(self.states):
            rows = st.kv[src]
            raw.append(rows.gather(idx[b].clamp(0, max(rows.n - 1, 0))) if rows.n else
                       torch.zeros(T, k, rows.width, dtype=torch.uint8))
        return decode(torch.stack(raw), self.cfg.main_kv_format, self.cfg.head_dim)


def fq(x: torch.Tensor, fmt: str, training: bool) -> torch.Tensor:
    """Quantise-dequantise in the storage format; straight-through gradient when training."""
    if training and x.requires_grad:
        from cedlm.quant import fake_quant
        return fake_quant(x, fmt)
    return quant_dequant(x, fmt).to(x.dtype)
