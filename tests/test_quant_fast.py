"""The fast KV codecs (cedlm/kernels/codecs.py and the compiled csrc/codecs.cpp) against the reference.

Every comparison is BIT FOR BIT: bytes for encode, float32 bit patterns (NaN payloads and signs
included) for decode and quant_dequant. The oracle is ``formats.*_reference`` (itself checked
against hand vectors and pure-Python encoders in test_quant.py / test_quant_v4.py). Each test
runs on both fast backends: "torch" (vectorised) and "ext" (compiled; skipped when not built).
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from cedlm.kernels import codecs, decode, encode, gate, quant_dequant, tables
from cedlm.quant import formats as F
from cedlm.quant import numerics as N

NAN, INF = float("nan"), float("inf")
ALL_FORMATS = ("kv_fp4", "index_fp4", "window_fp8", "v4_fp8")
DIMS = {"kv_fp4": (16, 64, 512, 1024), "index_fp4": (32, 128, 256),
        "window_fp8": (32, 96, 512), "v4_fp8": (128, 192, 512)}
CASES = [(fmt, dim) for fmt in ALL_FORMATS for dim in DIMS[fmt]]


def _ext_ok() -> bool:
    return gate.compiled() is not None


BACKENDS = ["torch", pytest.param("ext", marks=pytest.mark.skipif(
    not _ext_ok(), reason="compiled codecs not built (python -m cedlm.kernels.build)"))]


@pytest.fixture(params=BACKENDS)
def backend(request):
    prev_ref = gate.set_reference_kernels(False)
    prev = gate.set_fast_backend(request.param)
    yield request.param
    gate.set_fast_backend(prev)
    gate.set_reference_kernels(prev_ref)


def ibits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(ibits(a), ibits(b))


def check_all(x: torch.Tensor, fmt: str) -> None:
    """fast == reference for encode, decode(encode) and quant_dequant of x."""
    f = F.get_format(fmt)
    dim = x.shape[-1]
    b_ref = F.encode_reference(x, f)
    b = encode(x, fmt)
    assert b.dtype == torch.uint8 and b.shape == b_ref.shape
    bad = (b != b_ref).nonzero()
    assert bad.numel() == 0, f"{fmt}: encode differs at {bad[:5].tolist()}"
    assert same_bits(decode(b, fmt, dim), F.decode_reference(b_ref, f, dim)), f"{fmt}: decode"
    qd, qd_ref = quant_dequant(x, fmt), F.quant_dequant_reference(x, f)
    assert same_bits(qd, qd_ref), f"{fmt}: quant_dequant"


def wide_random(rows: int, dim: int, g: torch.Generator) -> torch.Tensor:
    """Values over many magnitudes: per-row, per-16 and per-element gains 2^[-60, 60]."""
    x = torch.randn(rows, dim, generator=g)
    x *= torch.exp2(torch.randn(rows, 1, generator=g) * 12)
    x *= torch.exp2(torch.randn(rows, dim // 16, generator=g) * 6).repeat_interleave(16, -1)
    x *= torch.exp2(torch.randn(rows, dim, generator=g) * 3)
    return x


def sprinkle(x: torch.Tensor, g: torch.Generator, n: int = 24) -> torch.Tensor:
    flat = x.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)
    big = torch.finfo(torch.float32).max
    specials = [NAN, -NAN, INF, -INF, -0.0, 0.0, 1e-45, -1e-45, 1.17549435e-38, big, -big,
                2.0 ** -140]
    for k, v in enumerate(specials):
        flat[idx[k * n:(k + 1) * n]] = v
    return x


# ---------------------------------------------------------------------------------------------
# random data, many magnitudes, every format, several dims and shapes
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,dim", CASES)
def test_random_many_magnitudes(backend, fmt, dim):
    g = torch.Generator().manual_seed(dim * 7 + len(fmt))
    check_all(wide_random(97, dim, g), fmt)
    check_all(torch.randn(5, dim, generator=g), fmt)


@pytest.mark.parametrize("fmt,dim", CASES)
def test_random_with_specials(backend, fmt, dim):
    g = torch.Generator().manual_seed(dim * 11 + len(fmt))
    x = sprinkle(wide_random(64, dim, g), g, n=max(1, dim // 64))
    check_all(x, fmt)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shapes_dtypes_layouts(backend, fmt, dtype):
    g = torch.Generator().manual_seed(5)
    dim = F.get_format(fmt).default_dim
    for shape in [(dim,), (2, 3, dim), (0, dim), (1, 0, dim), (3, 1, dim)]:
        check_all((torch.randn(shape, generator=g) * 5).to(dtype), fmt)
    wide = (torch.randn(dim, 6, generator=g) * 5).to(dtype).t()        # non-contiguous input
    assert not wide.is_contiguous()
    check_all(wide, fmt)
    f = F.get_format(fmt)
    buf = encode(torch.randn(4, dim + 2 * f.block if fmt != "v4_fp8" else dim + 64,
                             generator=g), fmt)
    b = buf[:, : f.bytes_per_entry(dim)]                                # strided rows
    assert same_bits(decode(b, fmt, dim), F.decode_reference(b, f, dim))


def test_multi_chunk_and_threads(backend, monkeypatch):
    """Inputs split over many row chunks (torch path) / parallel_for ranges (ext)."""
    monkeypatch.setattr(codecs, "CHUNK_VALUES", 1024)
    g = torch.Generator().manual_seed(9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for fmt in ALL_FORMATS:
            dim = F.get_format(fmt).default_dim
            check_all(sprinkle(wide_random(300, dim, g), g, n=4), fmt)
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# decode: every byte value, under every scale byte
# ---------------------------------------------------------------------------------------------

def all_byte_entries(fmt: str, dim: int) -> torch.Tensor:
    """Entries in which every element byte value occurs under every scale byte value."""
    f = F.get_format(fmt)
    nbytes = f.bytes_per_entry(dim)
    if fmt == "v4_fp8":
        nope = dim - f.rope
        tiles = nope // f.block
        data = torch.arange(256 * 256) % 256                           # element bytes
        per_entry = nope
        rows = -(-data.numel() // per_entry)
        out = torch.zeros(rows, nbytes, dtype=torch.uint8)
        d = torch.arange(rows * per_entry) % 256
        out[:, :nope] = d.view(rows, nope).to(torch.uint8)
        # scale byte: cycles so each tile of 64 bytes (a quarter of 0..255) meets every scale
        sc = (torch.arange(rows * tiles) // 4) % 256
        out[:, nope + 2 * f.rope: nope + 2 * f.rope + tiles] = sc.view(rows, tiles).to(torch.uint8)
        rope = torch.arange(rows * 2 * f.rope) % 256                    # every bf16 byte
        out[:, nope: nope + 2 * f.rope] = rope.view(rows, -1).to(torch.uint8)
        return out
    nd, tiles = f.data_bytes(dim), dim // f.block
    per_tile = nd // tiles                                              # data bytes per tile
    # tile k of the sequence: data bytes (k * per_tile .. ) mod 256, scale byte (k // reps) % 256
    reps = 256 // per_tile                                              # tiles to cover 0..255
    n_tiles = 256 * reps
    rows = -(-n_tiles // tiles)
    k = torch.arange(rows * tiles)
    data = (k.unsqueeze(1) * per_tile + torch.arange(per_tile)) % 256
    scale = (k // reps) % 256
    out = torch.empty(rows, nbytes, dtype=torch.uint8)
    out[:, :nd] = data.view(rows, nd).to(torch.uint8)
    out[:, nd:] = scale.view(rows, tiles).to(torch.uint8)
    return out


@pytest.mark.parametrize("fmt,dim", CASES)
def test_decode_all_bytes_all_scales(backend, fmt, dim):
    f = F.get_format(fmt)
    b = all_byte_entries(fmt, dim)
    got, ref = decode(b, fmt, dim), F.decode_reference(b, f, dim)
    assert same_bits(got, ref)
    if fmt != "v4_fp8":   # the sweep really covers every (element byte, scale byte) pair
        nd, tiles = f.data_bytes(dim), dim // f.block
        data = b[:, :nd].reshape(-1, nd // tiles).long()
        sc = b[:, nd:].reshape(-1, 1).long().expand_as(data)
        assert torch.unique(sc * 256 + data).numel() == 256 * 256


# ---------------------------------------------------------------------------------------------
# exhaustive special values
# ---------------------------------------------------------------------------------------------

def f32_from_bits(b: torch.Tensor) -> torch.Tensor:
    b = torch.where(b >= 2 ** 31, b - 2 ** 32, b)
    return b.to(torch.int32).view(torch.float32)


def dense_float_sweep() -> torch.Tensor:
    """Every float32 exponent/sign/top-7-mantissa pattern with 8 low-bit patterns (~262k values):
    zeros, subnormals, normals, inf, NaNs of both signs."""
    hi = torch.arange(1 << 15, dtype=torch.int64) << 17
    lo = torch.tensor([0, 1, 0xFFFF, 0x10000, 0x10001, 0x1FFFF, 0x8000, 0x5A5A], dtype=torch.int64)
    return f32_from_bits((hi.unsqueeze(1) + lo).view(-1))


def e2m1_ties() -> list[float]:
    """Every E2M1 decision boundary and grid value, +-1 ulp, both signs, and saturation."""
    out = []
    for v in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0):
        t = torch.tensor([v], dtype=torch.float32)
        for w in (t, torch.nextafter(t, torch.tensor([INF])), torch.nextafter(t, torch.tensor([0.0]))):
            out += [w.item(), -w.item()]
    return out + [6.0001, -6.0001, 7.0, 100.0, -1e30, 0.0, -0.0, 1e-40, -1e-40]


def e4m3_ties() -> list[float]:
    """Every positive E4M3 value and midpoint, +-1 ulp, both signs (448 saturation included)."""
    vals = N.e4m3_decode(torch.arange(127, dtype=torch.uint8))           # 0 .. 448, increasing
    mids = (vals[:-1].double() + vals[1:].double()) / 2
    pts = torch.cat((vals, mids.float(), torch.tensor([464.0, 480.0, 1e9])))
    up = torch.nextafter(pts, torch.full_like(pts, INF))
    down = torch.nextafter(pts, torch.zeros_like(pts))
    allp = torch.cat((pts, up, down))
    return torch.cat((allp, -allp)).tolist()


def tiles_around(values: list[float] | torch.Tensor, fmt: str, anchor: float) -> torch.Tensor:
    """Rows of ``dim`` = one block per row: [anchor, v, v, ...] so the scale is fixed by anchor."""
    f = F.get_format(fmt)
    block = f.block
    v = torch.as_tensor(values, dtype=torch.float32).view(-1)
    per = block - 1
    n = -(-v.numel() // per)
    pad = torch.zeros(n * per)
    pad[: v.numel()] = v
    t = torch.cat((torch.full((n, 1), anchor), pad.view(n, per)), 1)
    if fmt == "v4_fp8":
        t = torch.cat((t, torch.zeros(n, f.rope)), 1)                    # + the RoPE dims
    return t


@pytest.mark.parametrize("fmt", ["kv_fp4", "index_fp4"])
def test_e2m1_ties_and_saturation_exact(backend, fmt):
    # anchor 6 gives s = 1 exactly (kv_fp4: E4M3(6/6) = 1; index_fp4: 2^ceil(log2 1) = 1): t = x
    ties = [v for v in e2m1_ties() if abs(v) <= 6.0]
    x = tiles_around(ties, fmt, 6.0)
    assert (F.encode_reference(x, fmt)[:, -1] == (0x38 if fmt == "kv_fp4" else 127)).all()
    check_all(x, fmt)
    check_all(tiles_around([v for v in e2m1_ties() if abs(v) > 6.0], fmt, 6.0), fmt)
    # kv_fp4 saturation: amax 6.2 rounds to s = E4M3(1.0333) = 1, so t up to 6.2 saturates at 6
    if fmt == "kv_fp4":
        check_all(tiles_around([6.1, -6.2, 6.0625, 5.99], fmt, 6.2), fmt)


@pytest.mark.parametrize("fmt", ["window_fp8", "v4_fp8"])
def test_e4m3_ties_and_saturation_exact(backend, fmt):
    f = F.get_format(fmt)
    anchor = 448.0
    probe = F.encode_reference(tiles_around([0.0], fmt, anchor), fmt)
    nope = f.block if fmt == "window_fp8" else probe.shape[-1] - 2 * f.rope - 2
    sb = probe[0, nope if fmt == "window_fp8" else probe.shape[-1] - 2].item()
    s = 2.0 ** (sb - 127)
    x = tiles_around([v * s for v in e4m3_ties() if abs(v) <= 448], fmt, anchor * s)
    check_all(x, fmt)
    check_all(tiles_around(e4m3_ties(), fmt, 1e9), fmt)                 # large t: saturation


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_dense_float_sweep(backend, fmt):
    """~262k float32 patterns as elements, in tiles anchored at a normal value and in tiles of
    their own (NaN/inf poison their tile, huge values set the scale)."""
    sweep = dense_float_sweep()
    finite = sweep[torch.isfinite(sweep)]
    anchor = {"kv_fp4": 6.0, "index_fp4": 6.0, "window_fp8": 448.0, "v4_fp8": 448.0}[fmt]
    check_all(tiles_around(finite[finite.abs() <= anchor], fmt, anchor), fmt)
    f = F.get_format(fmt)
    dim = f.default_dim
    g = torch.Generator().manual_seed(13)
    perm = sweep[torch.randperm(sweep.numel(), generator=g)]
    n = perm.numel() // dim * dim
    check_all(perm[:n].view(-1, dim), fmt)
    # small tiles of tiny values (scale floors, subnormal t), and of single specials
    tiny = finite[(finite.abs() < 1e-30)]
    check_all(tiles_around(tiny, fmt, 1e-32), fmt)
    for special in (NAN, -NAN, INF, -INF, -0.0, 0.0):
        check_all(tiles_around([special, -1.0, 1.0, -0.0], fmt, 2.0), fmt)


def test_poisoned_tiles_keep_sign_of_x(backend):
    """A NaN scale: E2M1 stores code 0 with the sign of x, whatever the NaN's own sign."""
    for fmt in ("kv_fp4", "index_fp4"):
        x = tiles_around([-1.0, 2.0, -0.0, 0.0, -INF, INF, -NAN, NAN], fmt, NAN)
        check_all(x, fmt)
        x2 = tiles_around([-1.0, 2.0, -0.0, -3.0], fmt, -NAN)
        check_all(x2, fmt)


# ---------------------------------------------------------------------------------------------
# the tables: computed from the reference, uniform on every round-to-odd class
# ---------------------------------------------------------------------------------------------

def test_tables_come_from_reference():
    t = tables.CPU
    byte = torch.arange(256).to(torch.uint8)
    assert same_bits(t["e4m3"], N.e4m3_decode(byte))
    assert same_bits(t["ue8m0"], N.ue8m0_decode(byte))
    pair = t["e2m1_pair"].view(torch.float32).view(256, 2)
    assert same_bits(pair[:, 0], N.e2m1_decode_reference(byte & 0xF))
    assert same_bits(pair[:, 1], N.e2m1_decode_reference(byte >> 4))
    members = tables.e2m1_class_members()
    v = members.view(torch.float32)
    cls = torch.arange(4096).unsqueeze(1).expand_as(members)
    # every member's class index is its row, and its table code is the readable reference's
    idx = torch.empty(v.numel(), dtype=torch.int32)
    assert torch.equal(codecs._e2m1_index(v.contiguous(), idx).view_as(cls).long(), cls)
    assert torch.equal(t["e2m1_code"][cls], N.e2m1_encode_reference(v))
    assert same_bits(t["e2m1_value"], N.e2m1_decode_reference(t["e2m1_code"]))


def test_e4m3_class_table():
    """The extension's E4M3 element table: uniform on every class (extremes, centre and its
    neighbours == the class point), and == the reference e4m3_encode on the dense sweep and on
    every E4M3 value / midpoint +-1 ulp."""
    table = tables.e4m3_code_table()
    members = tables.class_members(18)
    assert torch.equal(table[torch.arange(16384).unsqueeze(1).expand_as(members)],
                       N.e4m3_encode(members.view(torch.float32)))
    for v in (dense_float_sweep(), torch.tensor(e4m3_ties(), dtype=torch.float32)):
        b = v.view(torch.int32).long() & 0xFFFFFFFF
        cls = ((b >> 18) & 0x3FFF) | ((b & 0x3FFFF) != 0).long()
        assert torch.equal(table[cls], N.e4m3_encode(v))


def test_e2m1_table_on_dense_sweep():
    """The class table == the reference E2M1 encoder on ~262k float32 patterns (all signs,
    exponents, NaN, inf, subnormals), directly at the element level."""
    v = dense_float_sweep()
    idx = torch.empty(v.numel(), dtype=torch.int32)
    got = tables.CPU["e2m1_code"][codecs._e2m1_index(v, idx).long()]
    assert torch.equal(got, N.e2m1_encode_reference(v))
    assert torch.equal(got, N.e2m1_encode(v))


# ---------------------------------------------------------------------------------------------
# the switch
# ---------------------------------------------------------------------------------------------

def test_toggle_switches_paths(monkeypatch):
    calls = []
    for name in ("encode_reference", "decode_reference", "quant_dequant_reference"):
        real = getattr(F, name)
        monkeypatch.setattr(F, name, lambda *a, _r=real, _n=name: (calls.append(_n), _r(*a))[1])
    for name in ("encode", "decode", "quant_dequant"):
        real = getattr(codecs, "fast_" + name)
        monkeypatch.setattr(codecs, "fast_" + name, lambda *a, _r=real, _n=name: (
            calls.append("fast." + _n), _r(*a))[1])
    x = torch.randn(2, 128)
    prev = gate.set_reference_kernels(False)
    try:
        b = encode(x, "index_fp4"); decode(b, "index_fp4", 128); quant_dequant(x, "index_fp4")
        assert calls == ["fast.encode", "fast.decode", "fast.quant_dequant"]
        assert gate.active_backend() in ("ext", "torch")
        calls.clear()
        with gate.reference_kernels_forced():
            assert gate.reference_kernels() and gate.active_backend() == "reference"
            b = encode(x, "index_fp4"); decode(b, "index_fp4", 128); quant_dequant(x, "index_fp4")
        assert calls == ["encode_reference", "decode_reference", "quant_dequant_reference"]
        assert not gate.reference_kernels()
    finally:
        gate.set_reference_kernels(prev)


def test_env_flag_values():
    for v in ("1", "true", "yes", "on", " 1 "):
        assert gate._env_flag(v)
    for v in (None, "", "0", "false", "no", "off", "OFF"):
        assert not gate._env_flag(v)


@pytest.mark.parametrize("value,forced", [("1", True), ("0", False)])
def test_env_var_read_at_import(value, forced):
    env = dict(os.environ, CEDLM_REFERENCE_KERNELS=value)
    code = ("from cedlm.kernels import gate, encode; import torch; encode(torch.zeros(1, 128), "
            "'index_fp4'); print(gate.reference_kernels(), gate.active_backend())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[0] == str(forced)
    assert (out[1] == "reference") == forced


def test_missing_extension_logs_once_and_falls_back(monkeypatch, caplog):
    from cedlm.kernels import build
    monkeypatch.setattr(build, "load", lambda *a: (None, "not built (test)"))
    monkeypatch.setattr(gate, "_ext_state", {})
    monkeypatch.setattr(gate, "_backend", "auto")
    prev = gate.set_reference_kernels(False)
    try:
        with caplog.at_level(logging.WARNING, logger="cedlm.quant"):
            x = torch.randn(3, 512)
            for _ in range(3):
                b = encode(x, "kv_fp4")
                assert torch.equal(b, F.encode_reference(x, "kv_fp4"))
        lines = [r for r in caplog.records if "compiled KV codecs unavailable" in r.getMessage()]
        assert len(lines) == 1 and "not built (test)" in lines[0].getMessage()
        assert gate.active_backend() == "torch"
        with pytest.raises(RuntimeError):
            gate.set_fast_backend("ext")
    finally:
        gate.set_reference_kernels(prev)


def test_stale_build_is_not_loaded(monkeypatch, tmp_path):
    from cedlm.kernels import build
    monkeypatch.setenv(build.DIR_VAR, str(tmp_path))
    d = build.build_dir()
    assert d.parent == tmp_path and len(d.name) == 16
    assert build.load()[0] is None and "not built" in build.status()[1]
    d.mkdir()
    (d / f"{build.NAME}.so").write_bytes(b"")
    (d / f"{build.NAME}.stamp").write_text("0" * 64)
    assert build.load()[0] is None and "incomplete build" in build.status()[1]
