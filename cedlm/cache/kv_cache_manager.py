"""The KV cache manager: the paged block pool, the prefix cache and the store spill, behind the
four verbs a scheduler needs (`get_computed_blocks`, `allocate_slots`, `free`,
`cache_full_blocks`).

It works on integers and block tables: a request is anything with `all_ids`, `num_cached`,
`num_prefix_hit`, `num_blocks` and `table` attributes; it never sees the model. The global rows
live in the pool; window rings are per sequence (sized by the KV layout) and are the engine's.
Full blocks are published under chained prefix hashes (salted with the model fingerprint) and,
with a store, written through to it; a later prefix hit reads them back from the pool or, past
the pool, from the store. A store that fails is a cache miss, never a failed request.
"""
from __future__ import annotations

import logging

import torch

from cedlm.cache.block_pool import BlockPool, BlockTable
from cedlm.cache.prefix import block_hashes
from cedlm.cache.store import Record
from cedlm.kv_layout import KVLayout

log = logging.getLogger(__name__)


def blocks_for_budget(layout: KVLayout, kv_budget_bytes: int, max_num_seqs: int, block_tokens: int) -> int:
    """Blocks that fit in a budget after the window rings of max_num_seqs sequences."""
    reserve = max_num_seqs * layout.window_bytes_per_sequence
    per_block = layout.bytes_per_block(block_tokens)
    n = (kv_budget_bytes - reserve) // per_block
    if n < 1:
        raise ValueError(
            f"kv_budget_bytes: {kv_budget_bytes} B cannot hold the windows of max_num_seqs="
            f"{max_num_seqs} sequences ({reserve} B) plus one KV block ({per_block} B)")
    return n


class KVCacheManager:
    def __init__(self, layout: KVLayout, num_blocks: int, block_tokens: int, *,
                 fingerprint: bytes = b"", enable_prefix_cache: bool = True, store=None):
        self.layout, self.block_tokens = layout, block_tokens
        self.pool = BlockPool(layout, num_blocks, block_tokens)
        self.fingerprint, self.enable_prefix_cache, self.store = fingerprint, enable_prefix_cache, store
        self._stored: set[str] | None = None
        self.stats = {"store_block_hits": 0, "store_errors": 0}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def hashes(self, ids: list[int]) -> list[bytes]:
        return block_hashes(ids, self.block_tokens, salt=self.fingerprint)

    # ---------------------------------------------------------------- the four verbs
    def get_computed_blocks(self, req) -> int:
        """At admission: give req a block table that starts with the longest cached prefix
        (pool, then store); returns the number of tokens it covers (req.num_cached)."""
        req.table = BlockTable(self.pool)
        req.num_cached = req.num_prefix_hit = req.num_blocks = 0
        if not self.enable_prefix_cache:
            return 0
        bt, ids = self.block_tokens, req.all_ids
        hashes = self.hashes(ids)[: (len(ids) - 1) // bt]        # leave >= 1 token to run
        blocks = self.pool.lookup(hashes)
        blocks += self._load_blocks(hashes[len(blocks):])
        req.table.adopt(blocks)
        req.num_cached = req.num_prefix_hit = len(blocks) * bt
        req.num_blocks = len(blocks)
        return req.num_cached

    def allocate_slots(self, req, num_tokens: int) -> bool:
        """Make req hold blocks for its first num_tokens positions; False (nothing taken) when
        the pool cannot."""
        need = -(-num_tokens // self.block_tokens) - len(req.table.blocks)
        if need > self.pool.num_free:
            return False
        req.table.ensure(len(req.table.blocks) + max(need, 0))
        req.num_blocks = len(req.table.blocks)
        return True

    def free(self, req) -> None:
        """Publish req's full blocks, then release everything it holds."""
        if req.table is not None:
            self.cache_full_blocks(req)
            req.table.free()
        req.table, req.num_blocks = None, 0

    def cache_full_blocks(self, req) -> None:
        """Publish the complete blocks of req's computed tokens to the prefix cache and the store."""
        if not self.enable_prefix_cache or req.table is None:
            return
        bt = self.block_tokens
        n_full = min(req.num_cached // bt, len(req.table.blocks))
        for b, h in zip(req.table.blocks, self.hashes(req.all_ids[: n_full * bt])):
            self.pool.register(b, h)
            self._store_block(b, h)

    # ---------------------------------------------------------------- rows for a sequence
    def rows(self, req):
        """Row factory for a SequenceState whose global rows live in req's blocks."""
        return self.pool.rows(req.table)

    # ---------------------------------------------------------------- store spill
    def _stored_keys(self) -> set[str]:
        if self._stored is None:
            self._stored = set(self.store.keys())
        return self._stored

    def _store_block(self, b: int, h: bytes) -> None:
        if self.store is None:
            return
        try:
            if h.hex() in self._stored_keys():
                return
            self.store.put(h.hex(), Record(
                meta={"fingerprint": self.fingerprint.hex(), "block_tokens": self.block_tokens},
                arrays={f"{k}.{s}": t[b] for (k, s), t in self.pool.data.items()}))
            self._stored.add(h.hex())
        except Exception as e:                   # noqa: BLE001 - a store outage is a cache miss
            self.stats["store_errors"] += 1
            log.warning("store: could not write block %s: %s", h.hex(), e)

    def _load_blocks(self, hashes: list[bytes]) -> list[int]:
        """Continue a prefix hit from the store: each hit is copied into a fresh pool block."""
        out: list[int] = []
        if self.store is None:
            return out
        want = {f"{k}.{s}": tuple(t.shape[1:]) for (k, s), t in self.pool.data.items()}
        for h in hashes:
            if self.pool.num_free <= 0:
                break
            try:
                rec = self.store.get(h.hex())
            except Exception as e:               # noqa: BLE001 - a store outage is a cache miss
                self.stats["store_errors"] += 1
                log.warning("store: could not read block %s: %s", h.hex(), e)
                break
            if rec is None or rec.meta.get("fingerprint") != self.fingerprint.hex():
                break
            arrays = rec.tensors() if hasattr(rec, "tensors") else rec.arrays
            if set(arrays) != set(want) or any(tuple(arrays[k].shape) != v for k, v in want.items()):
                break
            b = self.pool.allocate()
            for (k, s), t in self.pool.data.items():
                t[b] = torch.as_tensor(arrays[f"{k}.{s}"])
            self.pool.register(b, h)
            out.append(b)
            self.stats["store_block_hits"] += 1
        return out
