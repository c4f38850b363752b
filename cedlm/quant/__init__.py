"""Byte-exact KV quantization formats of DeepSeek-V4.1 (pure torch).

    FORMATS            {"kv_fp4", "index_fp4", "window_fp8"} -> QuantFormat
    bytes_per_entry    (fmt, dim) -> int: 288 (kv_fp4, 512), 68 (index_fp4, 128),
                       528 (window_fp8, 512)
    encode             float [..., dim] -> uint8 [..., bytes]   ([packed elements][scale bytes])
    decode             uint8 [..., bytes], dim -> float32 [..., dim]
    quant_dequant      == decode(encode(x)) bitwise, without packing (fmt None/"none": identity)
    fake_quant         quant_dequant in x.dtype with a straight-through gradient

An entry is ``[packed elements][one scale byte per block]``, at the official widths: kv_fp4 =
512 E2M1 (two per byte, even index in the low nibble) + 32 E4M3 scales (one per 16 dims);
index_fp4 = 128 E2M1 + 4 UE8M0 scales (one per 32 dims); window_fp8 = 512 E4M3 + 16 UE8M0 scales
(one per 32 dims; the RoPE dims are quantized too). The scale and rounding rules are stated in
``formats.py`` and ``numerics.py``.

Those readable reference codecs (``formats.encode_reference`` & co.) are the oracle. ``encode``,
``decode`` and ``quant_dequant`` run the bit-identical fast codecs of ``fast.py`` (compiled
``csrc/codecs.cpp`` when ``./setup.sh`` built it, else vectorised torch) unless
``CEDLM_REFERENCE_KERNELS=1`` or ``set_reference_kernels(True)`` forces the reference.
"""

from .fast import reference_kernels, reference_kernels_forced, set_reference_kernels
from .formats import (FORMATS, QuantFormat, bytes_per_entry, decode, encode, get_format,
                      quant_dequant)
from .qat import FakeQuant, fake_quant, store_round

__all__ = [
    "FORMATS",
    "QuantFormat",
    "bytes_per_entry",
    "encode",
    "decode",
    "quant_dequant",
    "fake_quant",
    "get_format",
    "FakeQuant",
    "store_round",
    "reference_kernels",
    "set_reference_kernels",
    "reference_kernels_forced",
]
