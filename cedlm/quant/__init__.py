"""Byte-exact KV quantization formats of DeepSeek-V4.1, and their readable reference codecs
(pure torch; no compiled code, no fast paths: those are ``cedlm.kernels``).

    FORMATS            {"kv_fp4", "index_fp4", "window_fp8"} -> QuantFormat
    bytes_per_entry    (fmt, dim) -> int: 288 (kv_fp4, 512), 68 (index_fp4, 128),
                       528 (window_fp8, 512)
    encode_reference   float [..., dim] -> uint8 [..., bytes]   ([packed elements][scale bytes])
    decode_reference   uint8 [..., bytes], dim -> float32 [..., dim]
    quant_dequant_reference  == decode(encode(x)) bitwise, without packing (fmt None/"none":
                       identity)

An entry is ``[packed elements][one scale byte per block]``, at the official widths: kv_fp4 =
512 E2M1 (two per byte, even index in the low nibble) + 32 E4M3 scales (one per 16 dims);
index_fp4 = 128 E2M1 + 4 UE8M0 scales (one per 32 dims); window_fp8 = 512 E4M3 + 16 UE8M0 scales
(one per 32 dims; the RoPE dims are quantized too). The scale and rounding rules are stated in
``formats.py`` and ``numerics.py``.

These reference codecs are the oracle. The model, the cache and the benchmarks call
``cedlm.kernels.encode`` / ``decode`` / ``quant_dequant`` (and ``fake_quant`` / ``store_round``),
bit-identical fast codecs (compiled ``cedlm/kernels/csrc`` when built, else vectorised torch)
unless ``CEDLM_REFERENCE_KERNELS=1`` forces these references.
"""

from .formats import (FORMATS, QuantFormat, bytes_per_entry, decode_reference, encode_reference,
                      get_format, quant_dequant_reference)

__all__ = [
    "FORMATS",
    "QuantFormat",
    "bytes_per_entry",
    "get_format",
    "encode_reference",
    "decode_reference",
    "quant_dequant_reference",
]
