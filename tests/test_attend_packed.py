"""Attention read straight from the KV cache's bytes (cedlm/kernels/csrc/attend_packed.h): the
selected FP4 entries and the FP8 window decoded tile by tile inside the attention loop, against
`attend_sparse` and the readable `attend` (cedlm/model/attention.py) over the same keys decoded by
the codec. Same math; the running-max softmax and another division order: the outputs agree to
float32 rounding: rtol 1e-5 and atol 3e-6 x the largest |output| (measured: <= 1.3e-6 x, and
attend_sparse against the same reference: <= 1.5e-6 x).
The cache side (`ByteKVCache.selected_kv` / `window_keys`, contiguous and paged rows) must give
keys that decode to exactly what `gather_kv` / `window` return."""
import pytest
import torch

from cedlm.cache.block_pool import BlockPool, BlockTable
from cedlm.config import ModelConfig
from cedlm.kernels import attention as ka
from cedlm.kernels import decode, encode, gate
from cedlm.kernels.attention import PackedKeys
from cedlm.kv_layout import KVLayout
from cedlm.model.attention import attend
from cedlm.model.kv_cache import ByteKVCache
from cedlm.model.state import SequenceState

pytestmark = pytest.mark.skipif(gate.ext_op("attend_packed") is None,
                                reason="compiled extension not built (or reference kernels forced)")
RTOL, ATOL = 1e-5, 3e-6          # ATOL is a share of the case's largest |output|


def _case(B, T, H, hd, W, k, R, seed, win_packed=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, hd, generator=g)
    if win_packed:
        win = PackedKeys(encode(torch.randn(B * W, hd, generator=g), "window_fp8"),
                         torch.randperm(B * W, generator=g).view(B, W), "window_fp8", hd)
    else:
        win = torch.randn(B, W, hd, generator=g)
    comp = PackedKeys(encode(torch.randn(R, hd, generator=g) * 3, "kv_fp4"),
                      torch.randint(0, R, (B, T, k), generator=g), "kv_fp4", hd) if k else None
    wv = torch.rand(B, T, W, generator=g) > 0.3
    cv = (torch.rand(B, T, k, generator=g) > 0.2) if k else None
    return q, win, wv, comp, cv, torch.randn(H, generator=g)


@pytest.mark.parametrize("B,T,H,hd,W,k", [(1, 1, 4, 128, 64, 64), (3, 1, 4, 128, 64, 0),
                                         (2, 5, 2, 32, 16, 7), (8, 1, 4, 128, 64, 64),
                                         (1, 1, 4, 128, 64, 2048), (2, 2, 6, 64, 32, 33)])
@pytest.mark.parametrize("win_packed", [True, False])
def test_packed_attend_matches_decoded(B, T, H, hd, W, k, win_packed):
    q, win, wv, comp, cv, sink = _case(B, T, H, hd, W, k, R=3 * k + 5, seed=B * 100 + k,
                                       win_packed=win_packed)
    got = ka.attend_packed(q, win, wv, comp, cv, sink, hd ** -0.5)
    assert got is not None and got.shape == q.shape and got.dtype == torch.float32
    dwin, dcomp = ka.unpacked(win), ka.unpacked(comp)
    fast = ka.attend_sparse(q, dwin, wv, dcomp, cv, sink, hd ** -0.5)
    with gate.reference_kernels_forced():
        ref = attend(q, dwin, wv, dcomp, cv, sink, hd ** -0.5, dense=False)
    atol = ATOL * float(ref.abs().max())
    assert torch.allclose(got, fast, rtol=RTOL, atol=atol), (got - fast).abs().max().item()
    assert torch.allclose(got, ref, rtol=RTOL, atol=atol), (got - ref).abs().max().item()
    # the model's `attend` takes packed keys itself (its reference decodes them); float32 keys
    # alone go to attend_sparse
    packed = win_packed or comp is not None
    assert torch.equal(attend(q, win, wv, comp, cv, sink, hd ** -0.5, dense=False),
                       got if packed else fast)
    with gate.reference_kernels_forced():
        assert torch.equal(attend(q, win, wv, comp, cv, sink, hd ** -0.5, dense=False), ref)


def test_rows_of_a_block_equal_each_row_alone():
    """Several query rows decode their sequence's window once and share it: each row's output is
    bit for bit the one it gets called alone (decoded for itself); a window slot no row sees is
    never read, even when its index is out of range."""
    q, win, wv, comp, cv, sink = _case(2, 6, 4, 128, 64, 64, R=200, seed=11)
    wv[:, :, 5] = False
    win = PackedKeys(win.rows, win.index.clone(), win.fmt, win.dim)
    win.index[:, 5] = 10 ** 6
    got = ka.attend_packed(q, win, wv, comp, cv, sink, 128 ** -0.5)
    for t in range(q.shape[1]):
        one = PackedKeys(comp.rows, comp.index[:, t:t + 1].contiguous(), comp.fmt, comp.dim)
        alone = ka.attend_packed(q[:, t:t + 1].contiguous(), win, wv[:, t:t + 1].contiguous(),
                                 one, cv[:, t:t + 1].contiguous(), sink, 128 ** -0.5)
        assert torch.equal(got[:, t:t + 1], alone), t


def test_decoded_keys_are_the_codecs():
    _, win, _, comp, _, _ = _case(2, 3, 4, 128, 16, 8, R=40, seed=7)
    assert torch.equal(comp.decoded(), decode(comp.rows[comp.index], "kv_fp4", 128))
    assert torch.equal(win.decoded(), decode(win.rows, "window_fp8", 128)[win.index])


def test_nothing_visible_but_the_sink_gives_zero():
    q, win, wv, comp, cv, sink = _case(1, 2, 2, 32, 8, 4, R=9, seed=3)
    wv[:], cv[:] = False, False
    assert torch.equal(ka.attend_packed(q, win, wv, comp, cv, sink, 0.1), torch.zeros_like(q))


def test_an_out_of_range_row_is_an_error_and_an_invalid_one_is_never_read():
    q, win, wv, comp, cv, sink = _case(1, 1, 4, 128, 8, 4, R=9, seed=5)
    cv[:] = True
    bad = PackedKeys(comp.rows, comp.index.clone().fill_(9), "kv_fp4", 128)
    with pytest.raises(RuntimeError, match="comp_idx index 9 outside"):
        ka.attend_packed(q, win, wv, bad, cv, sink, 0.1)
    cv[:] = False
    assert ka.attend_packed(q, win, wv, bad, cv, sink, 0.1) is not None


def test_autograd_and_the_reference_switch_take_the_reference_path():
    q, win, wv, comp, cv, sink = _case(1, 1, 2, 32, 8, 4, R=9, seed=4)
    assert ka.attend_packed(q.clone().requires_grad_(True), win, wv, comp, cv, sink, 0.1) is None
    with gate.reference_kernels_forced():
        assert ka.attend_packed(q, win, wv, comp, cv, sink, 0.1) is None


# ---------------------------------------------------------------- the cache gives packed keys
def _layout():
    return KVLayout.from_config(ModelConfig.preset("tiny"))


def _fill(layout, states, lengths, seed):
    """Entries of every kv source and window rows up to each sequence's length."""
    g = torch.Generator().manual_seed(seed)
    for st, n in zip(states, lengths):
        for spec in layout.rows_of("kv"):
            st.kv[spec.layer].append(encode(torch.randn(n // spec.ratio, spec.dim, generator=g),
                                            spec.fmt))
        if n:
            kv = torch.randn(1, n, layout.window_dim, generator=g)
            ByteKVCache(layout, [st]).window(0, kv, torch.arange(n).unsqueeze(0))


@pytest.mark.parametrize("paged", [False, True])
def test_selected_kv_decodes_to_gather_kv(paged):
    layout = _layout()
    lengths = [40, 0, 17]
    if paged:
        pool = BlockPool(layout, 64, 8)
        states = [SequenceState(layout, rows=pool.rows(BlockTable(pool))) for _ in lengths]
    else:
        states = [SequenceState(layout) for _ in lengths]
    _fill(layout, states, lengths, seed=1)
    cache = ByteKVCache(layout, states)
    g = torch.Generator().manual_seed(2)
    for spec in layout.rows_of("kv"):
        idx = torch.randint(0, 40, (len(lengths), 3, 6), generator=g)
        got = cache.selected_kv(spec.layer, idx)
        assert isinstance(got, PackedKeys)
        n = torch.tensor([st.kv[spec.layer].n for st in states]).view(-1, 1, 1)
        ok = idx < n                                          # rows past a sequence's entries
        dec, ref = got.decoded(), cache.gather_kv(spec.layer, idx)
        assert torch.equal(dec[ok], ref[ok])
        if paged:                                             # the pool read in place
            assert got.rows.data_ptr() == pool.data[spec.key].data_ptr()
        with gate.reference_kernels_forced():
            assert torch.equal(cache.selected_kv(spec.layer, idx), ref)


def test_window_keys_hold_the_window_rows():
    layout = _layout()
    lengths = [0, 3, layout.window_slots + 5]
    a, b = [SequenceState(layout) for _ in lengths], [SequenceState(layout) for _ in lengths]
    _fill(layout, a, lengths, seed=3)
    _fill(layout, b, lengths, seed=3)
    kv = torch.randn(len(lengths), 1, layout.window_dim)
    kv = decode(encode(kv, layout.window_fmt), layout.window_fmt, layout.window_dim)  # stored
    pos = torch.tensor(lengths).unsqueeze(1)
    keys, kpos = ByteKVCache(layout, a).window_keys(0, kv, pos)
    ref, rpos = ByteKVCache(layout, b).window(0, kv, pos)
    assert isinstance(keys, PackedKeys)
    dec = keys.decoded()
    for i, n in enumerate(lengths):    # the same (position, key) pairs inside the window, any order
        first = n - layout.window_slots          # the attention's mask: first < position <= n
        mine = {int(p): dec[i, j] for j, p in enumerate(kpos[i]) if first < p <= n}
        theirs = {int(p): ref[i, j] for j, p in enumerate(rpos[i]) if first < p <= n}
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[p], theirs[p]) for p in mine)
    for x, y in zip(a, b):                         # and the rings are written alike
        assert torch.equal(x.window[0], y.window[0]) and torch.equal(x.window_pos[0], y.window_pos[0])


# ---------------------------------------------------------------- the torch custom op
def test_custom_op_agrees_and_traces_without_a_graph_break():
    ops = pytest.importorskip("cedlm.kernels.ops")
    q, win, wv, comp, cv, sink = _case(2, 1, 4, 128, 16, 8, R=40, seed=11)
    args = (q, win.rows, win.index, wv, "window_fp8", comp.rows, comp.index, cv, "kv_fp4", sink,
            128 ** -0.5)
    want = ka.attend_packed(q, win, wv, comp, cv, sink, 128 ** -0.5)
    assert torch.equal(torch.ops.cedlm.attend_packed(*args), want)
    torch.library.opcheck(torch.ops.cedlm.attend_packed.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    f = torch.compile(lambda *a: torch.ops.cedlm.attend_packed(*a) * 1.0, fullgraph=True,
                      backend="eager")
    assert torch.equal(f(*args), want)
    with gate.reference_kernels_forced():            # the op's own torch fallback
        ref = torch.ops.cedlm.attend_packed(*args)
    assert torch.allclose(ref, want, rtol=RTOL, atol=ATOL * float(ref.abs().max()))
