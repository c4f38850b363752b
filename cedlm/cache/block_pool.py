"""Paged global-KV storage: one pool of fixed-size blocks shared by all sequences.

A block covers `block_tokens` consecutive positions of one sequence and holds, for every KV
source layer, the compressed main-KV rows of those positions (block_tokens / ratio entries) and,
for index-key layers, the index-key rows: exactly `block_tokens * kv_bytes_per_token` bytes, all
allocated up front as uint8 tensors (a byte reported is a byte allocated). Sequences own block
tables; full blocks can be shared by prefix caching (reference counts, chained block hashes);
a freed block that carries a hash stays reusable until its space is needed (LRU).
Plain Python over integers, apart from the byte tensors themselves.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from cedlm.kv_layout import KVLayout


class NoFreeBlocks(RuntimeError):
    """The pool is exhausted (the scheduler preempts or waits)."""


class BlockPool:
    """The pool's byte tensors live on `device` (the model's: the paged rows are read and written
    there); its bookkeeping (reference counts, free list, hashes) is host-side Python."""

    def __init__(self, layout: KVLayout, num_blocks: int, block_tokens: int = 64,
                 device: torch.device | str = "cpu"):
        layout.check_block_tokens(block_tokens)
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be positive, got {num_blocks}")
        self.layout, self.num_blocks, self.block_tokens = layout, num_blocks, block_tokens
        self.device = torch.empty(0, device=device).device        # "cuda" -> "cuda:N"
        self.data: dict[tuple[str, int], torch.Tensor] = {}
        self.per_block: dict[tuple[str, int], int] = {}
        for spec in layout.rows:
            n = spec.entries_per_block(block_tokens)
            self.per_block[spec.key] = n
            self.data[spec.key] = torch.zeros(num_blocks, n, spec.width, dtype=torch.uint8, device=self.device)
        self.bytes_per_block = layout.bytes_per_block(block_tokens)
        assert self.bytes_per_block == sum(t[0].numel() for t in self.data.values())
        self.ref = [0] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))     # pop() gives block 0 first
        self.hash_of: dict[int, bytes] = {}
        self.cached: dict[bytes, int] = {}                              # block hash -> block
        self.evictable: OrderedDict[int, None] = OrderedDict()          # ref 0, hashed; LRU order
        self.stats = {"prefix_queries": 0, "prefix_hits": 0, "prefix_cached_tokens": 0}

    # ---------------------------------------------------------------- accounting
    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.data.values())

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free or evictable cached ones)."""
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def bytes_in_use(self) -> dict[str, int]:
        """Bytes of blocks referenced by live sequences, split into main KV and index keys."""
        used, bt = self.num_used, self.block_tokens
        return {"main_kv": used * self.layout.bytes_per_block_of("kv", bt),
                "index_keys": used * self.layout.bytes_per_block_of("idx", bt)}

    # ---------------------------------------------------------------- allocation
    def allocate(self) -> int:
        if self.free:
            b = self.free.pop()
        elif self.evictable:
            b, _ = self.evictable.popitem(last=False)                   # least recently used
            del self.cached[self.hash_of.pop(b)]
        else:
            raise NoFreeBlocks(f"all {self.num_blocks} KV blocks are in use")
        self.ref[b] = 1
        return b

    def incref(self, b: int) -> None:
        if self.ref[b] == 0:
            self.evictable.pop(b, None)
        self.ref[b] += 1

    def release(self, b: int) -> None:
        if self.ref[b] <= 0:
            raise RuntimeError(f"block {b} released more often than acquired")
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if b in self.hash_of:
                self.evictable[b] = None
            else:
                self.free.append(b)

    # ---------------------------------------------------------------- prefix cache
    def register(self, b: int, h: bytes) -> None:
        """Mark a full block as holding the prefix with chained hash h (first writer wins)."""
        if b in self.hash_of or h in self.cached:
            return
        self.hash_of[b], self.cached[h] = h, b

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Longest run of cached blocks matching `hashes` from the start; acquires them."""
        self.stats["prefix_queries"] += 1
        out = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            self.incref(b)
            out.append(b)
        if out:
            self.stats["prefix_hits"] += 1
            self.stats["prefix_cached_tokens"] += len(out) * self.block_tokens
        return out

    def rows(self, table: "BlockTable", allocate: bool = True):
        """Factory for SequenceState(rows=...): paged rows of each row kind over one block table.
        allocate=False (the engine's sequences, whose blocks the scheduler reserves before a
        step): an append past the table's blocks is an error, never an allocation."""
        return lambda spec: PagedRows(self, table, spec.key, spec.width, allocate)


class BlockTable:
    """A sequence's blocks, in position order; allocates on demand, releases on free()."""

    def __init__(self, pool: BlockPool):
        self.pool, self.blocks = pool, []

    def ensure(self, n_blocks: int) -> None:
        while len(self.blocks) < n_blocks:
            self.blocks.append(self.pool.allocate())

    def adopt(self, blocks: list[int]) -> None:
        """Start from already-acquired (prefix-cached) blocks."""
        assert not self.blocks
        self.blocks = list(blocks)

    def truncate(self, n_blocks: int) -> None:
        """Release the blocks past the first n_blocks."""
        while len(self.blocks) > n_blocks:
            self.pool.release(self.blocks.pop())

    def free(self) -> None:
        for b in reversed(self.blocks):
            self.pool.release(b)
        self.blocks = []


class PagedRows:
    """Rows of one kind of one sequence, stored in the pool's blocks (ByteRows interface)."""

    def __init__(self, pool: BlockPool, table: BlockTable, key: tuple[str, int], width: int,
                 allocate: bool = True):
        self.pool, self.table, self.key, self.width = pool, table, key, width
        self.per_block = pool.per_block[key]
        self.allocate = allocate
        self.n = 0

    def append(self, rows: torch.Tensor) -> None:
        k = rows.shape[0]
        if k == 0:
            return
        need = -(-(self.n + k) // self.per_block)
        if self.allocate:
            self.table.ensure(need)
        elif need > len(self.table.blocks):
            raise RuntimeError(f"paged rows {self.key}: {self.n + k} rows need {need} blocks, the "
                               f"table holds {len(self.table.blocks)} (slots are reserved before a step)")
        data = self.pool.data[self.key]
        j = self.n
        while j < self.n + k:               # copy block by block
            b, off = divmod(j, self.per_block)
            take = min(self.per_block - off, self.n + k - j)
            data[self.table.blocks[b], off: off + take] = rows[j - self.n: j - self.n + take]
            j += take
        self.n += k

    def view(self) -> torch.Tensor:
        nb = -(-self.n // self.per_block)
        data = self.pool.data[self.key]
        blocks = torch.tensor(self.table.blocks[:nb], dtype=torch.int64, device=data.device)
        return data[blocks].reshape(-1, self.width)[: self.n]

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        data = self.pool.data[self.key]
        blocks = torch.tensor(self.table.blocks, dtype=torch.int64, device=data.device)
        return data[blocks[idx // self.per_block], idx % self.per_block]

    def blocks(self) -> tuple[torch.Tensor, list[int]]:
        """(the pool's tensor of this row kind [num_blocks, per_block, width], this sequence's
        block ids in position order): what the compiled decode step reads through."""
        return self.pool.data[self.key], self.table.blocks

    def set_len(self, n: int) -> None:
        """After adopting cached blocks: their first n rows are valid."""
        self.n = n

    @property
    def nbytes(self) -> int:
        return self.n * self.width
