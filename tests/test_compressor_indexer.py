"""Compressor pending carry (cedlm/model/compressor.py) and the indexer's scoring and selection
rules (cedlm/model/indexer.py). Model-free: one Compressor module on the tiny preset, and the
indexer's static functions on hand-made tensors."""
import dataclasses

import pytest
import torch

from cedlm.config import ModelConfig
from cedlm.model.compressor import Compressor
from cedlm.model.indexer import (Indexer, candidate_entries, candidate_pool, stable_topk,
                                 topk_entries)

NEG = float("-inf")


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return ModelConfig.preset("tiny")


def exact_compressor(cfg: ModelConfig, layer: int, seed: int = 0) -> Compressor:
    """A compressor whose projections are exact in fp32 (weights in 1/8 steps; inputs in 1/4
    steps), so any difference between chunkings is a carry bug, not matmul rounding."""
    torch.manual_seed(seed)
    c = Compressor(cfg, layer)
    with torch.no_grad():
        for lin in (c.wkv, c.wgate):
            if lin is not None:
                lin.weight.copy_(torch.randint(-4, 5, lin.weight.shape) / 8)
    return c.eval()


def exact_rows(T: int, D: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, (T, D), generator=g) / 4


def feed(c: Compressor, x: torch.Tensor, chunks, first_pos: int = 0, pending=None):
    """Feed x in chunks of the given sizes; returns (latents, starts, final pending, pendings
    after each chunk)."""
    lats, starts, seen, p = [], [], [], first_pos
    with torch.no_grad():
        for k in chunks:
            lat, st, pending = c.forward_rows(x[p - first_pos: p - first_pos + k], p, pending)
            lats.append(lat)
            starts.append(st)
            p += k
            seen.append((p, pending))
    return torch.cat(lats), torch.cat(starts), pending, seen


CHUNKINGS = [
    [1] * 23,
    [3, 1, 5, 2, 7, 5],
    [2, 2, 2, 17],
    [5, 0, 1, 17],                                       # an empty pass in between
]


def ratio4(cfg: ModelConfig) -> ModelConfig:
    r = list(cfg.compress_ratios)
    r[2:4] = [4, 4]
    return dataclasses.replace(cfg, compress_ratios=r)


# ------------------------------------------------------------------------------------------------
# compressor


def test_tiny_ratios(tiny):
    assert Compressor(tiny, 2).ratio == 2
    assert Compressor(tiny, 6).ratio == 1


@pytest.mark.parametrize("chunks", CHUNKINGS)
@pytest.mark.parametrize("use_r4", [False, True], ids=["r2", "r4"])
def test_chunked_feed_equals_one_pass(tiny, chunks, use_r4):
    cfg = ratio4(tiny) if use_r4 else tiny
    c = exact_compressor(cfg, 2)
    r = c.ratio
    assert r == (4 if use_r4 else 2)
    T = sum(chunks)
    x = exact_rows(T, cfg.hidden_size)
    with torch.no_grad():
        full_lat, full_st, full_pend = c.forward_rows(x, 0, None)
    assert full_lat.shape == (T // r, cfg.head_dim)
    assert full_st.tolist() == list(range(0, T // r * r, r))
    lat, st, pend, seen = feed(c, x, chunks)
    assert torch.equal(st, full_st)
    assert torch.equal(lat, full_lat)                    # bitwise: the carry is exact
    assert torch.equal(pend[0], full_pend[0]) and torch.equal(pend[1], full_pend[1])
    for p, (pk, pg) in seen:                             # pending = the rows of the open group
        assert pk.shape == pg.shape == (p % r, cfg.head_dim)
        if p % r:
            kv, gate = c.project(x[p - p % r: p])
            assert torch.equal(pk, kv) and torch.equal(pg, gate)


def test_chunked_feed_random_weights_close(tiny):
    """With ordinary random weights the chunked result matches up to fp32 matmul rounding
    (CPU BLAS may sum a 1-row product in another order than a many-row one)."""
    torch.manual_seed(0)
    c = Compressor(tiny, 2).eval()
    x = torch.randn(23, tiny.hidden_size)
    with torch.no_grad():
        full_lat, full_st, _ = c.forward_rows(x, 0, None)
    lat, st, _, _ = feed(c, x, [1, 1, 3, 2, 5, 4, 7])
    assert torch.equal(st, full_st)
    assert torch.allclose(lat, full_lat, rtol=1e-5, atol=1e-5), (lat - full_lat).abs().max()


def test_group_starts_from_a_later_first_position(tiny):
    c = exact_compressor(tiny, 2)
    x = exact_rows(12, tiny.hidden_size)
    with torch.no_grad():
        _, st0, pend = c.forward_rows(x[:1], 100, None)
        lat, st, pend2 = c.forward_rows(x[1:6], 101, pend)  # the group at 100 completes
    assert st0.tolist() == [] and pend[0].shape[0] == 1
    assert st.tolist() == [100, 102, 104] and pend2[0].shape[0] == 0
    lat_a, st_a, _, _ = feed(c, x, [1, 4, 3, 4], first_pos=100)
    with torch.no_grad():
        lat_b, st_b, _ = c.forward_rows(x, 100, None)
    assert st_a.tolist() == st_b.tolist() == list(range(100, 112, 2))
    assert torch.equal(lat_a, lat_b)


def test_group_is_pooled_over_its_own_rows(tiny):
    """Entry g is a function of rows g*r .. g*r+r-1 only: the carried group equals the group
    computed alone."""
    c = exact_compressor(tiny, 2)
    x = exact_rows(9, tiny.hidden_size)
    with torch.no_grad():
        full, _, _ = c.forward_rows(x, 0, None)
        for g in range(4):
            alone, st, _ = c.forward_rows(x[2 * g: 2 * g + 2], 2 * g, None)
            assert st.tolist() == [2 * g]
            assert torch.equal(alone[0], full[g])
        kv, gate = c.project(x[:2])
        w = gate.softmax(0)
        assert torch.allclose(full[0], c.norm((kv * w).sum(0)), rtol=1e-5, atol=1e-6)


def test_mismatched_pending_phase_fails(tiny):
    c = exact_compressor(tiny, 2)
    x = exact_rows(6, tiny.hidden_size)
    with torch.no_grad():
        _, _, pend1 = c.forward_rows(x[:3], 0, None)     # 1 row pending
        _, _, pend0 = c.forward_rows(x[:4], 0, None)     # none pending
        with pytest.raises(AssertionError, match="phase"):
            c.forward_rows(x[3:], 3, None)               # odd position, pending dropped
        with pytest.raises(AssertionError, match="phase"):
            c.forward_rows(x[3:], 4, pend1)              # even position, a stale row carried
        with pytest.raises(AssertionError, match="phase"):
            c.forward_rows(x[3:], 3, pend0)
        c.forward_rows(x[3:], 3, pend1)                  # the right phase is accepted


def test_ratio_one_emits_one_latent_per_row(tiny):
    torch.manual_seed(0)
    c = Compressor(tiny, 6).eval()
    assert c.wgate is None
    x = exact_rows(7, tiny.hidden_size)
    with torch.no_grad():
        lat, st, pend = c.forward_rows(x, 5, None)
        assert pend is None
        assert lat.shape == (7, tiny.head_dim)
        assert st.tolist() == list(range(5, 12))
        assert torch.allclose(lat, c.norm(x @ c.wkv.weight.t()), rtol=1e-5, atol=1e-6)
        lat2, st2, pend2 = c.forward_rows(x[:1], 9, None)   # any position, no carry
        assert pend2 is None and st2.tolist() == [9]


# ------------------------------------------------------------------------------------------------
# indexer score


def test_score_equals_loop_over_heads():
    g = torch.Generator().manual_seed(0)
    B, T, h, d, N = 2, 3, 4, 8, 6
    q = torch.randn(B, T, h, d, generator=g)
    w = torch.randn(B, T, h, generator=g)
    keys = torch.randn(B, N, d, generator=g)
    visible = torch.rand(B, T, N, generator=g) > 0.3
    s = Indexer.score(q, w, keys, visible)
    assert s.shape == (B, T, N)
    for b in range(B):
        for t in range(T):
            for n in range(N):
                if not visible[b, t, n]:
                    assert s[b, t, n].item() == NEG
                    continue
                want = sum(w[b, t, j].item() * max(0.0, torch.dot(q[b, t, j], keys[b, n]).item())
                           for j in range(h))
                assert s[b, t, n].item() == pytest.approx(want, rel=1e-5, abs=1e-5)
    # ReLU per head, before the weighted sum: a head with negative q.k contributes nothing
    q1 = torch.zeros(1, 1, 2, 2)
    q1[0, 0, 0] = torch.tensor([1.0, 0.0])
    q1[0, 0, 1] = torch.tensor([-1.0, 0.0])
    k1 = torch.tensor([[[3.0, 0.0]]])
    w1 = torch.tensor([[[2.0, 5.0]]])
    assert Indexer.score(q1, w1, k1, torch.ones(1, 1, 1, dtype=torch.bool)).item() == 6.0


# ------------------------------------------------------------------------------------------------
# top-k tie rule


def ref_topk(vals: list[float], k: int) -> list[int]:
    """Best first; equal values: the higher (newer) index first."""
    return sorted(range(len(vals)), key=lambda i: (-vals[i], -i))[:k]


def test_stable_topk_ties_toward_newest():
    s = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0])
    ids, vals = stable_topk(s, 1)
    assert ids.tolist() == [3] and vals.tolist() == [1.0]
    ids, vals = stable_topk(s, 3)
    assert ids.tolist() == [3, 0, 4] and vals.tolist() == [1.0, 1.0, 0.0]
    ids, _ = stable_topk(torch.zeros(40), 5)            # all tied (ReLU'd zeros)
    assert ids.tolist() == [39, 38, 37, 36, 35]


@pytest.mark.parametrize("seed", range(5))
def test_stable_topk_matches_reference_and_is_length_independent(seed):
    g = torch.Generator().manual_seed(seed)
    N, k = 37, 9
    s = torch.randint(0, 4, (3, N), generator=g).float()      # heavy ties
    ids, vals = stable_topk(s, k)
    for row in range(3):
        assert ids[row].tolist() == ref_topk(s[row].tolist(), k)
        assert torch.equal(vals[row], s[row, ids[row]])
    # the same scores with more entries after them (invisible, or worse than every original)
    for tail in (torch.full((3, 50), NEG), torch.full((3, 1), -1.0), torch.full((3, 200), -5.0)):
        ids2, vals2 = stable_topk(torch.cat((s, tail), -1), k)
        assert torch.equal(ids2, ids) and torch.equal(vals2, vals)
    # and every prefix-length view agrees with the reference (decode sees growing N)
    for n in range(1, N + 1):
        got = stable_topk(s[0, :n], min(k, n))[0].tolist()
        assert got == ref_topk(s[0, :n].tolist(), min(k, n))


def test_topk_entries_marks_invisible_picks_invalid():
    s = torch.tensor([[[NEG, 0.5, NEG, 0.0, NEG, NEG]]])
    ids, valid = topk_entries(s, 4)
    assert ids.shape == valid.shape == (1, 1, 4)
    assert ids[0, 0, :2].tolist() == [1, 3]
    assert valid[0, 0].tolist() == [True, True, False, False]
    picked_invalid = ids[0, 0, 2:].tolist()
    assert all(s[0, 0, i] == NEG for i in picked_invalid)
    # fewer entries than k: k shrinks to N
    ids, valid = topk_entries(torch.tensor([[[0.0, 0.0]]]), 5)
    assert ids[0, 0].tolist() == [1, 0] and valid.all()
    # nothing visible: all invalid
    _, valid = topk_entries(torch.full((2, 3, 4), NEG), 2)
    assert not valid.any()


def test_topk_entries_ties_toward_newest_and_extension_invariant():
    g = torch.Generator().manual_seed(7)
    s = torch.randint(0, 3, (2, 4, 20), generator=g).float()
    ids, valid = topk_entries(s, 6)
    ids2, valid2 = topk_entries(torch.cat((s, torch.full((2, 4, 30), NEG)), -1), 6)
    assert torch.equal(ids, ids2) and torch.equal(valid, valid2) and valid.all()
    for b in range(2):
        for t in range(4):
            assert ids[b, t].tolist() == ref_topk(s[b, t].tolist(), 6)


# ------------------------------------------------------------------------------------------------
# candidate pool


def ref_pool_blocks(scores: list[float], n_visible: int, block: int, topk_blocks: int) -> set[int]:
    """The newest visible block, plus the best other blocks by max score (ties: newer block)."""
    if n_visible == 0:
        return set()
    newest = (n_visible - 1) // block
    nb = -(-len(scores) // block)
    maxes = {j: max(scores[j * block: (j + 1) * block]) for j in range(nb) if j != newest}
    others = sorted((j for j in maxes if maxes[j] > NEG), key=lambda j: (-maxes[j], -j))
    return {newest, *others[: topk_blocks - 1]}


def test_candidate_pool_newest_block_always_kept():
    # newest block (entries 6-7) scores lowest of all; topk_blocks=1 keeps it alone
    s = torch.tensor([[[9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 0.0, 0.0]]])
    pool = candidate_pool(s, torch.tensor([[8]]), block=2, topk_blocks=1)
    assert pool[0, 0].tolist() == [False] * 6 + [True, True]
    pool = candidate_pool(s, torch.tensor([[8]]), block=2, topk_blocks=2)
    assert pool[0, 0].tolist() == [True, True] + [False] * 4 + [True, True]


@pytest.mark.parametrize("seed", range(4))
def test_candidate_pool_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    B, T, N, block = 2, 5, 23, 3
    raw = torch.randint(0, 5, (B, T, N), generator=g).float()     # ties between block maxima
    n_vis = torch.randint(0, N + 1, (B, T), generator=g)
    n_vis[0, 0] = 0
    n_vis[1, 0] = N
    visible = torch.arange(N) < n_vis.unsqueeze(-1)
    s = raw.masked_fill(~visible, NEG)
    for topk_blocks in (1, 2, 3, 20):
        pool = candidate_pool(s, n_vis, block, topk_blocks)
        assert pool.shape == (B, T, N) and pool.dtype == torch.bool
        for b in range(B):
            for t in range(T):
                keep = ref_pool_blocks(s[b, t].tolist(), int(n_vis[b, t]), block, topk_blocks)
                vis = int(n_vis[b, t])
                got = pool[b, t, :vis].tolist()
                assert got == [i // block in keep for i in range(vis)], (b, t, topk_blocks)
                assert not pool[b, t][[i // block not in keep for i in range(N)]].any()


@pytest.mark.parametrize("seed", range(3))
def test_candidate_entries_are_the_pool(seed):
    """The static step's Reindex scores only `candidate_entries`: ascending indices below N,
    marked exactly where the pool mask and visibility are, and the top-k over those slots,
    mapped back, is the reference's top-k over the masked scores."""
    g = torch.Generator().manual_seed(seed)
    B, T, N, block = 2, 4, 23, 3                  # N not a multiple of block: the last block is cut
    n_vis = torch.randint(0, N + 1, (B, T), generator=g)
    n_vis[1, 0] = N
    visible = torch.arange(N) < n_vis.unsqueeze(-1)
    s = torch.randint(0, 4, (B, T, N), generator=g).float().masked_fill(~visible, NEG)   # ties
    for topk_blocks in (1, 3, 20):
        pool = candidate_pool(s, n_vis, block, topk_blocks)
        at, ok = candidate_entries(s, n_vis, block, topk_blocks)
        assert at.shape == ok.shape == (B, T, min(topk_blocks, -(-N // block)) * block)
        assert (at < N).all() and (at.diff(dim=-1) >= 0).all()
        marked = torch.zeros(B, T, N).scatter_add_(-1, at, ok.float())   # a cut block's tail: N - 1 again
        assert torch.equal(marked > 0, pool & visible) and marked.max() <= 1
        for k in (1, 4):
            ref_idx, ref_ok = topk_entries(s.masked_fill(~pool, NEG), k)
            c_idx, c_ok = topk_entries(torch.gather(s, -1, at).masked_fill(~ok, NEG), k)
            c_idx = at.gather(-1, c_idx)
            for b in range(B):
                for t in range(T):
                    assert ref_idx[b, t][ref_ok[b, t]].tolist() == c_idx[b, t][c_ok[b, t]].tolist()


def test_candidate_pool_with_nothing_visible_is_empty():
    pool = candidate_pool(torch.full((1, 2, 6), NEG), torch.zeros(1, 2, dtype=torch.long), 2, 2)
    assert not pool.any()
