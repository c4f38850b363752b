"""The batched window read of `ByteKVCache.window` (fast path) against its per-sequence
reference (`SequenceState.window_before` + `_cat_padded`): identical keys and positions, and the
same ring contents after the write, for sequences whose rings are empty, partly and fully filled."""
import torch

from cedlm.config import ModelConfig
from cedlm.kv_layout import KVLayout
from cedlm.model.kv_cache import ByteKVCache
from cedlm.model.state import SequenceState
from cedlm.kernels import gate


def _states(layout, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    sts = []
    for n in lengths:
        st = SequenceState(layout)
        if n:
            kv = torch.randn(1, n, layout.window_dim, generator=g)
            ByteKVCache(layout, [st]).window(0, kv, torch.arange(n).unsqueeze(0))
        sts.append(st)
    return sts


def _clone(sts, layout):
    out = []
    for st in sts:
        c = SequenceState(layout)
        c.copy_windows_from(st)
        out.append(c)
    return out


def test_batched_window_equals_reference():
    cfg = ModelConfig.preset("tiny")
    layout = KVLayout.from_config(cfg)
    slots = layout.window_slots
    lengths = [0, 3, slots, slots + 5, 2 * slots + 1]
    base = _states(layout, lengths, 0)
    g = torch.Generator().manual_seed(1)
    for T in (1, 3):
        kv = torch.randn(len(lengths), T, layout.window_dim, generator=g)
        pos = torch.tensor([[n + t for t in range(T)] for n in lengths])
        a_st, b_st = _clone(base, layout), _clone(base, layout)
        a = ByteKVCache(layout, a_st).window(0, kv, pos)
        with gate.reference_kernels_forced():
            b = ByteKVCache(layout, b_st).window(0, kv, pos)
        assert a[0].shape == b[0].shape and torch.equal(a[1], b[1])
        assert torch.equal(a[0].view(torch.int32), b[0].view(torch.int32))
        for x, y in zip(a_st, b_st):
            assert torch.equal(x.window[0], y.window[0]) and torch.equal(x.window_pos[0], y.window_pos[0])
