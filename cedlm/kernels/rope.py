"""The compiled RoPE rotation (``csrc/rope.h``): the same float32 operations as the readable
``Rope.apply`` in ``cedlm/model/rope.py`` (which calls ``rotate`` first), bit-identical.

``rotate`` returns None for the reference path: training (autograd), other devices or dtypes, a
non-contiguous ``x``, an angle broadcast other than per row or per head, the kernels not built,
the reference switch (``CEDLM_REFERENCE_KERNELS=1``).
"""

from __future__ import annotations

import torch

from .gate import inference_op

__all__ = ["rotate"]


def _heads(x: torch.Tensor, cos: torch.Tensor) -> int:
    """Rows of x per angle row: 1 when cos covers every row of x, x's head count when cos has a
    broadcast head dim of 1; 0 for any other broadcast (the reference path handles it)."""
    if cos.shape[:-1] == x.shape[:-1]:
        return 1
    if x.dim() >= 2 and cos.shape[:-2] == x.shape[:-2] and cos.shape[-2] == 1:
        return x.shape[-2]
    return 0


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool
           ) -> torch.Tensor | None:
    """x [..., (heads,) dim] with its last ``2 * cos.shape[-1]`` dims rotated in interleaved
    pairs by the angles (cos, sin) (``inverse``: by minus the angles); or None."""
    heads = _heads(x, cos)
    if not x.is_contiguous() or not heads:
        return None
    op = inference_op("rope_rotate", x)
    return None if op is None else op(x, cos, sin, heads, inverse)
