"""``bf16``: an unquantised KV entry, ``dim`` BF16 values (2 bytes each, little-endian, RNE cast).

The reference configuration of the fidelity measurements (`cedlm eval`) stores its KV this way;
``get_format("bf16")`` and the module functions of ``formats.py`` accept it like ``v4_fp8``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Bf16Format:
    name: str = "bf16"
    default_dim: int = 512

    def check_dim(self, dim: int) -> int:
        if not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"{self.name}: dim {dim} is not a positive integer")
        return dim

    def bytes_per_entry(self, dim: int | None = None) -> int:
        return 2 * self.check_dim(self.default_dim if dim is None else dim)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """float [..., dim] -> uint8 [..., 2 * dim]."""
        self.check_dim(x.shape[-1])
        b = x.detach().to(torch.bfloat16).contiguous().view(torch.uint8)
        return b.reshape(*x.shape[:-1], 2 * x.shape[-1])

    def decode(self, b: torch.Tensor, dim: int) -> torch.Tensor:
        """uint8 [..., 2 * dim] -> float32 [..., dim]."""
        return b.contiguous().view(torch.bfloat16).reshape(*b.shape[:-1], dim).to(torch.float32)

    def quant_dequant(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach().to(torch.bfloat16).to(torch.float32)


BF16 = Bf16Format()
