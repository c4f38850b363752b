"""Byte-exact KV quantization formats of DeepSeek-V4.1 (pure torch).

    FORMATS            {"kv_fp4", "index_fp4", "window_fp8"} -> QuantFormat
    bytes_per_entry    (fmt, dim) -> int: 288 (kv_fp4, 512), 68 (index_fp4, 128),
                       528 (window_fp8, 512)
    encode             float [..., dim] -> uint8 [..., bytes]   ([packed elements][scale bytes])
    decode             uint8 [..., bytes], dim -> float32 [..., dim]
    quant_dequant      == decode(encode(x)) bitwise, without packing (fmt None/"none": identity)
    fake_quant         quant_dequant in x.dtype with a straight-through gradient

The rules and their sources are in ``formats.py`` / ``numerics.py`` and reference/kv-layouts.md.
"""

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
]
