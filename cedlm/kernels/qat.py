"""Quantization-aware training: fake quantization with a straight-through estimator.

V4.1 quantizes KV after RoPE from training onward. ``fake_quant(x, fmt)`` returns exactly the values
the cache would hold after ``decode(encode(x))`` (in ``x.dtype``; every format's dequantized values
are exact in bf16), and passes the upstream gradient through unchanged (d out / d x = I).
"""

from __future__ import annotations

import torch

from cedlm.quant.formats import QuantFormat, get_format

from .codecs import quant_dequant

__all__ = ["FakeQuant", "fake_quant", "store_round"]


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


def store_round(x: torch.Tensor, fmt: str, training: bool) -> torch.Tensor:
    """The values the cache holds for ``x`` in format ``fmt``: quantise-dequantise, with the
    straight-through gradient when training (``x`` requires grad), else a plain round trip."""
    if training and x.requires_grad:
        return fake_quant(x, fmt)
    return quant_dequant(x, fmt).to(x.dtype)
