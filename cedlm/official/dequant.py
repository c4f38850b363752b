"""The official checkpoint's weight formats: dequantisers (load) and quantisers (export).

    fp8_block   F8_E4M3 [N, K] with a scale per 32x32 block, [ceil(N/32), ceil(K/32)]
    fp4_expert  E2M1 codes packed two per byte (even index in the LOW nibble) as I8 [N, ceil(K/2)],
                a scale per 1x32 block along K, [N, ceil(K/32)]
    fp8_rows    F8_E4M3 [rows, dim] with a scale per 1x32 block of a row, [rows, ceil(dim/32)]
                (the Engram tables)

Scales are F8_E8M0 (a biased power-of-two exponent byte: 2^(byte-127), 255 = NaN); float32
scales (V4-Flash-Base style FP8 experts) are accepted on load. A dimension that is not a
multiple of the block ends in a partial block, as the official ceil shapes imply.

Dequantisation is exact in float32 (an E4M3 or E2M1 value times a power of two). The export
quantisers use the power-of-two CEIL scale  s = 2^ceil(log2(amax / qmax))  (qmax 448 for E4M3,
6 for E2M1), so nothing saturates; elements round to nearest, ties to even
(`cedlm.quant.numerics`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from cedlm.quant.numerics import (E2M1_MAX, E4M3_MAX, e2m1_decode, e2m1_encode, e4m3_encode,
                                  pack_nibbles, ue8m0_ceil, ue8m0_decode, unpack_nibbles)

__all__ = ["BLOCK", "cdiv", "scale_to_float", "dequant_fp8_block", "dequant_fp4", "dequant_fp8_rows",
           "quant_fp8_block", "quant_fp4", "quant_fp8_rows", "block_scale_shape",
           "fp4_packed_shape", "fp4_scale_shape", "rows_scale_shape"]

BLOCK = 32
_MIN_SCALE = 2.0 ** -126          # smallest scale the quantisers emit (byte 1)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------- shapes
def block_scale_shape(shape, block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[int, int]:
    n, k = shape
    return cdiv(n, block[0]), cdiv(k, block[1])


def fp4_packed_shape(shape) -> tuple[int, int]:
    n, k = shape
    return n, cdiv(k, 2)


def fp4_scale_shape(shape, block: int = BLOCK) -> tuple[int, int]:
    n, k = shape
    return n, cdiv(k, block)


def rows_scale_shape(shape, block: int = BLOCK) -> tuple[int, int]:
    return fp4_scale_shape(shape, block)


# ----------------------------------------------------------------------------- dequantisation
def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """F8_E8M0 (or its uint8 bytes) -> float32 powers of two, exactly; float scales pass through."""
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        return ue8m0_decode(scale)
    return scale.to(torch.float32)


def _expand(scale: torch.Tensor, rows: int, cols: int, br: int, bc: int) -> torch.Tensor:
    """Scale per block -> scale per element [rows, cols] (the last blocks may be partial)."""
    s = scale_to_float(scale)
    return s.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]


def dequant_fp8_block(w: torch.Tensor, scale: torch.Tensor,
                      block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """F8_E4M3 [N, K] and scales [ceil(N/bn), ceil(K/bk)] -> float32 [N, K]."""
    n, k = w.shape
    want = block_scale_shape((n, k), block)
    if tuple(scale.shape) != want:
        raise ValueError(f"fp8 block scale: shape {list(scale.shape)} for weight {[n, k]} "
                         f"and block {list(block)}; expected {list(want)}")
    return w.to(torch.float32).mul_(_expand(scale, n, k, *block))


def dequant_fp8_rows(w: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """F8_E4M3 [rows, dim] and per-row 1xblock scales [rows, ceil(dim/block)] -> float32."""
    rows, dim = w.shape
    if tuple(scale.shape) != rows_scale_shape((rows, dim), block):
        raise ValueError(f"fp8 row scale: shape {list(scale.shape)} for table {[rows, dim]}; "
                         f"expected {list(rows_scale_shape((rows, dim), block))}")
    return w.to(torch.float32).mul_(_expand(scale, rows, dim, 1, block))


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, k: int | None = None,
                block: int = BLOCK) -> torch.Tensor:
    """I8/U8 [N, ceil(K/2)] (two E2M1 codes a byte, even index low) and scales [N, ceil(K/32)]
    -> float32 [N, K] (K defaults to 2 x the packed width)."""
    n, half = packed.shape
    k = 2 * half if k is None else k
    if cdiv(k, 2) != half:
        raise ValueError(f"fp4: packed width {half} cannot hold {k} columns")
    if tuple(scale.shape) != fp4_scale_shape((n, k), block):
        raise ValueError(f"fp4 scale: shape {list(scale.shape)} for weight {[n, k]}; expected "
                         f"{list(fp4_scale_shape((n, k), block))}")
    codes = unpack_nibbles(packed.contiguous().view(torch.uint8))[:, :k]
    return e2m1_decode(codes).mul_(_expand(scale, n, k, 1, block))


# ----------------------------------------------------------------------------- quantisation
def _block_amax(x: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """|x| max per (br x bc) block of a 2-D tensor, partial blocks padded with zeros."""
    n, k = x.shape
    nb, kb = cdiv(n, br), cdiv(k, bc)
    a = F.pad(x.abs(), (0, kb * bc - k, 0, nb * br - n))
    return a.view(nb, br, kb, bc).amax(dim=(1, 3))


def _pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """UE8M0 bytes of 2^ceil(log2(amax / qmax)), floored at 2^-126."""
    return ue8m0_ceil((amax / qmax).clamp_min(_MIN_SCALE))


def _check_finite(x: torch.Tensor, what: str) -> torch.Tensor:
    x = x.detach().to(torch.float32)
    if not torch.isfinite(x).all():
        raise ValueError(f"{what}: cannot quantise a tensor holding NaN or inf")
    return x


def quant_fp8_block(x: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (float8_e4m3fn [N, K], float8_e8m0fnu [ceil(N/bn), ceil(K/bk)])."""
    x = _check_finite(x, "fp8 block")
    n, k = x.shape
    sb = _pow2_scale(_block_amax(x, *block), E4M3_MAX)
    q = e4m3_encode(x / _expand(sb, n, k, *block), inplace=True).view(torch.float8_e4m3fn)
    return q, sb.view(torch.float8_e8m0fnu)


def quant_fp8_rows(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float [rows, dim] -> (float8_e4m3fn [rows, dim], float8_e8m0fnu [rows, ceil(dim/block)])."""
    return quant_fp8_block(x, (1, block))


def quant_fp4(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (int8 [N, ceil(K/2)] packed E2M1, float8_e8m0fnu [N, ceil(K/block)])."""
    x = _check_finite(x, "fp4")
    n, k = x.shape
    sb = _pow2_scale(_block_amax(x, 1, block), E2M1_MAX)
    codes = e2m1_encode(x / _expand(sb, n, k, 1, block), sign=x, inplace=True)
    if k % 2:                                       # odd K: the last byte's high nibble is 0
        codes = F.pad(codes, (0, 1))
    return pack_nibbles(codes).view(torch.int8), sb.view(torch.float8_e8m0fnu)
