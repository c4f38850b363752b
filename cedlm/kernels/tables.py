"""Look-up tables of the fast KV codecs, computed at import FROM the reference decoders and
encoder in ``cedlm.quant`` (so neither fast path can disagree with it): the vectorised torch
codecs (``codecs.py``) and the compiled module (``csrc/codecs.cpp``, handed the same tables by
``gate.compiled``) both use them.

What makes the torch path fast (measured in ``cedlm bench --only formats``):

* Row chunks of about ``CHUNK_VALUES`` values, every temporary sized to a chunk: the reference's
  whole-tensor temporaries (tens of MB at bench sizes) are page-faulted in on every call, and
  that, not arithmetic, is most of its time.
* Decode through 256-entry tables computed at import FROM the reference decoders (so they cannot
  disagree): byte -> two E2M1 values (one int64 gather writes both floats), byte -> E4M3 value,
  byte -> UE8M0 / E4M3 scale. Indices are int32 per chunk, never int64 of the whole input.
* E2M1 encode through a 4096-entry table indexed by a ROUND-TO-ODD view of t's float32 bits:
  idx = (bits >> 20 & 0xFFF) | (bits & 0xFFFFF != 0), i.e. sign, exponent and the top 3
  mantissa bits, with a sticky bit OR-ed into the last one. Every E2M1 decision boundary
  (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) has a zero third mantissa bit, so an "odd" class is an
  open interval between two such points that no boundary crosses, and an "even" class is one
  exact value (a possible tie): the RNE/ties-to-even code, saturation (>= 6 and inf -> 7) and
  NaN (-> 0) are constant on each class. The table is filled by running the reference encoder
  on members of each class; the tests check every class's extreme members against it.
  torch.bucketize against the boundaries (a binary search per element, and the mixed tie rule
  needs nextafter-shifted boundaries) measured about 5x slower than this index + gather here.
* E4M3 elements (and the kv_fp4 scale byte): the same construction, a 16384-entry table by class
  at 5 kept mantissa bits (every E4M3 decision point has a 4-bit mantissa; 448 and inf/NaN are
  class points), filled from the reference ``e4m3_encode`` (clamp + ``float8_e4m3fn`` cast) at
  import. The extension uses the same table. So on any device the torch codecs do one IEEE
  division (x / s) and otherwise only integer bit arithmetic and gathers from tables computed
  here on the CPU (``codecs.py`` has the whole audit). Scales: the shared
  ``formats.scale_bytes_from_amax``.
"""

from __future__ import annotations

import torch
from torch._guards import detect_fake_mode

from cedlm.quant import formats as F
from cedlm.quant import numerics as N

__all__ = ["CPU", "for_device", "class_members", "e2m1_class_members", "e4m3_code_table",
           "nan_scale_wins"]


def class_members(shift: int) -> torch.Tensor:
    """int32 [2^(32-shift), 5]: float32 bit patterns spanning each round-to-odd class.

    Class c (the bits above ``shift``, with a sticky bit, "any bit below is set", OR-ed into bit
    0): an even c is the single pattern c << shift; an odd c is every pattern strictly between
    (c - 1) << shift and (c + 1) << shift (same sign): its extremes, its centre and the centre's
    neighbours. E2M1 uses shift 20 (3 mantissa bits kept), E4M3 shift 18 (5 kept).
    """
    c = torch.arange(1 << (32 - shift), dtype=torch.int64, device="cpu")
    base = (c - (c & 1)) << shift                              # the even point below (or at) c
    odd = (c & 1).bool()
    m = torch.stack((base + 1, (c << shift) - 1, c << shift, (c << shift) + 1,
                     base + (2 << shift) - 1), 1)
    m = torch.where(odd.unsqueeze(1), m, (c << shift).unsqueeze(1))
    m = torch.where(m >= 1 << 31, m - (1 << 32), m)             # to int32 two's complement
    return m.to(torch.int32)


def e2m1_class_members() -> torch.Tensor:
    return class_members(20)


def _build_tables() -> dict[str, torch.Tensor]:
    byte = torch.arange(256, dtype=torch.int64, device="cpu").to(torch.uint8)
    pair = N.e2m1_decode(N.unpack_nibbles(byte.unsqueeze(1)))          # [256, 2] (low, high)
    t = {
        "e2m1_pair": pair.contiguous().view(torch.int64).view(256),     # both floats, one gather
        "e4m3": N.e4m3_decode(byte).contiguous(),
        "ue8m0": N.ue8m0_decode(byte).contiguous(),
    }
    codes = N.e2m1_encode(class_members(20).view(torch.float32))      # [4096, 5]
    t["e2m1_code"] = codes[:, 2].contiguous()                           # the class's c << 20
    t["e2m1_value"] = N.e2m1_decode(t["e2m1_code"]).contiguous()
    if not bool((codes == codes[:, 2:3]).all()):     # the class argument failed: never silently
        raise AssertionError("cedlm.kernels.tables: E2M1 round-to-odd classes are not uniform")
    t["e4m3_code"] = e4m3_code_table()
    return t


def e4m3_code_table() -> torch.Tensor:
    """uint8 [16384]: E4M3 byte (clamp to +-448 included) by round-to-odd class of t at 5 mantissa
    bits, the element encoder of both fast paths (``CPU["e4m3_code"]``). Every E4M3
    RNE decision point (a 4-bit mantissa), 448 and the inf/NaN patterns are class points, so the
    reference is constant on each class (checked)."""
    e4 = N.e4m3_encode(class_members(18).view(torch.float32))         # [16384, 5]
    if not bool((e4 == e4[:, 2:3]).all()):
        raise AssertionError("cedlm.kernels.tables: E4M3 round-to-odd classes are not uniform")
    return e4[:, 2].contiguous()


CPU = _build_tables()
_tables_by_device: dict[torch.device, dict[str, torch.Tensor]] = {torch.device("cpu"): CPU}


def for_device(device: torch.device) -> dict[str, torch.Tensor]:
    """The tables on ``device`` (copied there once, on the first call: before a CUDA graph
    captures a codec call). Under a ``FakeTensorMode`` (torch.compile's tracing, the tests'
    ``fake_cuda``): fake tables of the same shapes, never cached."""
    device = torch.device(device)
    if detect_fake_mode() is not None:
        return {k: torch.empty(v.shape, dtype=v.dtype, device=device) for k, v in CPU.items()}
    t = _tables_by_device.get(device)
    if t is None:
        t = {k: v.to(device) for k, v in CPU.items()}
        _tables_by_device[device] = t
    return t


def nan_scale_wins() -> bool | None:
    """Which NaN the reference decode keeps when an E4M3 element NaN meets a NaN scale (the rule
    ``numerics.scaled`` states, from this CPU's multiply): checked on the reference decode
    itself. None when it keeps neither (the extension then stays off)."""
    f = F.FORMATS["window_fp8"]
    entry = torch.tensor([[0x7F] * f.block + [N.UE8M0_NAN]], dtype=torch.uint8, device="cpu")
    out = F.decode_reference(entry, f, f.block).view(torch.int32)
    s_bits = N.ue8m0_decode(torch.tensor([N.UE8M0_NAN], dtype=torch.uint8, device="cpu"))
    s_bits = s_bits.view(torch.int32)
    q_bits = CPU["e4m3"][0x7F:0x80].view(torch.int32)
    if bool((out == s_bits).all()):
        return True
    if bool((out == q_bits).all()):
        return False
    return None

