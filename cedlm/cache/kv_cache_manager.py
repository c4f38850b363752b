"""The KV cache manager: the paged block pool, the prefix cache and the store spill, behind the
four verbs a scheduler needs (`get_computed_blocks`, `allocate_slots`, `free`,
`cache_full_blocks`).

It works on integers and holds the block tables, by request id: a request is anything with
`request_id`, `all_ids`, `num_computed_tokens` (read only; the scheduler writes it), `params`
and `images`; it never sees the model and writes nothing on the request. The global rows
live in the pool; window rings are per sequence (sized by the KV layout) and are the engine's.
Full blocks are published under chained prefix hashes (salted with the model fingerprint) and,
with a store, written through to it; a later prefix hit reads them back from the pool or, past
the pool, from the store. A store that fails is a cache miss, never a failed request: the store
is always used through a `StoreGuard` (counted, rate-limited-logged misses and a circuit breaker,
its state in `stats`; pass `store=StoreGuard(backend, failure_threshold=..., cooldown_s=...)` to
tune it), and every path that fails releases the blocks it took.
"""
from __future__ import annotations

import hashlib
import logging

import torch

from cedlm.cache.block_pool import BlockPool, BlockTable
from cedlm.cache.prefix import block_hashes
from cedlm.cache.store import Record, guard_store
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


def _cache_salt(req) -> str | None:
    return getattr(getattr(req, "params", None), "cache_salt", None)


def _image_spans(req) -> list[tuple[int, int, bytes]] | None:
    """(start, length, digest) of the request's image spans (vision prompts), else None."""
    ims = getattr(req, "images", None)
    return [(im.start, im.length, im.image.digest) for im in ims] if ims else None


class KVCacheManager:
    def __init__(self, layout: KVLayout, num_blocks: int, block_tokens: int, *,
                 fingerprint: bytes = b"", enable_prefix_cache: bool = True, store=None,
                 device: torch.device | str = "cpu"):
        self.layout, self.block_tokens = layout, block_tokens
        self.pool = BlockPool(layout, num_blocks, block_tokens, device=device)   # bytes on the model's device
        self.fingerprint, self.enable_prefix_cache = fingerprint, enable_prefix_cache
        self.tables: dict[str, BlockTable] = {}  # request id -> the blocks it holds
        self._stored: set[str] | None = None     # keys known to be in the store
        self._stored_errors = 0                  # the store's error count when _stored was listed
        self._stats = {"store_block_hits": 0, "store_errors": 0}
        self.store = guard_store(store, stats=self._stats)  # counters and breaker states land in stats

    @property
    def stats(self) -> dict:
        """Store spill counters and the store's circuit-breaker states (current as of now)."""
        if self.store is not None:
            self.store.refresh()
        return self._stats

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def hashes(self, ids: list[int], cache_salt: str | None = None, spans=None) -> list[bytes]:
        """Block hashes salted with the model fingerprint and, if given, a request's cache salt
        (requests with different salts never share blocks); `spans`: the request's image spans
        (start, length, content digest), mixed into the blocks they touch."""
        salt = self.fingerprint
        if cache_salt:
            salt = hashlib.blake2b(b"cedlm.cache_salt.v1\x00" + salt + cache_salt.encode("utf-8", "surrogatepass"),
                                   digest_size=16).digest()
        return block_hashes(ids, self.block_tokens, salt=salt, spans=spans)

    # ---------------------------------------------------------------- the four verbs
    def get_computed_blocks(self, req, use_prefix_cache: bool = True) -> int:
        """At admission: give req a block table that starts with the longest cached prefix
        (pool, then store); returns the number of tokens it covers (the scheduler records it).
        With use_prefix_cache=False the table starts empty (a request whose every row must run)."""
        self.free(req)                           # a table left from an earlier try goes
        table = self.tables[req.request_id] = BlockTable(self.pool)
        if not (self.enable_prefix_cache and use_prefix_cache):
            return 0
        bt, ids = self.block_tokens, req.all_ids
        hashes = self.hashes(ids, _cache_salt(req), _image_spans(req))[: (len(ids) - 1) // bt]        # leave >= 1 token to run
        blocks = self.pool.lookup(hashes)
        try:
            blocks += self._load_blocks(hashes[len(blocks):])
        except BaseException:
            for b in blocks:                     # nothing held on a failed admission
                self.pool.release(b)
            del self.tables[req.request_id]
            raise
        table.adopt(blocks)
        return len(blocks) * bt

    def num_blocks_of(self, req) -> int:
        """Blocks req holds now."""
        t = self.tables.get(req.request_id)
        return 0 if t is None else len(t.blocks)

    def allocate_slots(self, req, num_tokens: int) -> bool:
        """Make req hold blocks for its first num_tokens positions; False (nothing taken) when
        the pool cannot."""
        table = self.tables.get(req.request_id)
        if table is None:
            table = self.tables[req.request_id] = BlockTable(self.pool)
        need = -(-num_tokens // self.block_tokens) - len(table.blocks)
        if need > self.pool.num_free:
            return False
        table.ensure(len(table.blocks) + max(need, 0))
        return True

    def trim(self, req, num_tokens: int) -> None:
        """Release req's blocks past its first num_tokens positions (speculative lookahead slots
        not used); blocks it still needs stay."""
        keep = -(-num_tokens // self.block_tokens)
        table = self.tables.get(req.request_id)
        if table is not None and len(table.blocks) > keep:
            table.truncate(keep)

    def free(self, req) -> None:
        """Publish req's full blocks, then release everything it holds."""
        table = self.tables.get(req.request_id)
        if table is None:
            return
        try:
            self.cache_full_blocks(req)
        finally:
            table.free()
            del self.tables[req.request_id]

    def cache_full_blocks(self, req) -> None:
        """Publish the complete blocks of req's computed tokens to the prefix cache and the store."""
        table = self.tables.get(req.request_id)
        if not self.enable_prefix_cache or table is None:
            return
        bt = self.block_tokens
        n_full = min(req.num_computed_tokens // bt, len(table.blocks))
        store_ok = True                          # one failed write per call at most
        for b, h in zip(table.blocks, self.hashes(req.all_ids[: n_full * bt], _cache_salt(req),
                                                  _image_spans(req))):
            self.pool.register(b, h)
            if store_ok:
                store_ok = self._store_block(b, h)

    def fork(self, src, dst, num_tokens: int) -> bool:
        """dst takes src's first num_tokens positions: the full blocks are shared (reference
        counted; read-only from here on, later rows go to later blocks), a partial last block is
        copied. False (nothing taken) when the copy needs a block the pool does not have."""
        pool, bt = self.pool, self.block_tokens
        n_full, part = divmod(num_tokens, bt)
        if part and pool.num_free < 1:
            return False
        src_blocks = self.tables[src.request_id].blocks
        table = BlockTable(pool)
        shared = src_blocks[:n_full]
        for b in shared:
            pool.incref(b)
        table.adopt(shared)
        if part:
            b, a = pool.allocate(), src_blocks[n_full]
            for t in pool.data.values():
                t[b] = t[a]
            table.blocks.append(b)
        self.free(dst)
        self.tables[dst.request_id] = table
        return True

    # ---------------------------------------------------------------- rows for a sequence
    def rows(self, req):
        """Row factory for a SequenceState whose global rows live in req's blocks."""
        return self.pool.rows(self.tables[req.request_id], allocate=False)

    # ---------------------------------------------------------------- store spill
    def _stored_keys(self) -> set[str]:
        """The keys known to be in the store: listed at start-up (none if that fails), and listed
        again once the store works after failing (it may have come back empty, e.g. a restarted
        Redis: the blocks still in memory are then written back as they are used)."""
        counters = getattr(self.store, "counters", {})
        errors = counters.get("store_errors", 0)
        relist = self._stored is not None and errors != self._stored_errors \
            and counters.get("store_breaker_state", "closed") == "closed"
        if self._stored is None or relist:
            keys = self.store.keys_or_none()
            if keys is not None or self._stored is None:
                self._stored = set(keys or ())
            self._stored_errors = counters.get("store_errors", 0)
        return self._stored

    def _not_stored(self, hashes: list[bytes]) -> None:
        """A miss at hashes[0] (absent, dropped as corrupt, evicted, failed): write it again when
        produced, and the blocks chained after it too (unreachable in the store without it, and
        perhaps as bad: a corrupt one is only found, and dropped, when it is read)."""
        if self._stored is not None:
            self._stored.difference_update(h.hex() for h in hashes)

    def _store_block(self, b: int, h: bytes) -> bool:
        """Write block b through to the store unless it is there; False when the store failed."""
        if self.store is None:
            return True
        key = h.hex()
        if key in self._stored_keys():
            return True
        ok = self.store.put(key, Record(        # the guard: a failure is counted, logged, False
            meta={"fingerprint": self.fingerprint.hex(), "block_tokens": self.block_tokens},
            arrays={f"{k}.{s}": t[b] for (k, s), t in self.pool.data.items()}))
        if ok:
            self._stored.add(key)
        return ok

    def _load_blocks(self, hashes: list[bytes]) -> list[int]:
        """Continue a prefix hit from the store: each hit is copied into a fresh pool block."""
        out: list[int] = []
        if self.store is None:
            return out
        want = {f"{k}.{s}": tuple(t.shape[1:]) for (k, s), t in self.pool.data.items()}
        try:
            for i, h in enumerate(hashes):
                if self.pool.num_free <= 0:
                    break
                key = h.hex()
                rec = self.store.get(key)        # the guard: a failure is counted, logged, None
                if rec is None or rec.meta.get("fingerprint") != self.fingerprint.hex():
                    self._not_stored(hashes[i:])
                    break
                arrays = rec.tensors() if hasattr(rec, "tensors") else rec.arrays
                if set(arrays) != set(want) or any(tuple(arrays[k].shape) != v for k, v in want.items()):
                    self._not_stored(hashes[i:])
                    break
                b = self.pool.allocate()
                try:
                    for (k, s), t in self.pool.data.items():
                        t[b] = torch.as_tensor(arrays[f"{k}.{s}"], device=t.device)
                except Exception as e:           # noqa: BLE001 - an unusable record is a miss
                    self.pool.release(b)
                    self._not_stored(hashes[i:])
                    self.store.note_failure("load", key, e)
                    break
                self.pool.register(b, h)
                out.append(b)
                self._stats["store_block_hits"] += 1
        except BaseException:
            for b in out:                        # nothing held when loading fails
                self.pool.release(b)
            raise
        return out
