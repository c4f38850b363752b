"""The compiled RoPE rotation (cedlm/kernels/csrc/rope.h) against the readable torch path of
`Rope.apply`: bit-identical on every call shape the model makes, forward and inverse, with and
without YaRN; the fallbacks (autograd, bf16, broadcasts) take the reference path."""
import pytest
import torch

from cedlm.kernels import gate
from cedlm.kernels import rope as kernels_rope
from cedlm.model.rope import Rope

pytestmark = [
    pytest.mark.skipif(gate.reference_kernels(), reason="CEDLM_REFERENCE_KERNELS=1 turns the compiled "
                       "kernels off: no fast path to compare with its reference"),
    pytest.mark.skipif(gate.ext_op("rope_rotate") is None and not gate.reference_kernels(),
                       reason="compiled extension not built"),
]



def _fast_rotate(x, cos):
    """Whether the compiled rotation takes this call (its result, or None)."""
    return kernels_rope.rotate(x, cos, torch.zeros_like(cos), False)


YARN = {"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
        "original_max_position_embeddings": 1024}


def _both(rope, x, pos, inverse=False):
    fast_out = rope.apply(x, pos, inverse=inverse)
    with gate.reference_kernels_forced():
        ref = rope.apply(x, pos, inverse=inverse)
    return fast_out, ref


@pytest.mark.parametrize("scaling", [None, YARN])
@pytest.mark.parametrize("inverse", [False, True])
def test_fast_rope_is_bit_identical(scaling, inverse):
    g = torch.Generator().manual_seed(0)
    rope = Rope(16, 160000.0 if scaling else 10000.0, scaling)
    B, T, H = 3, 5, 4
    pos = torch.randint(0, 70000, (B, T), generator=g)
    cases = [
        (torch.randn(B, T, H, 64, generator=g), pos.unsqueeze(-1)),   # queries / attention output
        (torch.randn(B, T, 64, generator=g), pos),                    # window rows
        (torch.randn(B, T, 16, generator=g), pos),                    # all dims rotated
        (torch.randn(7, 32, generator=g) * 1e30, torch.arange(7)),    # entry keys, large values
    ]
    for x, p in cases:
        assert _fast_rotate(x, rope.cos_sin(p)[0].reshape(*p.shape, 1, -1)
                            if x.dim() == p.dim() + 2 else rope.cos_sin(p)[0]) is not None
        a, b = _both(rope, x, p, inverse)
        assert a.shape == b.shape == x.shape
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_fallbacks_take_the_reference_path():
    rope = Rope(8, 10000.0, None)
    x = torch.randn(2, 3, 16, requires_grad=True)
    cos = rope.cos_sin(torch.arange(3))[0]
    assert _fast_rotate(x, cos) is None                               # autograd
    assert _fast_rotate(x.detach().bfloat16(), cos) is None           # dtype
    assert _fast_rotate(x.detach(), cos[:1]) is None                  # broadcast over T
    y = rope.apply(x, torch.arange(3).expand(2, 3))
    y.sum().backward()                                                # gradients still flow
    assert x.grad is not None and x.grad.abs().sum() > 0
