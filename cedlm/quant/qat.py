"""Quantization-aware training: fake quantization with a straight-through estimator.

V4.1 quantizes KV after RoPE from training onward. ``fake_quant(x, fmt)`` returns exactly the values
the cache would hold after ``decode(encode(x))`` (in ``x.dtype``; every format's dequantized values
are exact in bf16), and passes the upstream gradient through unchanged (d out / d x = I).
"""

from __future__ import annotations

import torch

from .formats import QuantFormat, get_format, quant_dequant

__all__ = ["FakeQuant", "fake_quant", "FakeQuantize"]


class FakeQuant(torch.autograd.Function):
    """forward: quant_dequant(x, fmt) cast to x.dtype; backward: identity (straight-through)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:  # noqa: D401
        return quant_dequant(x, fmt).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return grad_out, None


def fake_quant(x: torch.Tensor, fmt: str | QuantFormat | None) -> torch.Tensor:
    """Fake-quantize ``x [..., dim]`` through ``fmt``; ``None``/``"none"`` is the identity."""
    if fmt is None or fmt == "none":
        return x
    return FakeQuant.apply(x, get_format(fmt))


class FakeQuantize(torch.nn.Module):
    """Module wrapper of ``fake_quant`` (handy in model code and ablations)."""

    def __init__(self, fmt: str | None):
        super().__init__()
        self.fmt = None if fmt in (None, "none") else get_format(fmt).name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quant(x, self.fmt)

    def extra_repr(self) -> str:
        return f"fmt={self.fmt!r}"
