"""Byte-exact tests of the `v4_fp8` entry (DeepSeek V4 MODEL1, reference/kv-layouts.md section 2).

Expected bytes come from hand-written vectors and from a pure-Python reference below (E4M3 by
brute force over the code table, BF16 by rounding the float32 bits), never from the code under
test.
"""
from __future__ import annotations

import math
import struct

import pytest
import torch

from cedlm import ModelConfig
from cedlm.kernels import decode, encode, fake_quant, quant_dequant
from cedlm.quant import FORMATS, bytes_per_entry
from cedlm.quant.formats import EXTRA_FORMATS, V4_FP8, get_format

# ---------------------------------------------------------------------------------------------
# pure-Python reference
# ---------------------------------------------------------------------------------------------


def _e4m3_value(code: int) -> float:
    s, e, m = code >> 7, (code >> 3) & 0xF, code & 7
    if e == 0xF and m == 7:
        return math.nan
    v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


_E4M3 = [(c, _e4m3_value(c)) for c in range(128) if not math.isnan(_e4m3_value(c))]


def ref_e4m3(t: float) -> int:
    """Nearest E4M3 code, ties to the even code, saturating at 448."""
    a = min(abs(t), 448.0)
    best = min(_E4M3, key=lambda cv: (abs(cv[1] - a), cv[0] & 1))
    return best[0] | (0x80 if math.copysign(1, t) < 0 else 0)


def ref_bf16_bytes(v: float) -> bytes:
    bits = struct.unpack("<I", struct.pack("<f", v))[0]
    lower, upper = bits & 0xFFFF, bits >> 16
    if lower > 0x8000 or (lower == 0x8000 and upper & 1):
        upper += 1
    return struct.pack("<H", upper)


def ref_scale_exp(amax: float) -> int:
    """e with s = 2^e = 2^ceil(log2(max(amax / 448, 1e-4))), computed in float32 like the kernel."""
    y = struct.unpack("<f", struct.pack("<f", amax / 448.0))[0]
    y = max(y, struct.unpack("<f", struct.pack("<f", 1e-4))[0])
    m, e = math.frexp(y)              # y = m * 2^e, m in [0.5, 1)
    return e - 1 if m == 0.5 else e


def ref_encode(x: list[float], rope: int = 64, block: int = 64) -> bytes:
    nope = len(x) - rope
    data, scales = bytearray(), bytearray()
    for t0 in range(0, nope, block):
        tile = x[t0: t0 + block]
        e = ref_scale_exp(max(abs(v) for v in tile))
        scales.append(e + 127)
        data += bytes(ref_e4m3(v / 2.0 ** e) for v in tile)
    for v in x[nope:]:
        data += ref_bf16_bytes(v)
    return bytes(data + scales + b"\x00")


# ---------------------------------------------------------------------------------------------
# sizes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim,nbytes", [(512, 584), (128, 194), (256, 324), (1024, 1104)])
def test_bytes_per_entry(dim, nbytes):
    assert bytes_per_entry("v4_fp8", dim) == nbytes
    assert encode(torch.randn(3, dim), "v4_fp8").shape == (3, nbytes)
    assert V4_FP8.bytes_per_entry() == 584 == 448 + 64 * 2 + 448 // 64 + 1


def test_not_a_v41_format_but_resolvable():
    assert "v4_fp8" not in FORMATS and EXTRA_FORMATS["v4_fp8"] is V4_FP8
    assert get_format("v4_fp8") is V4_FP8


@pytest.mark.parametrize("dim", [64, 96, 100, 0, 500])
def test_bad_dim(dim):
    with pytest.raises(ValueError, match="64"):
        bytes_per_entry("v4_fp8", dim)
    if dim:
        with pytest.raises(ValueError, match="64"):
            encode(torch.zeros(2, dim), "v4_fp8")


def test_plan_entry_bytes_agrees():
    from cedlm.plan import entry_bytes
    cfg = ModelConfig.preset("deepseek-v4-flash")
    assert entry_bytes(cfg, "v4_fp8", cfg.head_dim) == bytes_per_entry("v4_fp8", cfg.head_dim) == 584
    small = ModelConfig.preset("small").replace(qk_rope_head_dim=64)
    assert entry_bytes(small, "v4_fp8", 128) == bytes_per_entry("v4_fp8", 128) == 194


# ---------------------------------------------------------------------------------------------
# hand vectors
# ---------------------------------------------------------------------------------------------


def test_hand_vector_512():
    x = [0.0] * 512
    x[0] = 448.0              # tile 0: s = 1 (byte 127), 448 -> 0x7E
    x[64] = 450.0             # tile 1: s = 2 (128), 225 -> 224 -> 0x76
    x[128] = 896.0            # tile 2: exact power not bumped: s = 2 (128), 448 -> 0x7E
    x[192] = 900.0            # tile 3: s = 4 (129), 225 -> 0x76
    # tile 4: all zero -> floor 1e-4 -> s = 2^-13 (114)
    x[320] = 0.01             # tile 5: 0.01/448 < 1e-4 -> s = 2^-13 (114); 81.92 -> 80 -> 0x6A
    x[384] = -1.0             # tile 6: 1/448 -> s = 2^-8 (119); -256 -> 0xF8
    x[448], x[449], x[450], x[451] = 1.5, 1.00390625, 1.01171875, -2.0       # RoPE, BF16
    b = encode(torch.tensor(x)[None], "v4_fp8")[0].tolist()
    assert len(b) == 584
    assert b[576:583] == [127, 128, 128, 129, 114, 114, 119] and b[583] == 0
    assert (b[0], b[64], b[128], b[192], b[320], b[384]) == (0x7E, 0x76, 0x7E, 0x76, 0x6A, 0xF8)
    assert all(b[i] == 0 for i in range(448) if i not in (0, 64, 128, 192, 320, 384))
    # 1.5 = 0x3FC0; 1 + 2^-8 ties to even -> 1.0 (0x3F80); 1 + 3*2^-8 ties to 0x3F82; -2 = 0xC000
    assert b[448:456] == [0xC0, 0x3F, 0x80, 0x3F, 0x82, 0x3F, 0x00, 0xC0]
    assert bytes(b) == ref_encode(x)
    d = decode(torch.tensor(b, dtype=torch.uint8)[None], "v4_fp8", 512)[0]
    assert d[0] == 448 and d[64] == 448 and d[128] == 896 and d[192] == 896
    assert d[320] == 80 * 2.0 ** -13 and d[384] == -1.0
    assert d[448:452].tolist() == [1.5, 1.0, 1.015625, -2.0]


@pytest.mark.parametrize("dim", [128, 512])
def test_random_against_reference(dim):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, dim, generator=g) * torch.exp(torch.randn(6, 1, generator=g) * 3)
    x[2, :64] *= 1e-7                                            # a tile under the floor
    b = encode(x, "v4_fp8")
    for r in range(x.shape[0]):
        assert bytes(b[r].tolist()) == ref_encode(x[r].tolist()), r


# ---------------------------------------------------------------------------------------------
# round trip, specials, QAT
# ---------------------------------------------------------------------------------------------


def test_round_trip_error_and_rope_exactness():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 512, generator=g) * 5
    d = decode(encode(x, "v4_fp8"), "v4_fp8", 512)
    assert torch.equal(d[:, 448:], x[:, 448:].bfloat16().float())
    amax = x[:, :448].reshape(64, 7, 64).abs().amax(-1, keepdim=True)
    err = (d[:, :448] - x[:, :448]).reshape(64, 7, 64).abs()
    assert (err <= amax * 2.0 ** -3).all()          # <= half an E4M3 step at the top binade, x2 scale slack


@pytest.mark.parametrize("shape,dtype", [((7, 512), torch.float32), ((2, 3, 128), torch.bfloat16),
                                         ((0, 256), torch.float32), ((5, 128), torch.float16)])
def test_quant_dequant_bitwise(shape, dtype):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(6)) * 3).to(dtype)
    ref = decode(encode(x, "v4_fp8"), "v4_fp8", shape[-1])
    qd = quant_dequant(x, "v4_fp8")
    assert qd.dtype == torch.float32 and qd.shape == x.shape
    assert torch.equal(qd.view(torch.int32), ref.view(torch.int32))


def test_specials_poison_their_tile_only():
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(9))
    x[0, 3] = float("nan")
    x[1, 10] = float("inf")
    x[2, 70] = float("nan")                          # a RoPE dim: BF16 NaN, nothing else
    d = decode(encode(x, "v4_fp8"), "v4_fp8", 128)
    assert torch.isnan(d[0, :64]).all() and not torch.isnan(d[0, 64:]).any()
    assert torch.isnan(d[1, :64]).all()
    assert torch.isnan(d[2, 70]) and torch.isnan(d[2]).sum() == 1
    qd = quant_dequant(x, "v4_fp8")
    assert torch.equal(torch.isnan(qd), torch.isnan(d))
    assert torch.equal(torch.nan_to_num(qd), torch.nan_to_num(d))


def test_fake_quant_ste():
    x = (torch.randn(4, 128) * 2).requires_grad_(True)
    y = fake_quant(x, "v4_fp8")
    assert torch.equal(y.detach(), quant_dequant(x.detach(), "v4_fp8"))
    up = torch.randn(4, 128)
    y.backward(up)
    assert torch.equal(x.grad, up)
