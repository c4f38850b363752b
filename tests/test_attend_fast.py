"""The compiled sparse attention (cedlm/kernels/csrc/attend.h) against the readable `attend`
(cedlm/model/attention.py, dense=False): one softmax over [window || selected entries || sink].
Same math, another summation order and the C library's exp: the outputs agree to float32
rounding (rtol 1e-5, atol 1e-6 on outputs of size ~1)."""
import pytest
import torch

from cedlm.kernels import attention as kernels_attention
from cedlm.kernels import gate
from cedlm.model.attention import attend

pytestmark = pytest.mark.skipif(gate.ext_op("attend_sparse") is None,
                                reason="compiled extension not built")


def _case(B, T, H, hd, W, k, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, hd, generator=g)
    win = torch.randn(B, W, hd, generator=g)
    wv = torch.rand(B, T, W, generator=g) > 0.3
    comp = torch.randn(B, T, k, hd, generator=g) if k else None
    cv = (torch.rand(B, T, k, generator=g) > 0.2) if k else None
    sink = torch.randn(H, generator=g)
    return q, win, wv, comp, cv, sink


@pytest.mark.parametrize("B,T,H,hd,W,k", [(1, 1, 4, 128, 64, 16), (3, 1, 4, 128, 64, 0),
                                         (2, 5, 2, 32, 16, 7), (8, 1, 4, 64, 32, 64)])
def test_fast_attend_matches_reference(B, T, H, hd, W, k):
    args = _case(B, T, H, hd, W, k, seed=B * 100 + k)
    assert kernels_attention.available(args[0], args[1], args[3], args[5])
    got = attend(*args, hd ** -0.5, dense=False)
    with gate.reference_kernels_forced():
        ref = attend(*args, hd ** -0.5, dense=False)
    assert got.shape == ref.shape and got.dtype == ref.dtype == torch.float32
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6), (got - ref).abs().max().item()


def test_nothing_visible_but_the_sink_gives_zero():
    q, win, wv, comp, cv, sink = _case(1, 2, 2, 32, 8, 4, seed=3)
    wv[:], cv[:] = False, False
    got = attend(q, win, wv, comp, cv, sink, 0.1, dense=False)
    with gate.reference_kernels_forced():
        ref = attend(q, win, wv, comp, cv, sink, 0.1, dense=False)
    assert torch.equal(got, torch.zeros_like(got)) and torch.equal(ref, torch.zeros_like(ref))


def test_dense_probes_and_autograd_take_the_reference_path():
    q, win, wv, comp, cv, sink = _case(1, 1, 2, 32, 8, 4, seed=4)
    assert not kernels_attention.available(q.requires_grad_(True), win, comp, sink)
    assert not kernels_attention.available(q.detach().bfloat16(), win, comp, sink)
    out = attend(q, win, wv, comp, cv, sink, 0.1, dense=False)
    out.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0
