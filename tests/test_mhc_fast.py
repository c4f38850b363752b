"""The compiled mHC mixes (cedlm/kernels/csrc/mhc.h) against the readable torch path (mhc.py)."""
from __future__ import annotations

import pytest
import torch

from cedlm.kernels import gate
from cedlm.kernels import mhc as kernels_mhc
from cedlm.model import mhc

needs_ext = pytest.mark.skipif(gate.ext_op("mhc_mixes") is None,
                               reason="compiled extension not built (./setup.sh builds it)")


def _case(seed: int, n: int = 4, D: int = 64, lead=(3, 5)):
    g = torch.Generator().manual_seed(seed)
    fn, base, scale = mhc.init_hc(n, D)
    fn = fn * 40 + torch.randn(fn.shape, generator=g) * 0.05      # far from the identity init
    base = base + torch.randn(base.shape, generator=g)
    scale = scale + torch.rand(3, generator=g)
    x = torch.randn(*lead, n, D, generator=g)
    return x, fn, base, scale


@needs_ext
@pytest.mark.parametrize("seed,n", [(0, 4), (1, 4), (2, 2), (3, 1)])
def test_fast_mixes_match_reference(seed, n):
    x, fn, base, scale = _case(seed, n)
    with torch.no_grad():
        got = mhc.hc_mixes(x, fn, base, scale, 1e-6, 1e-6, 20)
        with gate.reference_kernels_forced():
            ref = mhc.hc_mixes(x, fn, base, scale, 1e-6, 1e-6, 20)
    for name, a, b in zip(("pre", "post", "comb"), got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float32, name
        # same float32 operations in the same order; only exp may differ in the last bit
        assert torch.allclose(a, b, rtol=4e-7, atol=1e-7), (name, (a - b).abs().max().item())
    comb = got[2]                                       # the last normalisation is per column
    assert torch.allclose(comb.sum(-2), torch.ones_like(comb.sum(-2)), atol=1e-5)


@needs_ext
def test_kernel_rows_are_independent_of_the_batch():
    """The compiled kernel computes each row alone: a row's mixes do not depend on how many rows
    share the call (the projection before it is torch's matmul, as on the reference path)."""
    op = gate.ext_op("mhc_mixes")
    _, _, base, scale = _case(4)
    m = torch.randn(15, base.numel(), generator=torch.Generator().manual_seed(9)) * 3
    full = op(m, base, scale, 1e-6, 20)
    one = op(m[7:8].contiguous(), base, scale, 1e-6, 20)
    for a, b in zip(full, one):
        assert torch.equal(a[7:8], b)


def test_training_and_the_reference_switch_use_the_torch_path(monkeypatch):
    calls = []
    monkeypatch.setattr(gate, "ext_op", lambda name: calls.append(name) or None)
    x, fn, base, scale = _case(5)
    fn.requires_grad_(True)
    pre, post, comb = mhc.hc_mixes(x, fn, base, scale, 1e-6, 1e-6, 20)
    (pre.sum() + post.sum() + comb.sum()).backward()
    assert fn.grad is not None and calls == []              # autograd: never the compiled op
    with torch.no_grad():
        mhc.hc_mixes(x, fn, base, scale, 1e-6, 1e-6, 20)
    assert calls == ["mhc_mixes"]                            # inference asks for it
    monkeypatch.undo()
    with gate.reference_kernels_forced():
        assert gate.ext_op("mhc_mixes") is None


@needs_ext
@pytest.mark.parametrize("n,lead", [(4, (1, 1)), (4, (3, 5)), (2, (2, 7)), (1, (1, 3))])
def test_fast_collapse_and_expand_match_reference(n, lead):
    """The compiled collapse / expand (mhc.h) against the einsums of mhc.py: the same products,
    summed over the n copies in index order, so float32 rounding apart (a few ulp)."""
    g = torch.Generator().manual_seed(n + lead[1])
    D = 64
    x = torch.randn(*lead, n, D, generator=g)
    pre = torch.rand(*lead, n, generator=g)
    f = torch.randn(*lead, D, generator=g)
    post = torch.rand(*lead, n, generator=g) * 2
    comb = torch.rand(*lead, n, n, generator=g)
    assert kernels_mhc.collapse(x, pre) is not None
    got = mhc.collapse(x, pre), mhc.expand(x, f, post, comb)
    with gate.reference_kernels_forced():
        assert kernels_mhc.collapse(x, pre) is None
        ref = mhc.collapse(x, pre), mhc.expand(x, f, post, comb)
    for a, b in zip(got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), (a - b).abs().max().item()
    xg = x.clone().requires_grad_(True)                     # autograd: the einsum path
    assert kernels_mhc.expand(xg, f, post, comb) is None
    assert kernels_mhc.collapse(x.bfloat16(), pre) is None
