"""The compiled mHC kernels (``csrc/mhc.h``): the mixes (pre, post, comb with its Sinkhorn
iterations), the collapse of n copies into one and the expansion back; the readable references
are ``hc_mixes``, ``collapse`` and ``expand`` in ``cedlm/model/mhc.py``, which call these first.

Each returns its result, or None for the reference path: training (autograd), another device,
(collapse / expand) non-contiguous or non-float32 inputs, the kernels not built, the reference
switch (``CEDLM_REFERENCE_KERNELS=1``).
"""

from __future__ import annotations

import torch

from .gate import inference_op

__all__ = ["mixes", "collapse", "expand"]


def mixes(m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float, iters: int,
          n: int):
    """m [..., (2 + n) * n] (the normalised projections), base, scale -> (pre [..., n], post
    [..., n], comb [..., n, n]) float32, the same float32 operations as ``hc_mixes``; or None."""
    op = inference_op("mhc_mixes", m, base, scale, float32=False)
    if op is None:
        return None
    pre, post, comb = op(m.reshape(-1, m.shape[-1]).contiguous(), base, scale, hc_eps, iters)
    lead = m.shape[:-1]
    return pre.view(*lead, n), post.view(*lead, n), comb.view(*lead, n, n)


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor | None:
    """x [B, T, n, D], pre [B, T, n] -> [B, T, D] (the einsum's sums, in index order); or None."""
    if not x.is_contiguous():
        return None
    op = inference_op("mhc_collapse", x, pre)
    if op is None:
        return None
    B, T, n, D = x.shape
    return op(x.reshape(-1, n, D), pre.reshape(-1, n).contiguous()).view(B, T, D)


def expand(x: torch.Tensor, f: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
           ) -> torch.Tensor | None:
    """x'_j = post_j f + sum_i comb[i, j] x_i: x [B, T, n, D], f [B, T, D] -> [B, T, n, D]; or
    None."""
    if not x.is_contiguous():
        return None
    op = inference_op("mhc_expand", x, f, post, comb)
    if op is None:
        return None
    B, T, n, D = x.shape
    return op(x.reshape(-1, n, D), f.reshape(-1, D).contiguous(), post.reshape(-1, n).contiguous(),
              comb.reshape(-1, n, n).contiguous()).view(B, T, n, D)
