"""Single mechanisms pinned to their definitions: Sinkhorn, Engram hashing, RoPE/YaRN, pool."""
import numpy as np
import pytest
import torch

from cedlm import ModelConfig
from cedlm.config.engram_sizes import engram_table_rows
from cedlm.model.engram import EngramHasher
from cedlm.text.engram_map import legacy_v0_map, legacy_v0_normalize as normalize_token_text
from cedlm.model.indexer import candidate_pool, stable_topk
from cedlm.model.mhc import collapse, expand, hc_mixes, init_hc, sinkhorn
from cedlm.model.rope import Rope, rope_frequencies, yarn_correction_range


def test_sinkhorn_is_doubly_stochastic():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(5, 4, 4, generator=g).softmax(-1) + 1e-6
    s = sinkhorn(m, 20, 1e-6)
    assert torch.allclose(s.sum(-2), torch.ones(5, 4), atol=1e-6)     # columns: the last step
    row_err = (s.sum(-1) - 1).abs().max().item()
    assert row_err < 1e-2
    # the alternating projection converges: more iterations, rows closer to 1
    # down to its fixed point |row - 1| ~ eps (1e-6 in each denominator) plus the rounding of four
    # fp32 quotients and their sum (< 4 ulps of 1.0 in any summation order, i.e. on any CPU)
    err200 = (sinkhorn(m, 200, 1e-6).sum(-1) - 1).abs().max().item()
    assert err200 <= min(row_err, 1e-4) + 4 * 2.0 ** -23 and err200 <= 1e-6 + 4 * 2.0 ** -23
    assert (s > 0).all()


def test_hc_mixes_shapes_and_ranges():
    n, D = 4, 8
    fn, base, scale = init_hc(n, D)
    x = torch.randn(2, 3, n, D)
    pre, post, comb = hc_mixes(x, fn, base, scale, 1e-20, 1e-6, 20)
    assert pre.shape == (2, 3, n) and post.shape == (2, 3, n) and comb.shape == (2, 3, n, n)
    assert ((pre > 0) & (pre < 1 + 1e-5)).all() and ((post > 0) & (post < 2)).all()
    assert torch.allclose(comb.sum(-2), torch.ones(2, 3, n), atol=1e-5)
    f = torch.randn(2, 3, D)
    y = expand(x, f, post, comb)
    want = torch.einsum("btij,btid->btjd", comb, x) + post[..., None] * f[..., None, :]
    assert torch.allclose(y, want, atol=1e-6)
    assert torch.allclose(collapse(x, pre), (pre[..., None] * x).sum(-2), atol=1e-6)


def test_engram_rows_reproduce_official_table_sizes():
    assert engram_table_rows([1, 14], 16_000_000, 4, 8) == [384006168, 384016682]
    cfg = ModelConfig.preset("deepseek-v4.1-flash")
    assert cfg.engram_num_embeddings == [384006168, 384016682]


def test_engram_hash_matches_definition():
    cfg = ModelConfig.preset("tiny")
    layer = cfg.engram_layer_ids[0]
    h = EngramHasher(cfg, layer)
    again = EngramHasher(cfg, layer)
    assert torch.equal(h.mult, again.mult)                                 # deterministic
    rng = np.random.default_rng(10007 * layer)
    half = (np.iinfo(np.int64).max // cfg.engram_compressed_vocab_size) // 2
    mult = [int(v) * 2 + 1 for v in rng.integers(0, half, size=cfg.engram_max_ngram_size)]
    assert h.mult.tolist() == mult
    pad = cfg.engram_pad_token_id
    seq = [5, 17, 300, 5, 17]
    hist = cfg.engram_max_ngram_size - 1
    cids = torch.tensor([[pad] * hist + seq])
    rows = h.rows(cids, hist)                                               # [1, T, buckets]
    primes = h.primes.tolist()
    offsets = [0]
    for p in primes[:-1]:
        offsets.append(offsets[-1] + p)
    full = [pad] * hist + seq
    for t in range(len(seq)):
        j = 0
        for n in range(2, cfg.engram_max_ngram_size + 1):
            mix = 0
            for k in range(n):                     # multiplicative-XOR over the n-gram ending at t
                mix ^= full[hist + t - k] * mult[k]
            for _head in range(cfg.engram_n_heads):
                assert rows[0, t, j].item() == mix % primes[j] + offsets[j]
                j += 1
    assert rows.max() < sum(primes) and rows.min() >= 0
    assert sum(primes) == cfg.engram_num_embeddings[0]


def test_engram_token_normalisation():          # the legacy-v0 map (tests/test_engram_map.py: v41)
    assert normalize_token_text("Café") == "cafe"
    assert normalize_token_text("ＡＢＣ") == "abc"
    assert normalize_token_text("  hello\t\nworld ") == "hello world"
    tmap, n = legacy_v0_map(["The", "the", " THE", "é", "e", "x"])
    assert tmap[0] == tmap[1] == tmap[2] and tmap[3] == tmap[4] and n == 3
    assert normalize_token_text(" ") == " "          # a lone space keeps its identity


def test_yarn_correction_range_official():
    # port test: rope dim 64, theta 160000, beta 32/1, original 65536 -> dims [15, 25]
    assert yarn_correction_range(64, 160000, 32, 1, 65536) == (15, 25)
    f = rope_frequencies(64, 160000, {"factor": 16, "beta_fast": 32, "beta_slow": 1,
                                      "original_max_position_embeddings": 65536})
    base = rope_frequencies(64, 160000, None)
    assert torch.allclose(f[:15], base[:15]) and torch.allclose(f[26:], base[26:] / 16)


def test_rope_interleaved_last_dims_and_inverse():
    r = Rope(8, 10000.0, None)
    x = torch.randn(3, 2, 16)                       # [T, heads, dim]
    pos = torch.tensor([0, 5, 100]).unsqueeze(-1)
    y = r.apply(x, pos)
    assert torch.equal(y[..., :8], x[..., :8])      # nope dims untouched
    assert torch.allclose(r.apply(y, pos, inverse=True), x, atol=1e-5)
    # pair (8, 9) rotates by pos * freq[0] = pos radians
    a, b = x[1, 0, 8], x[1, 0, 9]
    c, s = np.cos(5.0), np.sin(5.0)
    assert y[1, 0, 8].item() == pytest.approx((a * c - b * s).item(), abs=1e-5)
    assert y[1, 0, 9].item() == pytest.approx((a * s + b * c).item(), abs=1e-5)
    # relative: <rope(q, m), rope(k, n)> depends on m - n only
    q, k = torch.randn(16), torch.randn(16)
    d1 = (r.apply(q, torch.tensor(7)) * r.apply(k, torch.tensor(3))).sum()
    d2 = (r.apply(q, torch.tensor(104)) * r.apply(k, torch.tensor(100))).sum()
    assert d1.item() == pytest.approx(d2.item(), abs=1e-4)


def test_candidate_pool_keeps_newest_and_top_blocks():
    inf = float("-inf")
    score = torch.tensor([[[5.0, 1.0, 0.0, 0.5, 9.0, 2.0, 0.1, inf, inf]]])   # 7 visible
    pool = candidate_pool(score, torch.tensor([[7]]), block=2, topk_blocks=2)
    # blocks: [5,1] [0,.5] [9,2] [.1] (newest, forced) -> keep newest + block with 9
    visible = score > inf                       # consumers also mask to the causal range
    assert (pool & visible)[0, 0].tolist() == [False, False, False, False, True, True, True, False, False]
    pool3 = candidate_pool(score, torch.tensor([[7]]), block=2, topk_blocks=3)
    assert pool3[0, 0, :2].tolist() == [True, True]


def test_stable_topk_prefers_newest_among_ties_independent_of_length():
    s1 = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0])
    s2 = torch.cat((s1, torch.full((7,), float("-inf"))))
    i1, _ = stable_topk(s1, 3)
    i2, _ = stable_topk(s2, 3)
    assert i1.tolist() == i2.tolist() == [4, 0, 3]
