"""The three byte-exact KV entry formats of DeepSeek-V4.1 (FlashMLA's V4.1 cache layouts).

| name         | elements                      | scales                     | 512/128 dims |
|--------------|-------------------------------|----------------------------|--------------|
| ``kv_fp4``     | E2M1, 2 per byte (even = low) | one E4M3 per 16 dims       | 256+32 = 288 |
| ``index_fp4``  | E2M1, 2 per byte (even = low) | one UE8M0 per 32 dims      | 64+4 = 68    |
| ``window_fp8`` | E4M3, 1 per byte              | one UE8M0 per 32 dims      | 512+16 = 528 |

(Also here, outside ``FORMATS``: ``v4_fp8``, DeepSeek V4's 584-byte MODEL1 main-KV entry, the
baseline the V4-Flash-style twin stores; see ``V4Fp8Format``.)

An entry is ``[packed elements][scale bytes]``, contiguous. Any ``dim`` that is a positive multiple
of the format's block works (the official sizes are 512, 128, 512).

Scale rules, per tile of ``block`` dims with amax = max |x|:

* ``kv_fp4``: s = E4M3_RNE(clamp(amax/6, 2^-9, 448)) (clamp first: rounded to NEAREST, so |x/s|
  may slightly exceed 6 and saturates). A NaN in the tile gives s = NaN (0x7F). An inf (no NaN)
  follows the official rule literally: amax/6 = inf clamps to 448, inf -> +-6, the rest -> ~0.
* ``index_fp4``: s = 2^ceil(log2(max(amax, 6*2^-126)/6)) as UE8M0 (so |x/s| <= 6, no saturation).
* ``window_fp8``: the reference-model (QAT, ``act_quant`` with ue8m0) rule
  s = 2^ceil(log2(fp32(max(amax, 1e-4) * fp32(1/448)))), q = E4M3_RNE(clamp(x/s, -448, 448)).
  The FlashMLA test quantizer instead floors amax/448 (not amax) at 1e-4; the two agree for
  amax >= 0.0448 and differ only for tiny tiles (reference s = 2^-22, FlashMLA test s = 2^-13).
* UE8M0 formats: a NaN OR an inf in the tile gives scale byte 255 (NaN); the bit-exact ceil rule
  maps both to 255, so an inf poisons the tile like a NaN (decodes to all-NaN).

The codecs below (``encode_reference``, ``decode_reference``, ``quant_dequant_reference``) are the
readable definition and the oracle (pure torch). The codecs the model and the cache call,
``cedlm.kernels.encode`` / ``decode`` / ``quant_dequant``, run bit-identical fast codecs (compiled
or vectorised torch) unless ``CEDLM_REFERENCE_KERNELS=1`` forces these.

Elements are quantized from t = x/s in float32. In a NaN-scale ("poisoned") tile t is NaN; E2M1
then stores code 0 with the sign of x, E4M3 stores NaN: 0x7F, or 0xFF where x is itself a NaN
with its sign bit set (``e4m3_poisoned``). Either way the whole tile decodes to NaN, with the NaN
bits ``numerics.scaled`` states. Both rules are written out rather than left to the hardware's
NaN propagation, so the bytes and the decoded bits are the same on every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .bf16 import BF16, Bf16Format
from .numerics import (
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    E4M3_NAN,
    e2m1_decode,
    e2m1_encode,
    e2m1_round,
    e4m3_decode,
    e4m3_encode,
    any_nan,
    device_path,
    pack_nibbles,
    scaled,
    ue8m0_ceil,
    ue8m0_decode,
    unpack_nibbles,
)

__all__ = ["QuantFormat", "FORMATS", "V4Fp8Format", "V4_FP8", "EXTRA_FORMATS", "get_format",
           "bytes_per_entry", "check_bytes", "scale_bytes_from_amax", "v4_scale_bytes_from_amax",
           "v4_quant_dequant", "e4m3_poisoned", "encode_reference", "decode_reference",
           "quant_dequant_reference"]


@dataclass(frozen=True)
class QuantFormat:
    """Static description of one entry format."""

    name: str
    element: str      # "e2m1" (4 bits, packed two per byte) or "e4m3" (one byte)
    scale: str        # "e4m3" or "ue8m0", one byte per block
    block: int        # dims per scale
    default_dim: int  # the official V4.1 entry width

    @property
    def element_bits(self) -> int:
        return 4 if self.element == "e2m1" else 8

    def check_dim(self, dim: int) -> int:
        if not isinstance(dim, int) or dim <= 0 or dim % self.block != 0:
            raise ValueError(f"{self.name}: dim {dim} is not a positive multiple of the block "
                             f"{self.block}")
        return dim

    def data_bytes(self, dim: int) -> int:
        return self.check_dim(dim) * self.element_bits // 8

    def scale_bytes(self, dim: int) -> int:
        return self.check_dim(dim) // self.block

    def bytes_per_entry(self, dim: int | None = None) -> int:
        dim = self.default_dim if dim is None else dim
        return self.data_bytes(dim) + self.scale_bytes(dim)


FORMATS: dict[str, QuantFormat] = {
    "kv_fp4": QuantFormat("kv_fp4", element="e2m1", scale="e4m3", block=16, default_dim=512),
    "index_fp4": QuantFormat("index_fp4", element="e2m1", scale="ue8m0", block=32, default_dim=128),
    "window_fp8": QuantFormat("window_fp8", element="e4m3", scale="ue8m0", block=32,
                              default_dim=512),
}

_FP4_MIN_SCALE = E4M3_MIN_SUBNORMAL          # 2^-9, kv_fp4 clamp floor of amax/6
_INDEX_AMAX_FLOOR = 6.0 * 2.0 ** -126        # exact in float32
_WINDOW_AMAX_FLOOR = 1e-4                    # compared in float32 (torch casts the scalar)


# ---------------------------------------------------------------------------------------------
# v4_fp8: DeepSeek V4 "MODEL1" FP8 sparse entry (584 B: 448 E4M3 NoPE, 64 BF16 RoPE, 7 UE8M0
# scales, 1 pad byte), the V4-Flash main KV
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class V4Fp8Format:
    """DeepSeek V4's main-KV entry: FP8 NoPE + BF16 RoPE + UE8M0 per 64 NoPE dims + 1 pad byte.

    An entry of ``dim`` values is split into the NoPE part (the first ``dim - rope`` dims) and the
    RoPE part (the last ``rope`` = 64 dims, as in V4 where head_dim 512 = 448 + 64). Entry layout,
    contiguous (584 B at dim 512)::

        [0, nope)                     nope x E4M3        (q = E4M3_RNE(x / s_tile))
        [nope, nope + 2*rope)         rope x BF16, little-endian, not quantized (RNE cast)
        [.., + nope/64)               one UE8M0 scale per 64 NoPE dims
        [last]                        1 pad byte (0)

    FlashMLA's paged MODEL1 cache splits a page into all tokens' data rows (576 B) followed by all
    tokens' scale rows (8 B); that is a page layout of these same bytes, not a different entry.
    Scale (FlashMLA test rule): s = 2^ceil(log2(max(amax / 448, 1e-4))) as UE8M0 (exact powers of
    two not bumped; a NaN or inf in the tile gives byte 255, decoding to a NaN tile).
    Any ``dim = 64 + 64k`` (k >= 1) works: 128 -> 194 B, 512 -> 584 B.

    Not part of ``FORMATS`` (the three V4.1 formats): ``get_format("v4_fp8")`` and the module
    functions accept it.
    """

    name: str = "v4_fp8"
    rope: int = 64
    block: int = 64
    default_dim: int = 512
    element: str = "e4m3+bf16"
    scale: str = "ue8m0"

    def check_dim(self, dim: int) -> int:
        if (not isinstance(dim, int) or dim <= self.rope
                or (dim - self.rope) % self.block != 0):
            raise ValueError(f"{self.name}: dim {dim} must be {self.rope} RoPE dims plus a positive "
                             f"multiple of the block {self.block} (NoPE dims)")
        return dim

    def nope(self, dim: int) -> int:
        return self.check_dim(dim) - self.rope

    def data_bytes(self, dim: int) -> int:
        return self.nope(dim) + 2 * self.rope

    def scale_bytes(self, dim: int) -> int:
        return self.nope(dim) // self.block + 1          # scales + 1 pad byte

    def bytes_per_entry(self, dim: int | None = None) -> int:
        dim = self.default_dim if dim is None else dim
        return self.data_bytes(dim) + self.scale_bytes(dim)


V4_FP8 = V4Fp8Format()
EXTRA_FORMATS: dict[str, V4Fp8Format | Bf16Format] = {"v4_fp8": V4_FP8, "bf16": BF16}
_V4_FLOOR = 1e-4                               # on amax / 448 (FlashMLA MODEL1 test quantizer)


def _v4_split(x: torch.Tensor, f: V4Fp8Format):
    """float [..., dim] -> (NoPE tiles float32 [..., nope/64, 64], RoPE float32 [..., rope])."""
    dim = f.check_dim(x.shape[-1]) if x.dim() > 0 else f.check_dim(0)
    x = x.detach().to(torch.float32)
    nope = dim - f.rope
    nope_part, rope = x.narrow(-1, 0, nope), x.narrow(-1, nope, f.rope)
    return nope_part.reshape(*x.shape[:-1], nope // f.block, f.block), rope


def _v4_scale_bytes(xt: torch.Tensor) -> torch.Tensor:
    return v4_scale_bytes_from_amax(xt.abs().amax(dim=-1))     # NaN propagates


def v4_scale_bytes_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """float32 tile amax [...] -> uint8 UE8M0 scale bytes [...] (shared with the fast codecs)."""
    y = torch.div(amax, _f32(E4M3_MAX, amax))
    return ue8m0_ceil(torch.where(y < _V4_FLOOR, torch.full_like(y, _V4_FLOOR), y))


def _v4_encode(x: torch.Tensor, f: V4Fp8Format) -> torch.Tensor:
    xt, rope = _v4_split(x, f)
    sb = _v4_scale_bytes(xt)
    s = ue8m0_decode(sb).unsqueeze(-1)
    q = e4m3_poisoned(e4m3_encode(xt / s, inplace=True), xt, s)
    lead, nope = xt.shape[:-2], xt.shape[-2] * f.block
    rb = rope.to(torch.bfloat16).contiguous().view(torch.uint8)         # little-endian pairs
    pad = torch.zeros(*lead, 1, dtype=torch.uint8, device=x.device)
    return torch.cat((q.reshape(*lead, nope), rb.reshape(*lead, 2 * f.rope), sb, pad), dim=-1)


def _v4_decode(b: torch.Tensor, f: V4Fp8Format, dim: int) -> torch.Tensor:
    nope = f.nope(dim)
    lead = b.shape[:-1]
    q = e4m3_decode(b[..., :nope]).reshape(*lead, nope // f.block, f.block)
    rope = b[..., nope: nope + 2 * f.rope].contiguous().view(torch.bfloat16).to(torch.float32)
    sb = b[..., nope + 2 * f.rope: nope + 2 * f.rope + nope // f.block]
    q = scaled(q, ue8m0_decode(sb).unsqueeze(-1)).reshape(*lead, nope)
    return torch.cat((q, rope), dim=-1)


def v4_quant_dequant(x: torch.Tensor, f: V4Fp8Format) -> torch.Tensor:
    """Reference ``quant_dequant`` of a ``v4_fp8`` entry (the fast codecs use it as is)."""
    xt, rope = _v4_split(x, f)
    s = ue8m0_decode(_v4_scale_bytes(xt)).unsqueeze(-1)
    q = e4m3_decode(e4m3_poisoned(e4m3_encode(xt / s, inplace=True), xt, s))
    q = scaled(q, s).reshape(*xt.shape[:-2], xt.shape[-2] * f.block)
    return torch.cat((q, rope.to(torch.bfloat16).to(torch.float32)), dim=-1).reshape(x.shape)


def get_format(fmt: str | QuantFormat | V4Fp8Format) -> QuantFormat | V4Fp8Format:
    if isinstance(fmt, (QuantFormat, V4Fp8Format, Bf16Format)):
        return fmt
    try:
        return FORMATS[fmt] if fmt in FORMATS else EXTRA_FORMATS[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"unknown KV format {fmt!r}; known: "
                         f"{sorted(FORMATS) + sorted(EXTRA_FORMATS)}") from None


def bytes_per_entry(fmt: str | QuantFormat, dim: int) -> int:
    """Bytes of one encoded entry of ``dim`` values (288 for kv_fp4/512, 68 for index_fp4/128,
    528 for window_fp8/512, 584 for v4_fp8/512)."""
    return get_format(fmt).bytes_per_entry(dim)


# ---------------------------------------------------------------------------------------------
# scales
# ---------------------------------------------------------------------------------------------

def _tiles(x: torch.Tensor, f: QuantFormat) -> torch.Tensor:
    """float [..., dim] -> float32 [..., dim/block, block] (checks dim; detached: the codecs are
    not differentiable, ``fake_quant`` supplies the straight-through gradient)."""
    dim = f.check_dim(x.shape[-1]) if x.dim() > 0 else f.check_dim(0)
    x = x.detach().to(torch.float32)
    return x.reshape(*x.shape[:-1], dim // f.block, f.block)


def _scale_bytes(xt: torch.Tensor, f: QuantFormat) -> torch.Tensor:
    """float32 tiles [..., T, block] -> uint8 scale bytes [..., T]."""
    return scale_bytes_from_amax(xt.abs().amax(dim=-1), f)  # NaN propagates


def _f32(value: float, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a float32 0-dim tensor on ``like``'s device: the divisor or factor of a scale
    rule. Never a Python scalar there: CUDA computes ``a / scalar`` as ``a * (1 / scalar)`` (a
    second rounding, not IEEE's quotient), where a device tensor gets the true division on every
    device. ``torch.full`` is a fill kernel (no host-to-device copy: capturable in a CUDA graph)."""
    return torch.full((), value, dtype=torch.float32, device=like.device)


def e4m3_poisoned(codes: torch.Tensor, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """E4M3 element codes [..., T, block] with the rule of a NaN-scale ("poisoned") tile stated:
    where the scale s [..., T, 1] is NaN, every element is NaN, 0x7F, or 0xFF where x itself (the
    unscaled input, any float dtype) is a NaN with its sign bit set. That is what x / NaN and the
    cast give on x86 (the NaN operand); stated here because CUDA's division returns a canonical
    positive NaN instead."""
    if not device_path(codes) and not any_nan(s):
        return codes
    nan = (torch.isnan(x) & torch.signbit(x)).to(torch.uint8) << 7
    return torch.where(torch.isnan(s), nan | E4M3_NAN, codes)


def scale_bytes_from_amax(amax: torch.Tensor, f: QuantFormat, encode_e4m3=e4m3_encode
                          ) -> torch.Tensor:
    """float32 tile amax = max |x| [..., T] (NaN if the tile has one) -> uint8 scale bytes [..., T].

    The scale rules of the module docstring; the fast codecs (``cedlm.kernels.codecs``) call this too, so the two
    paths share one definition of the scales. May modify ``amax`` in place. ``encode_e4m3``: the
    float32 -> E4M3 byte encoder of the kv_fp4 scale (the fast codecs pass their table encoder;
    its input here is finite, in [2^-9, 448], or NaN, which is replaced).

    Every step is exact or one correctly rounded IEEE operation on a device tensor (the audit in
    ``cedlm/kernels/codecs.py``): max, clamp, one division (or, window_fp8, one multiplication)
    by a float32 constant, then bit arithmetic (``ue8m0_ceil``) or a round-to-nearest-even cast.
    """
    if f.name == "kv_fp4":
        y = torch.div(amax, _f32(6.0, amax)).clamp_(_FP4_MIN_SCALE, E4M3_MAX)
        sb = encode_e4m3(y)
        # A NaN poisons the tile; force the canonical positive NaN byte.
        return torch.where(torch.isnan(amax), E4M3_NAN, sb).to(torch.uint8)
    if f.name == "index_fp4":
        return ue8m0_ceil(torch.div(amax.clamp_min_(_INDEX_AMAX_FLOOR), _f32(6.0, amax)))
    if f.name == "window_fp8":
        # Multiply by fp32(1/448) as the reference kernel does. (Checked exhaustively over a
        # binade: the ceil never differs from that of the correctly rounded amax/448.)
        return ue8m0_ceil(amax.clamp_min_(_WINDOW_AMAX_FLOOR) * _f32(1.0 / 448.0, amax))
    raise AssertionError(f.name)


def _scale_values(sb: torch.Tensor, f: QuantFormat) -> torch.Tensor:
    """uint8 scale bytes [..., T] -> float32 [..., T, 1] (broadcast over a tile)."""
    s = e4m3_decode(sb) if f.scale == "e4m3" else ue8m0_decode(sb)
    return s.unsqueeze(-1)


def check_bytes(b: torch.Tensor, f: QuantFormat | V4Fp8Format, dim: int) -> None:
    """Raise a ValueError unless ``b`` is uint8 entries of ``f`` at ``dim`` (a decode's input)."""
    nbytes = f.bytes_per_entry(dim)
    if b.dtype != torch.uint8:
        raise ValueError(f"{f.name}: decode expects torch.uint8 bytes, got {b.dtype}")
    if b.dim() == 0 or b.shape[-1] != nbytes:
        raise ValueError(f"{f.name}: an entry of dim {dim} has {nbytes} bytes, got shape "
                         f"{tuple(b.shape)}")


# ---------------------------------------------------------------------------------------------
# the readable reference codecs: the documentation of the rules and the oracle of the fast path
# ---------------------------------------------------------------------------------------------

def encode_reference(x: torch.Tensor, fmt: str | QuantFormat) -> torch.Tensor:
    """Reference ``encode`` (whole-tensor elementwise torch, the rules as written above)."""
    f = get_format(fmt)
    if isinstance(f, Bf16Format):
        return f.encode(x)
    if isinstance(f, V4Fp8Format):
        return _v4_encode(x, f)
    xt = _tiles(x, f)
    sb = _scale_bytes(xt, f)
    s = _scale_values(sb, f)
    t = xt / s
    flat = (*xt.shape[:-2], xt.shape[-2] * f.block)
    if f.element == "e2m1":
        data = pack_nibbles(e2m1_encode(t, xt, inplace=True).reshape(flat))
    else:
        data = e4m3_poisoned(e4m3_encode(t, inplace=True), xt, s).reshape(flat)
    return torch.cat((data, sb), dim=-1)


def decode_reference(b: torch.Tensor, fmt: str | QuantFormat, dim: int) -> torch.Tensor:
    """Reference ``decode``."""
    f = get_format(fmt)
    check_bytes(b, f, dim)
    if isinstance(f, Bf16Format):
        return f.decode(b, dim)
    if isinstance(f, V4Fp8Format):
        return _v4_decode(b, f, dim)
    nd = f.data_bytes(dim)
    lead = b.shape[:-1]
    data, sb = b[..., :nd], b[..., nd:]
    if f.element == "e2m1":
        q = e2m1_decode(unpack_nibbles(data))
    else:
        q = e4m3_decode(data)
    q = q.reshape(*lead, dim // f.block, f.block)
    return scaled(q, _scale_values(sb, f), q_nan=f.element == "e4m3").reshape(*lead, dim)


def quant_dequant_reference(x: torch.Tensor, fmt: str | QuantFormat | None) -> torch.Tensor:
    """Reference ``quant_dequant``."""
    if fmt is None or fmt == "none":
        return x
    f = get_format(fmt)
    if isinstance(f, Bf16Format):
        return f.quant_dequant(x)
    if isinstance(f, V4Fp8Format):
        return v4_quant_dequant(x, f)
    xt = _tiles(x, f)
    s = _scale_values(_scale_bytes(xt, f), f)
    t = xt / s
    if f.element == "e2m1":
        return scaled(e2m1_round(t, xt, inplace=True), s, q_nan=False).reshape(x.shape)
    q = e4m3_decode(e4m3_poisoned(e4m3_encode(t, inplace=True), xt, s))
    return scaled(q, s).reshape(x.shape)

