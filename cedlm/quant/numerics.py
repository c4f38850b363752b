"""Scalar number codecs behind the KV formats: E2M1 (fp4), E4M3 (fp8) and UE8M0 (scale).

All functions are elementwise, vectorised pure torch, and take/return float32 values or uint8 codes
(one code per byte; packing two E2M1 codes into a byte lives in ``pack_nibbles``). The rounding
rules are those of FlashMLA's V4.1 cache quantizers:

* E2M1 (s1 e2 m1): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 by 3-bit code, bit 3 = sign.
  Round to nearest, ties to EVEN code, saturate at +-6 (PTX ``cvt.rn.satfinite.e2m1x2.f32``),
  NaN -> code 0 keeping the sign bit, +-inf -> +-6.
* E4M3 (``float8_e4m3fn``, bias 7, max 448, no inf, 0x7F/0xFF = NaN): clamp to +-448 first, then
  torch's float32 -> float8_e4m3fn cast (round to nearest even). NaN stays NaN with its sign.
* UE8M0 (bias 127, no sign, no mantissa, byte 255 = NaN): a power-of-two CEIL scale computed
  exactly on the float32 bits of y: byte = biased_exp(y) + (mantissa(y) != 0). An exact power of two
  is not bumped. NaN and +inf give 255.
"""

from __future__ import annotations

import torch

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "E4M3_MIN_SUBNORMAL",
    "UE8M0_NAN",
    "E4M3_NAN",
    "e2m1_encode",
    "e2m1_decode",
    "e2m1_round",
    "e2m1_encode_reference",
    "e2m1_decode_reference",
    "pack_nibbles",
    "unpack_nibbles",
    "e4m3_encode",
    "e4m3_decode",
    "e4m3_round",
    "ue8m0_ceil",
    "ue8m0_decode",
    "SCALE_NAN_WINS",
    "DEVICE_PATH_ON_CPU",
    "device_path",
    "any_nan",
    "scaled",
]

# ---------------------------------------------------------------------------------------------
# E2M1
# ---------------------------------------------------------------------------------------------

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude by 3-bit code
# All 16 codes, bit 3 = sign (code 8 is -0.0).
_E2M1_TABLE = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)

# Decision boundaries between magnitude code k and k+1 (the midpoints 0.25, 0.75, ..., 5).
# A tie goes to the EVEN code: for an even k the tie stays at k (strict ">"), for an odd k it
# moves up to k+1 (">="). Counting the boundaries passed gives the magnitude code; a value above
# the last boundary (including +inf) lands on code 7 = 6.0, i.e. the conversion saturates, and
# NaN passes no comparison, so it lands on code 0.
_E2M1_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                (2.5, False), (3.5, True), (5.0, False))

def _e2m1_table(device: torch.device) -> torch.Tensor:
    """The 16 E2M1 values on ``device`` (made per call: only the readable reference decoder uses
    it, and a cache would keep a fake tensor made under a FakeTensorMode)."""
    return torch.tensor(_E2M1_TABLE, dtype=torch.float32, device=device)


_F32_ONE_BITS = 0x3F800000    # 1.0
_F32_FOUR_BITS = 0x40800000   # 4.0
_F32_EXP_MASK = 0x7F800000


def _sign_bit(t: torch.Tensor, sign: torch.Tensor | None) -> torch.Tensor:
    return torch.signbit(t if sign is None else sign).to(torch.uint8) << 3


def e2m1_encode_reference(t: torch.Tensor, sign: torch.Tensor | None = None) -> torch.Tensor:
    """Readable reference of ``e2m1_encode``: count the decision boundaries passed."""
    a = t.abs()
    code = (a > 0.25).to(torch.uint8)
    for bound, tie_up in _E2M1_BOUNDS[1:]:
        code += (a >= bound) if tie_up else (a > bound)
    return code | _sign_bit(t, sign)


def _e2m1_snap_(a: torch.Tensor) -> torch.Tensor:
    """Round a = |t| IN PLACE onto the E2M1 grid plus M with the float32 adder; returns bits of p.

    The grid spacing is 0.5 on [0, 2), 1 on [2, 4) and 2 on [4, 6]. With p = 2^floor(log2 a)
    clamped to [1, 4] and M = 2^22 * p, the float32 ulp at M is exactly that spacing, so the float32
    sum a + M rounds a to the grid, to nearest with ties to even (an even multiple of the spacing is
    an even E2M1 code). ``a`` is first saturated at 6 (so +inf -> 6) and NaN -> 0. On return
    ``a`` holds a + M (exactly M + the rounded magnitude). Needs IEEE float32 adds without
    reassociation or fast-math (true of torch eager on CPU and CUDA); the boundary-counting
    ``e2m1_encode_reference`` is the readable definition and the tests compare the two.
    """
    a.clamp_(max=E2M1_MAX).nan_to_num_(0.0)
    p_bits = (a.view(torch.int32) & _F32_EXP_MASK).clamp_(_F32_ONE_BITS, _F32_FOUR_BITS)
    p_bits += 22 << 23      # now the bits of M
    a += p_bits.view(torch.float32)
    p_bits -= 22 << 23      # back to the bits of p
    return p_bits


def e2m1_encode(t: torch.Tensor, sign: torch.Tensor | None = None, *,
                inplace: bool = False) -> torch.Tensor:
    """float32 -> uint8 E2M1 codes (0..15), RNE ties-to-even, saturating, NaN -> code 0.

    The sign bit is ``signbit(sign)`` (default ``sign = t``). The formats pass the unscaled input
    x as ``sign`` (for t = x/s with s > 0 it is the same bit), so that the sign stays well defined
    where t is a NaN produced by a NaN scale. ``inplace=True`` lets it use ``t`` as scratch.
    """
    neg = torch.signbit(t if sign is None else sign)
    if t.dtype != torch.float32:
        t, inplace = t.to(torch.float32), True
    a = t.abs_() if inplace else t.abs()
    p_bits = _e2m1_snap_(a)
    # bits(a + M) - bits(M) is the rounded magnitude in units of the spacing (0.5, 1, 2 for
    # p = 1, 2, 4), i.e. codes 0..4, 2..4 (-> 4..6) and 2..3 (-> 6..7): add 2*log2(p).
    steps = a.view(torch.int32)
    steps -= p_bits
    p_bits >>= 22
    steps += p_bits
    steps -= (22 << 23) + (_F32_ONE_BITS >> 22)
    code = steps.to(torch.uint8)
    code |= neg.to(torch.uint8) << 3
    return code


def e2m1_round(t: torch.Tensor, sign: torch.Tensor | None = None, *,
               inplace: bool = False) -> torch.Tensor:
    """E2M1 round trip without codes: bitwise equal to ``e2m1_decode(e2m1_encode(t, sign))``.

    ``inplace=True`` overwrites and returns ``t`` (a float32 scratch tensor).
    """
    if t.dtype != torch.float32:
        sign = t if sign is None else sign
        t, inplace = t.to(torch.float32), True
    elif sign is None:
        sign = t.clone() if inplace else t
    a = t.abs_() if inplace else t.abs()
    p_bits = _e2m1_snap_(a)
    p_bits += 22 << 23
    a -= p_bits.view(torch.float32)
    return a.copysign_(sign)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (low 4 bits used) -> float32 (code 8 decodes to -0.0).

    E2M1 bits (e1 e0 m) placed at E4M3's low exponent bits and top mantissa bit are the same
    value times 2^-6, subnormal 0.5 included: decode through torch's exact E4M3 cast.
    """
    b = (code & 0x8) << 4
    b |= (code & 0x7) << 2
    return b.view(torch.float8_e4m3fn).to(torch.float32).mul_(64.0)


def e2m1_decode_reference(code: torch.Tensor) -> torch.Tensor:
    """Readable reference of ``e2m1_decode``: a 16-entry table lookup."""
    return _e2m1_table(code.device)[(code & 0xF).long()]


def pack_nibbles(code: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., n] (n even) -> uint8 [..., n/2]; element i in byte i//2, even i LOW nibble."""
    pairs = code.reshape(*code.shape[:-1], code.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., m] -> uint8 codes [..., 2m] (inverse of ``pack_nibbles``)."""
    pairs = torch.stack((packed & 0xF, packed >> 4), dim=-1)
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ---------------------------------------------------------------------------------------------
# E4M3 (float8_e4m3fn)
# ---------------------------------------------------------------------------------------------

E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0 ** -9
E4M3_NAN = 0x7F


def e4m3_encode(t: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
    """float32 -> uint8 E4M3 bits: clamp to +-448 (so overflow saturates and never becomes NaN),
    then torch's round-to-nearest-even cast. NaN -> 0x7F / 0xFF (sign kept).
    ``inplace=True`` clamps ``t`` in place (scratch)."""
    t = t.clamp_(-E4M3_MAX, E4M3_MAX) if inplace else t.clamp(-E4M3_MAX, E4M3_MAX)
    return t.to(torch.float8_e4m3fn).view(torch.uint8)


_E4M3_NAN_F32_BITS = 0x7FF00000   # the float32 NaN torch's CPU float8 cast gives E4M3's NaN


def e4m3_decode(b: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 bits -> float32, exactly, from the bits (the same value as torch's
    ``float8_e4m3fn`` cast, all 256 bytes checked, and the same NaN bits on every device):
    exponent field e > 0: float32 bits (e + 120) << 23 | m << 20; e = 0: m * 2^-9 (an exact
    product); 0x7F / 0xFF: the NaN 0x7FF00000 with the byte's sign (what the cast gives on the
    CPU; a GPU's conversion may give its canonical NaN instead)."""
    bi = b.to(torch.int32)
    e, m = (bi >> 3) & 0xF, bi & 0x7
    mag = ((e + 120) << 23) | (m << 20)
    mag = torch.where(e == 0, (m.to(torch.float32) * 2.0 ** -9).view(torch.int32), mag)
    mag = torch.where((bi & 0x7F) == E4M3_NAN, _E4M3_NAN_F32_BITS, mag)
    sign = torch.where(bi >= 0x80, -1.0, 1.0).to(torch.float32)
    return torch.copysign(mag.view(torch.float32), sign)


def e4m3_round(t: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
    """E4M3 round trip: bitwise equal to ``e4m3_decode(e4m3_encode(t))``."""
    t = t.clamp_(-E4M3_MAX, E4M3_MAX) if inplace else t.clamp(-E4M3_MAX, E4M3_MAX)
    return t.to(torch.float8_e4m3fn).to(torch.float32)


# ---------------------------------------------------------------------------------------------
# UE8M0 (float8_e8m0fnu): power-of-two scales
# ---------------------------------------------------------------------------------------------

UE8M0_NAN = 255
_F32_QNAN_BITS = 0x7FC00000
_F32_2POW_M127_BITS = 0x00400000  # byte 0 = 2^-127, a float32 subnormal


def ue8m0_ceil(y: torch.Tensor) -> torch.Tensor:
    """float32 y > 0 -> uint8 byte of 2^ceil(log2(y)), exactly, from the bits.

    e = (biased_exp(y) - 127) + (mantissa(y) != 0) and byte = e + 127, so an exact power of two is
    not bumped. NaN (exponent 255, mantissa != 0) and +inf (exponent 255) both give 255 = NaN.
    Callers floor y at 2^-126 or more; for a subnormal y the result (2^-126 or 2^-127) is still an
    upper bound, not the exact ceil.
    """
    bits = y.to(torch.float32).contiguous().view(torch.int32)
    biased = (bits >> 23) & 0xFF
    bump = (bits & 0x7FFFFF) != 0
    return (biased + bump).clamp_(max=UE8M0_NAN).to(torch.uint8)


def ue8m0_decode(b: torch.Tensor) -> torch.Tensor:
    """uint8 UE8M0 -> float32 2^(b-127); 255 -> NaN (quiet, positive), 0 -> 2^-127 (subnormal)."""
    bi = b.to(torch.int32)
    bits = bi << 23
    bits = torch.where(bi == 0, _F32_2POW_M127_BITS, bits)
    bits = torch.where(bi == UE8M0_NAN, _F32_QNAN_BITS, bits)
    return bits.view(torch.float32)


# ---------------------------------------------------------------------------------------------
# dequantisation: element value times scale, with NaN bits made explicit
# ---------------------------------------------------------------------------------------------

DEVICE_PATH_ON_CPU = False     # tests set it: the CPU then runs the path a GPU runs


def device_path(t: torch.Tensor) -> bool:
    """Whether a codec call on ``t`` runs the device path: every NaN rule applied unconditionally
    (a ``torch.where``, no host sync, so a CUDA graph can capture it) rather than after a
    ``bool(isnan(...).any())`` check, and (``cedlm.kernels.codecs``) E4M3 elements encoded by
    the class table rather than torch's float8 cast. Both paths give the same bits. True off
    the CPU, while torch.compile traces, or when ``DEVICE_PATH_ON_CPU`` is set."""
    return DEVICE_PATH_ON_CPU or t.device.type != "cpu" or torch.compiler.is_compiling()


def any_nan(t: torch.Tensor) -> bool:
    """Whether float ``t`` holds a NaN (a host sync: the CPU path's check; ``amax`` propagates
    NaN and reads ``t`` once, four times faster here than ``isnan(t).any()``)."""
    return t.numel() > 0 and bool(torch.isnan(t.amax()))


def _probe_scale_nan_wins() -> bool:
    """Which NaN this CPU's float32 multiply keeps for (E4M3 NaN element) * (UE8M0 NaN scale),
    on a vector-sized tensor as the decoders multiply: True for the scale's, False
    for the element's; True when it keeps neither (the stated rule then replaces that third NaN)."""
    q = torch.full((32,), 0x7F, dtype=torch.uint8, device="cpu").view(torch.float8_e4m3fn)
    q = q.to(torch.float32)
    s = ue8m0_decode(torch.full((32,), UE8M0_NAN, dtype=torch.uint8, device="cpu"))
    got = (q * s).view(torch.int32)
    return not bool((got == q.view(torch.int32)).all())


SCALE_NAN_WINS = _probe_scale_nan_wins()


def scaled(q: torch.Tensor, s: torch.Tensor, *, q_nan: bool = True,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """q * s (float32; s broadcast over q, e.g. [..., T, 1] over tiles [..., T, block]), the one
    multiply of every decode, with the bits of a NaN result stated instead of left to hardware.

    A finite product is IEEE's correctly rounded float32 product on every device (exact unless
    it is subnormal, then round-to-nearest-even; torch's CPU and CUDA kernels keep subnormals).
    NaN propagation is not portable: x86 returns the NaN operand (when both are NaN, which one
    depends on the kernel's operand order), CUDA returns the canonical 0x7FFFFFFF. So a NaN
    result is set explicitly to the NaN operand, and where both are NaN to the scale's when
    ``SCALE_NAN_WINS`` (probed once on this CPU's multiply, so the CPU's own bits never change)
    else the element's. ``q_nan=False``: q has no
    NaN (E2M1 values), the element check is skipped.
    """
    if not device_path(q) and not any_nan(s) and not (q_nan and any_nan(q)):
        return torch.mul(q, s, out=out) if out is not None else torch.mul(q, s)
    p = torch.mul(q, s)
    fixes = [(torch.isnan(q), q)] if q_nan else []
    fixes.insert(len(fixes) if SCALE_NAN_WINS else 0, (torch.isnan(s), s))   # the last one wins
    for k, (mask, value) in enumerate(fixes):
        if k == len(fixes) - 1 and out is not None:
            return torch.where(mask, value, p, out=out)
        p = torch.where(mask, value, p)
    return p
