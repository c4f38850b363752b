"""Rotary position embedding: interleaved pairs on the LAST `rope_dim` dims of a head.

Ratio-0 layers use `rope_theta` without scaling; compressed layers use `compress_rope_theta`
with YaRN (DeepSeek-V3 `precompute_freqs_cis` semantics: frequencies blended between the
original and factor-scaled ones over a linear ramp of the correction range). As in the V4 ports,
cos/sin are not multiplied by a YaRN mscale (assumed to carry over to V4.1; unverified).
"""
from __future__ import annotations

import math

import torch

from cedlm.kernels import rope as kernels_rope


def yarn_correction_range(rope_dim: int, base: float, beta_fast: float, beta_slow: float,
                          original_max_pos: int) -> tuple[int, int]:
    def corr_dim(num_rot: float) -> float:
        return rope_dim * math.log(original_max_pos / (num_rot * 2 * math.pi)) / (2 * math.log(base))
    low = math.floor(corr_dim(beta_fast))
    high = math.ceil(corr_dim(beta_slow))
    return max(low, 0), min(high, rope_dim - 1)


def rope_frequencies(rope_dim: int, base: float, scaling: dict | None,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Angular frequency per rotated pair: [rope_dim // 2] in `dtype` (computed in it)."""
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=dtype) / rope_dim))
    if scaling:
        factor = float(scaling["factor"])
        low, high = yarn_correction_range(rope_dim, base, scaling.get("beta_fast", 32),
                                          scaling.get("beta_slow", 1),
                                          scaling["original_max_position_embeddings"])
        ramp = (torch.arange(rope_dim // 2, dtype=dtype) - low) / max(high - low, 1e-3)
        smooth = 1.0 - ramp.clamp(0, 1)
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


PRECISIONS = {"float64": torch.float64, "float32": torch.float32}


class Rope(torch.nn.Module):
    """cos/sin at integer positions; `apply` rotates the last `rope_dim` dims of x.

    `precision` is the dtype of the frequencies and angles: "float32" computes them as the
    published V4.1 inference code does (fp32 t * inv_freq, cos/sin in fp32); "float64" (cedlm's
    trained models) keeps the angle exact to fp32 output precision at any position. For the
    official V4.1 config the two differ (largest angle error over the pairs) by 1.5e-3 rad at
    position 65,536 and 2.4e-2 rad at 1,048,576 on compressed layers (theta 160000, YaRN), and by
    6.9e-4 / 1.1e-2 rad on window-only layers (theta 10000); tests/test_rope_precision.py."""

    def __init__(self, rope_dim: int, base: float, scaling: dict | None, precision: str = "float64"):
        super().__init__()
        self.rope_dim = rope_dim
        self.dtype = PRECISIONS[precision]
        self.register_buffer("freqs", rope_frequencies(rope_dim, base, scaling, self.dtype), persistent=False)

    def cos_sin(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # pos: [...] int64 -> cos/sin [..., rope_dim//2] fp32
        ang = pos.to(self.dtype).unsqueeze(-1) * self.freqs
        return ang.cos().float(), ang.sin().float()

    def apply(self, x: torch.Tensor, pos: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x: [..., T, (heads,) dim]; pos broadcastable to x's leading dims [..., T(, 1)]."""
        r = self.rope_dim
        cos, sin = self.cos_sin(pos)
        while cos.dim() < x.dim():            # insert head dims between T and the pair dim
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        fast = kernels_rope.rotate(x, cos, sin, inverse)   # the same operations, compiled
        if fast is not None:
            return fast
        if inverse:
            sin = -sin
        nope, rot = x[..., :-r], x[..., -r:]
        pairs = rot.float().unflatten(-1, (r // 2, 2))      # [..., r/2, 2] interleaved pairs
        a, b = pairs[..., 0], pairs[..., 1]
        out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        return torch.cat((nope, out.to(x.dtype)), dim=-1)
