"""Paged global-KV pool (cedlm/cache/block_pool.py): reference counts, allocation, the prefix
cache's hashed free blocks (LRU), exact byte sizing, and paged rows that must read back exactly
what a contiguous ByteRows holds. Model-free."""
import dataclasses

import pytest
import torch

from cedlm.cache.block_pool import BlockPool, BlockTable, NoFreeBlocks, PagedRows
from cedlm.config import ModelConfig
from cedlm.kv_layout import KVLayout
from cedlm.model.state import ByteRows, SequenceState

BT = 4                                                   # block tokens: 2 entries at ratio 2, 4 at ratio 1


@pytest.fixture(scope="module")
def layout() -> KVLayout:
    return KVLayout.from_config(ModelConfig.preset("tiny"))


def H(i: int) -> bytes:
    return b"h%d" % i


# ------------------------------------------------------------------------------------------------
# sizing


@pytest.mark.parametrize("block_tokens", [2, 4, 64])
def test_bytes_per_block_is_allocated_exactly(layout, block_tokens):
    pool = BlockPool(layout, 5, block_tokens)
    assert pool.bytes_per_block == layout.bytes_per_block(block_tokens)
    assert pool.bytes_per_block == block_tokens * layout.bytes_per_token      # tiny: 70 B/token
    real = sum(t.numel() * t.element_size() for t in pool.data.values())
    assert real == pool.nbytes == 5 * pool.bytes_per_block
    assert all(t.dtype == torch.uint8 and t.shape[0] == 5 for t in pool.data.values())
    # one tensor per row kind, entries per block = block_tokens / ratio
    assert set(pool.data) == {s.key for s in layout.rows}
    for s in layout.rows:
        assert pool.data[s.key].shape[1:] == (block_tokens // s.ratio, s.width)


@pytest.mark.parametrize("bad", [0, -2, 1, 3, 5])
def test_invalid_block_tokens_raises(layout, bad):
    with pytest.raises(ValueError, match="block_tokens"):
        BlockPool(layout, 4, bad)


def test_block_tokens_must_divide_every_ratio():
    cfg = ModelConfig.preset("tiny")
    r = list(cfg.compress_ratios)
    r[2:4] = [4, 4]                                      # ratios 4, 2, 1 -> multiples of 4
    lay = KVLayout.from_config(dataclasses.replace(cfg, compress_ratios=r))
    for bad in (2, 6, 10):
        with pytest.raises(ValueError, match="block_tokens"):
            BlockPool(lay, 4, bad)
    BlockPool(lay, 4, 8)


def test_num_blocks_must_be_positive(layout):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(layout, 0, BT)


# ------------------------------------------------------------------------------------------------
# reference counts and allocation


def test_fresh_pool_allocates_in_order_then_exhausts(layout):
    pool = BlockPool(layout, 4, BT)
    assert pool.num_free == 4 and pool.num_used == 0
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]
    assert pool.num_free == 0 and pool.num_used == 4
    with pytest.raises(NoFreeBlocks):
        pool.allocate()
    assert issubclass(NoFreeBlocks, RuntimeError)
    pool.release(2)
    assert pool.allocate() == 2                          # the only free block
    with pytest.raises(NoFreeBlocks):
        pool.allocate()


def test_refcount_incref_release(layout):
    pool = BlockPool(layout, 3, BT)
    b = pool.allocate()
    assert pool.ref[b] == 1
    pool.incref(b)
    pool.incref(b)
    assert pool.ref[b] == 3
    pool.release(b)
    pool.release(b)
    assert pool.ref[b] == 1 and pool.num_used == 1      # still held once
    pool.release(b)
    assert pool.ref[b] == 0 and pool.num_used == 0
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(b)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(2)                                  # never acquired
    assert pool.num_free == 3                            # the failed releases changed nothing
    assert sorted(pool.allocate() for _ in range(3)) == [0, 1, 2]


def test_shared_block_is_not_reused_while_referenced(layout):
    pool = BlockPool(layout, 2, BT)
    a = pool.allocate()
    pool.incref(a)                                       # a second sequence shares it
    pool.release(a)
    b = pool.allocate()
    assert b != a
    with pytest.raises(NoFreeBlocks):
        pool.allocate()


def test_block_table_ensure_and_free(layout):
    pool = BlockPool(layout, 3, BT)
    t = BlockTable(pool)
    t.ensure(2)
    assert t.blocks == [0, 1]
    t.ensure(1)                                          # never shrinks
    assert t.blocks == [0, 1]
    t.ensure(3)
    with pytest.raises(NoFreeBlocks):
        t.ensure(4)
    t.free()
    assert t.blocks == [] and pool.num_free == 3 and pool.ref == [0, 0, 0]


def test_bytes_in_use(layout):
    pool = BlockPool(layout, 4, BT)
    t = BlockTable(pool)
    t.ensure(3)
    use = pool.bytes_in_use()
    assert use["main_kv"] == 3 * layout.bytes_per_block_of("kv", BT)
    assert use["index_keys"] == 3 * layout.bytes_per_block_of("idx", BT)
    assert use["main_kv"] + use["index_keys"] == 3 * pool.bytes_per_block


# ------------------------------------------------------------------------------------------------
# prefix cache: hashed blocks, lookup, LRU


def test_freed_hashed_block_stays_cached_until_its_space_is_needed(layout):
    pool = BlockPool(layout, 2, BT)
    b = pool.allocate()
    pool.register(b, H(0))
    pool.release(b)
    assert pool.num_free == 2                            # counts as free ...
    assert pool.lookup([H(0)]) == [b]                    # ... but still reusable
    assert pool.ref[b] == 1 and pool.num_free == 1
    pool.release(b)
    other = pool.allocate()                              # plain free blocks go first
    assert other != b
    assert pool.lookup([H(0)]) == [b]                    # untouched
    pool.release(b)
    assert pool.allocate() == b                          # now its space is needed: evicted
    assert pool.lookup([H(0)]) == []                     # and its hash forgotten
    pool.release(b)
    assert pool.num_free == 1                            # evicted block came back as plain


def test_lru_evicts_least_recently_freed_hashed_block(layout):
    pool = BlockPool(layout, 3, BT)
    bs = [pool.allocate() for _ in range(3)]
    for i, b in enumerate(bs):
        pool.register(b, H(i))
    for b in (bs[1], bs[0], bs[2]):                      # free order: 1, 0, 2
        pool.release(b)
    assert pool.allocate() == bs[1]
    assert pool.lookup([H(1)]) == []
    assert pool.lookup([H(0)]) == [bs[0]] and pool.lookup([H(2)]) == [bs[2]]
    pool.release(bs[0])                                  # reacquired and freed again: now the
    pool.release(bs[2])                                  # order is 0, 2
    assert pool.allocate() == bs[0]
    assert pool.lookup([H(0)]) == []
    assert pool.allocate() == bs[2]
    assert pool.lookup([H(2)]) == []
    with pytest.raises(NoFreeBlocks):
        pool.allocate()


def test_reacquiring_a_cached_block_refreshes_its_lru_position(layout):
    pool = BlockPool(layout, 2, BT)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, H(0))
    pool.register(b, H(1))
    pool.release(a)
    pool.release(b)                                      # LRU order: a, b
    assert pool.lookup([H(0)]) == [a]                    # a taken out of the evictable set
    pool.release(a)                                      # LRU order: b, a
    assert pool.allocate() == b
    assert pool.lookup([H(0)]) == [a]


def test_register_first_writer_wins(layout):
    pool = BlockPool(layout, 3, BT)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, H(0))
    pool.register(b, H(0))                               # same prefix computed twice
    assert pool.lookup([H(0)]) == [a]
    pool.release(a)
    pool.register(a, H(1))                               # a keeps its hash
    assert pool.lookup([H(1)]) == []
    assert pool.lookup([H(0)]) == [a]
    # b carries no hash: once freed it is a plain free block, handed out before any cached one
    pool.release(b)
    pool.release(a)
    pool.release(a)
    assert pool.allocate() == b
    assert pool.lookup([H(0)]) == [a]


def test_lookup_stops_at_first_miss_and_acquires(layout):
    pool = BlockPool(layout, 4, BT)
    bs = [pool.allocate() for _ in range(4)]
    for i in (0, 1, 3):                                  # hash 2 never registered
        pool.register(bs[i], H(i))
    for b in bs:
        pool.release(b)
    got = pool.lookup([H(0), H(1), H(2), H(3)])
    assert got == [bs[0], bs[1]]                         # not bs[3]: chained prefix stops at 2
    assert [pool.ref[b] for b in bs] == [1, 1, 0, 0]
    assert pool.lookup([H(9), H(0)]) == []               # a first-position miss finds nothing
    assert pool.ref[bs[0]] == 1
    again = pool.lookup([H(0)])                          # a second holder of the same block
    assert again == [bs[0]] and pool.ref[bs[0]] == 2
    assert pool.stats["prefix_queries"] == 3 and pool.stats["prefix_hits"] == 2
    assert pool.stats["prefix_cached_tokens"] == 3 * BT


def test_adopted_blocks_are_released_by_the_table(layout):
    pool = BlockPool(layout, 2, BT)
    t = BlockTable(pool)
    t.ensure(2)
    b0 = t.blocks[0]
    pool.register(b0, H(0))
    t.free()
    t2 = BlockTable(pool)
    t2.adopt(pool.lookup([H(0)]))
    assert t2.blocks == [b0]
    t2.ensure(2)
    assert pool.num_free == 0
    t2.free()
    assert pool.num_free == 2 and pool.ref == [0, 0]
    assert pool.lookup([H(0)]) == [b0]


# ------------------------------------------------------------------------------------------------
# paged rows


def _rows(n: int, width: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=gen)


@pytest.mark.parametrize("key", [("kv", 2), ("idx", 2), ("kv", 6), ("idx", 6)])
def test_paged_rows_match_contiguous_rows_across_block_boundaries(layout, key):
    gen = torch.Generator().manual_seed(0)
    spec = layout.row(*key)
    pool = BlockPool(layout, 16, BT)
    table = BlockTable(pool)
    paged, ref = PagedRows(pool, table, spec.key, spec.width), ByteRows(spec.width, capacity=1)
    per_block = BT // spec.ratio
    for k in (1, 3, 0, 2, 5, 1, 7, per_block, 4):        # uneven chunks straddling blocks
        rows = _rows(k, spec.width, gen)
        paged.append(rows)
        ref.append(rows)
        assert paged.n == ref.n
        assert len(table.blocks) == -(-ref.n // per_block)        # exactly the blocks needed
        assert torch.equal(paged.view(), ref.view())
        assert paged.nbytes == ref.nbytes
    idx = torch.randint(0, ref.n, (3, 5), generator=gen)
    assert torch.equal(paged.gather(idx), ref.gather(idx))
    every = torch.arange(ref.n)
    assert torch.equal(paged.gather(every), ref.view())


def test_paged_rows_on_non_identity_block_order(layout):
    """Blocks handed out out of order (after frees) must still read back in position order."""
    gen = torch.Generator().manual_seed(1)
    spec = layout.row("kv", 6)                           # ratio 1: 4 rows per block
    pool = BlockPool(layout, 6, BT)
    filler = BlockTable(pool)
    filler.ensure(6)
    for b in (4, 1, 5):
        pool.release(b)
    filler.blocks = [0, 2, 3]
    table = BlockTable(pool)
    paged, ref = PagedRows(pool, table, spec.key, spec.width), ByteRows(spec.width)
    for k in (3, 6, 2):
        rows = _rows(k, spec.width, gen)
        paged.append(rows)
        ref.append(rows)
    assert sorted(table.blocks) == [1, 4, 5] and table.blocks != sorted(table.blocks)
    assert torch.equal(paged.view(), ref.view())
    idx = torch.tensor([10, 0, 4, 3, 7, 8])
    assert torch.equal(paged.gather(idx), ref.gather(idx))


def test_two_sequences_interleaving_do_not_clobber(layout):
    gen = torch.Generator().manual_seed(2)
    pool = BlockPool(layout, 32, BT)
    seqs = []
    for _ in range(2):
        table = BlockTable(pool)
        stores = {s.key: (PagedRows(pool, table, s.key, s.width), ByteRows(s.width)) for s in layout.rows}
        seqs.append((table, stores, [0]))
    # tokens fed in chunks, the two sequences alternating; each chunk adds the rows its
    # positions complete for every row kind (as a forward pass would)
    chunks = [(0, 3), (1, 1), (0, 2), (1, 6), (0, 7), (1, 2), (1, 1), (0, 1), (0, 4), (1, 5)]
    for who, k in chunks:
        table, stores, ntok = seqs[who]
        before, after = ntok[0], ntok[0] + k
        for s in layout.rows:
            new = after // s.ratio - before // s.ratio
            rows = _rows(new, s.width, gen)
            for st in stores[s.key]:
                st.append(rows)
        ntok[0] = after
    (t0, s0, n0), (t1, s1, n1) = seqs
    assert not set(t0.blocks) & set(t1.blocks)
    assert len(t0.blocks) == -(-n0[0] // BT) and len(t1.blocks) == -(-n1[0] // BT)
    for stores in (s0, s1):
        for key, (paged, ref) in stores.items():
            assert paged.n == ref.n
            assert torch.equal(paged.view(), ref.view()), key
            idx = torch.arange(ref.n).flip(0)
            assert torch.equal(paged.gather(idx), ref.gather(idx)), key
    # freeing one sequence leaves the other intact, even after its blocks are reused
    t0.free()
    junk = BlockTable(pool)
    junk.ensure(pool.num_free)
    for key, (paged, ref) in s1.items():
        pool.data[key][junk.blocks] = 255
        assert torch.equal(paged.view(), ref.view()), key


def test_sequence_state_over_paged_rows(layout):
    """SequenceState(rows=pool.rows(table)) stores every row kind in the table's blocks and
    reports the same nbytes as the contiguous state."""
    gen = torch.Generator().manual_seed(3)
    pool = BlockPool(layout, 8, BT)
    table = BlockTable(pool)
    paged, ref = SequenceState(layout, rows=pool.rows(table)), SequenceState(layout)
    n = 0
    for k in (5, 2, 6):
        for s in layout.rows:
            rows = _rows((n + k) // s.ratio - n // s.ratio, s.width, gen)
            for st in (paged, ref):
                (st.kv if s.kind == "kv" else st.index)[s.layer].append(rows)
        n += k
    assert len(table.blocks) == -(-n // BT)
    assert paged.nbytes() == ref.nbytes()
    for layer in ref.kv:
        assert torch.equal(paged.kv[layer].view(), ref.kv[layer].view())
    for layer in ref.index:
        assert torch.equal(paged.index[layer].view(), ref.index[layer].view())
    assert pool.num_used * pool.bytes_per_block >= paged.nbytes()["main_kv"] + paged.nbytes()["index_keys"]


def test_contiguous_rows_hold_whole_candidate_blocks():
    """Contiguous rows keep a capacity of whole `ROW_QUANTUM` rows, as paged pools are whole blocks:
    a compiled step's graph guards on the rows' count modulo the candidate block (a graph built on
    paged rows recompiled for contiguous rows of 538)."""
    from cedlm.config import CONFIG_DIR
    from cedlm.model.state import ROW_QUANTUM
    official = ModelConfig.from_json(CONFIG_DIR / "deepseek-v4.1-flash.config.json")
    assert ROW_QUANTUM % official.candidate_block_size == 0
    for cap in (1, 26, 64, 538):
        r = ByteRows(72, capacity=cap)
        assert r.buf.shape[0] % ROW_QUANTUM == 0 and r.buf.shape[0] >= cap
        r.append(torch.zeros(cap + 5, 72, dtype=torch.uint8))
        assert r.buf.shape[0] % ROW_QUANTUM == 0 and r.n == cap + 5 and r.allocated == r.buf.numel()
