"""The KV codecs on any device: bit-identical to the CPU reference, gated off the C++ kernels.

* ``test_codecs_on_device_match_cpu_reference``: encode / decode / quant_dequant of every format
  on ``device`` (``DEVICES``: the CPU always, CUDA when present) against the readable reference
  on the CPU, BIT FOR BIT (bytes; float32 bit patterns, NaN payloads and signs included), on
  adversarial inputs: every E2M1 / E4M3 decision point and its neighbours, the scale rules'
  boundaries, subnormals, zeros of both signs, infinities and NaNs, huge and tiny tiles.
* The path a GPU runs can be exercised here: ``numerics.DEVICE_PATH_ON_CPU`` makes the CPU run it
  (no host syncs, E4M3 by table), and ``CudaLikeArithmetic`` gives the CPU's float32 kernels the
  two behaviours in which CUDA's differ from x86's (a NaN result is the canonical 0x7FFFFFFF; a
  division by a CPU scalar is a multiplication by its float32 reciprocal). The codecs must not
  notice either.
* The compiled-kernel gates answer "torch path" for any tensor off the CPU; the custom ops
  ``torch.ops.cedlm.*`` have CPU, CUDA and fake kernels and run under a fake CUDA
  ``FakeTensorMode``; the codecs run under ``implicit_device_guard()`` unchanged.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cedlm.kernels import codecs, decode, encode, gate, ops, quant_dequant
from cedlm.quant import formats as F
from cedlm.quant import numerics as N
from tests.devices import DEVICES, FAKE_DEVICE, implicit_device_guard
from tests.test_quant_fast import (all_byte_entries, dense_float_sweep, e2m1_ties, e4m3_ties,
                                   sprinkle, tiles_around, wide_random)

NAN, INF = float("nan"), float("inf")
FORMATS = ("kv_fp4", "index_fp4", "window_fp8", "v4_fp8")
aten = torch.ops.aten


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.int32)


def scale_boundaries(fmt: str) -> list[float]:
    """Tile maxima at and around every point where the format's scale byte changes."""
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)            # noqa: E731
    pts = []
    if fmt == "kv_fp4":            # amax / 6 at E4M3 values and midpoints; the clamp ends
        v = N.e4m3_decode(torch.arange(1, 127, dtype=torch.uint8)).double()
        pts = torch.cat((v, (v[:-1] + v[1:]) / 2)) * 6
        pts = torch.cat((pts, torch.tensor([6 * 2.0 ** -9, 6 * 448.0, 1e-30, 3e38])))
    elif fmt == "index_fp4":       # amax / 6 at powers of two; the 6 * 2^-126 floor
        pts = torch.tensor([6 * 2.0 ** k for k in range(-126, 127)] + [1e-40, 3e38])
    else:                          # amax / 448 at powers of two; the 1e-4 floor
        pts = torch.tensor([448 * 2.0 ** k for k in range(-140, 120)] + [1e-4, 1e-5, 3e38])
    p = pts.float()
    p = p[torch.isfinite(p) & (p > 0)]
    up, down = torch.nextafter(p, f32(INF)), torch.nextafter(p, f32(0.0))
    return torch.cat((p, up, down)).tolist()


def adversarial(fmt: str) -> torch.Tensor:
    """Rows of one entry each (the format's default dim) holding the hard cases."""
    f = F.get_format(fmt)
    dim = f.default_dim
    g = torch.Generator().manual_seed(31)
    parts = []
    anchor = 6.0 if f.element == "e2m1" else 448.0
    if fmt in ("kv_fp4", "index_fp4"):
        parts.append(tiles_around(e2m1_ties(), fmt, 6.0))
    else:
        parts.append(tiles_around(e4m3_ties(), fmt, 448.0))
        parts.append(tiles_around(e4m3_ties(), fmt, 1e9))
    for amax in scale_boundaries(fmt):              # each max over a tile of its ties
        parts.append(tiles_around([amax / 2, -amax / 3, amax / 6, -0.0, 1e-45], fmt, amax))
    sweep = dense_float_sweep()
    finite = sweep[torch.isfinite(sweep)]
    parts.append(tiles_around(finite[finite.abs() <= anchor], fmt, anchor))
    parts.append(tiles_around(finite[finite.abs() < 1e-30], fmt, 1e-32))       # subnormal t
    for special in (NAN, -NAN, INF, -INF, -0.0, 0.0):
        parts.append(tiles_around([special, -1.0, 1.0, -0.0, -NAN], fmt, 2.0))
    parts.append(tiles_around([-1.0, 2.0, -0.0, 0.0, -INF, INF, -NAN, NAN], fmt, -NAN))
    x = torch.cat([p.reshape(-1) for p in parts])
    x = torch.cat((x, torch.zeros(-x.numel() % dim)))
    rows = [x.view(-1, dim), sprinkle(wide_random(64, dim, g), g, n=4),
            torch.zeros(2, dim), torch.full((1, dim), -0.0)]
    perm = sweep[torch.randperm(sweep.numel(), generator=g)]
    rows.append(perm[: perm.numel() // dim * dim].view(-1, dim))
    x = torch.cat(rows)
    if fmt == "v4_fp8":     # its RoPE dims are a bf16 cast: a NaN's bits are each kernel's own
        rope = x[:, dim - f.rope:]
        rope[torch.isnan(rope)] = 1.0
    return x


def reference_outputs(x: torch.Tensor, fmt: str):
    f = F.get_format(fmt)
    b = F.encode_reference(x, f)
    raw = all_byte_entries(fmt, f.default_dim)
    return (b, F.decode_reference(b, f, x.shape[-1]), F.quant_dequant_reference(x, f),
            raw, F.decode_reference(raw, f, f.default_dim))


def assert_matches_reference(fmt: str, device: str | torch.device) -> None:
    x = adversarial(fmt)
    b_ref, d_ref, q_ref, raw, raw_ref = reference_outputs(x, fmt)
    dim = x.shape[-1]
    xd = x.to(device)
    b = encode(xd, fmt)
    assert b.device.type == torch.device(device).type and b.dtype == torch.uint8
    bad = (b.cpu() != b_ref).nonzero()
    assert bad.numel() == 0, f"{fmt} on {device}: encode differs at {bad[:5].tolist()}"
    for name, got, ref in (("decode", decode(b, fmt, dim), d_ref),
                           ("quant_dequant", quant_dequant(xd, fmt), q_ref),
                           ("decode(every byte)",
                            decode(raw.to(device), fmt, F.get_format(fmt).default_dim), raw_ref)):
        assert got.dtype == torch.float32 and got.shape == ref.shape, name
        diff = (bits(got) != bits(ref)).nonzero()
        assert diff.numel() == 0, f"{fmt} on {device}: {name} differs at {diff[:5].tolist()}"


@pytest.fixture
def torch_backend():
    prev_ref, prev = gate.set_reference_kernels(False), gate.set_fast_backend("torch")
    yield
    gate.set_fast_backend(prev)
    gate.set_reference_kernels(prev_ref)


@pytest.fixture
def device_path(monkeypatch, torch_backend):
    """The CPU runs the codec path a GPU runs."""
    monkeypatch.setattr(N, "DEVICE_PATH_ON_CPU", True)


# ---------------------------------------------------------------------------------------------
# bit identity: on each device, and on the CPU through the device path under CUDA's arithmetic
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_codecs_on_device_match_cpu_reference(device, fmt):
    assert_matches_reference(fmt, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["kv_fp4", "index_fp4", "window_fp8"])
def test_reference_on_device_matches_cpu_reference(device, fmt):
    """The readable reference itself (``CEDLM_REFERENCE_KERNELS=1``) on ``device``."""
    prev = gate.set_reference_kernels(True)
    try:
        assert_matches_reference(fmt, device)
    finally:
        gate.set_reference_kernels(prev)


def test_e4m3_decode_is_the_float8_cast():
    """``numerics.e4m3_decode`` (bit arithmetic) gives torch's float8_e4m3fn cast's bits on the
    CPU, for all 256 bytes, NaNs included."""
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(bits(N.e4m3_decode(b)), bits(b.view(torch.float8_e4m3fn).to(torch.float32)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_device_path_on_cpu_matches_reference(device_path, fmt):
    assert_matches_reference(fmt, "cpu")


_ARITH = {aten.mul, aten.mul_, aten.div, aten.div_, aten.add, aten.add_, aten.sub, aten.sub_,
          aten.amax, aten.max}


class CudaLikeArithmetic(TorchDispatchMode):
    """CPU float32 arithmetic as CUDA's kernels do it where the two differ: every NaN result of
    an arithmetic op or a max is the canonical 0x7FFFFFFF (CUDA propagates no payload or sign),
    and ``a / b`` with a Python number b is ``a * float32(1 / float32(b))`` (ATen's CUDA
    division by a CPU scalar)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pk = func.overloadpacket
        if (pk in (aten.div, aten.div_) and len(args) > 1 and isinstance(args[1], (int, float))
                and args[0].dtype == torch.float32 and not kwargs):
            one = torch.ones((), dtype=torch.float32)
            recip = one / torch.tensor(float(args[1]), dtype=torch.float32)
            out = (aten.mul_ if pk is aten.div_ else aten.mul).Tensor(args[0], recip)
        else:
            out = func(*args, **kwargs)
        if pk in _ARITH:
            for t in out if isinstance(out, tuple) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    t.view(torch.int32).masked_fill_(torch.isnan(t), 0x7FFFFFFF)
        return out


def test_cuda_like_arithmetic_bites():
    """The emulation really differs from the CPU: some quotients by a scalar, and NaN bits."""
    x = dense_float_sweep()
    x = x[torch.isfinite(x) & (x.abs() > 1e-30) & (x.abs() < 1e30)]
    with CudaLikeArithmetic():
        q, n = x / 6.0, torch.tensor([-NAN, 1.0]) * torch.tensor([2.0, NAN])
    assert not torch.equal(bits(q), bits(x / 6.0))
    assert bits(n).tolist() == [0x7FFFFFFF, 0x7FFFFFFF]


@pytest.mark.parametrize("path", ["device", "reference"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_device_path_ignores_cuda_arithmetic(device_path, fmt, path):
    """The GPU's path (and the readable reference) under CUDA's arithmetic: the same bits."""
    gate.set_reference_kernels(path == "reference")      # the fixture restores it
    x = adversarial(fmt)
    b_ref, d_ref, q_ref, raw, raw_ref = reference_outputs(x, fmt)
    dim = x.shape[-1]
    with CudaLikeArithmetic():
        b = encode(x, fmt)
        got = (decode(b_ref, fmt, dim), quant_dequant(x, fmt),
               decode(raw, fmt, F.get_format(fmt).default_dim))
    assert torch.equal(b, b_ref), f"{fmt}: encode"
    for name, g, ref in zip(("decode", "quant_dequant", "decode(every byte)"), got,
                            (d_ref, q_ref, raw_ref)):
        assert torch.equal(bits(g), bits(ref)), f"{fmt}: {name}"


@pytest.mark.parametrize("fmt", ["kv_fp4", "index_fp4", "window_fp8"])
def test_scale_division_is_correctly_rounded(fmt):
    """The scale rules divide in IEEE float32 (one rounding): equal to the quotient computed in
    float64 and rounded once (exact: 53 >= 2 * 24 + 2 bits), never to a reciprocal product."""
    f = F.get_format(fmt)
    sweep = dense_float_sweep()
    amax = torch.cat((sweep[torch.isfinite(sweep) & (sweep > 0)],
                      torch.tensor(scale_boundaries(fmt), dtype=torch.float32)))
    got = F.scale_bytes_from_amax(amax.clone(), f)
    if fmt == "kv_fp4":
        y = (amax.double() / 6).float().clamp(2.0 ** -9, 448.0)
        want = N.e4m3_encode(y)
    elif fmt == "index_fp4":
        want = N.ue8m0_ceil((amax.clamp_min(6 * 2.0 ** -126).double() / 6).float())
    else:   # the rule multiplies by fp32(1/448), once rounded
        inv = torch.tensor(1 / 448, dtype=torch.float32).double()
        want = N.ue8m0_ceil((amax.clamp_min(1e-4).double() * inv).float())
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", ["torch", pytest.param("ext", marks=pytest.mark.skipif(
    gate.compiled() is None, reason="compiled codecs not built (python -m cedlm.kernels.build)"))])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fast_backends_match_reference_on_adversarial_inputs(backend, fmt):
    prev_ref, prev = gate.set_reference_kernels(False), gate.set_fast_backend(backend)
    try:
        assert_matches_reference(fmt, "cpu")
    finally:
        gate.set_fast_backend(prev)
        gate.set_reference_kernels(prev_ref)


# ---------------------------------------------------------------------------------------------
# the gates, the custom ops, the implicit-device guard
# ---------------------------------------------------------------------------------------------

def test_gates_refuse_tensors_off_the_cpu():
    """Every compiled-kernel gate answers "torch path" for a tensor not on the CPU (``meta``
    stands in for CUDA here), whatever the backend."""
    cpu, meta = torch.zeros(2, 4), torch.zeros(2, 4, device="meta")
    assert gate.codec_module(meta) is None and gate.codec_module(cpu, meta) is None
    assert gate.inference_op("stable_topk", meta) is None
    for name in ("index_score", "stable_topk", "attend_sparse", "attend_packed", "mhc_mixes"):
        assert gate.ext_op(name, meta) is None and gate.ext_op(name, cpu, meta) is None
    f = F.get_format("kv_fp4")
    assert codecs._ext_for(f, meta) == (None, -1)
    if gate.compiled() is not None and gate.active_backend() == "ext":
        assert gate.ext_op("stable_topk", cpu) is not None
        assert codecs._ext_for(f, cpu)[0] is not None


OPS = ("encode", "decode", "quant_dequant", "index_score", "stable_topk", "attend",
       "attend_packed")


@pytest.mark.parametrize("name", OPS)
def test_custom_ops_have_cpu_cuda_and_fake_kernels(name):
    # the Python kernel is registered for every device (CompositeExplicitAutograd); the compiled
    # module adds its own CPU kernel (csrc/dispatch.h, tests/test_kernel_dispatch.py)
    for key in ("CPU", "CUDA", "Meta"):
        assert torch._C._dispatch_has_computed_kernel_for_dispatch_key(f"cedlm::{name}", key), key
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"cedlm::{name}",
                                                           "CompositeExplicitAutograd")


def _op_args(dev: str):
    """Arguments of each custom op on ``dev`` and the (shape, dtype) of each result."""
    B, T, H, hd, W, k, R = 2, 3, 4, 128, 5, 2, 7
    e = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt, device=dev)     # noqa: E731
    nb = F.bytes_per_entry("index_fp4", hd)
    rows = e(R, F.bytes_per_entry("window_fp8", hd), dt=torch.uint8)
    i64, b = torch.int64, torch.bool
    return {
        "encode": ((e(B, T, 512), "kv_fp4"), [((B, T, 288), torch.uint8)]),
        "decode": ((e(B, T, 528, dt=torch.uint8), "window_fp8", 512),
                   [((B, T, 512), torch.float32)]),
        "quant_dequant": ((e(B, T, 128), "index_fp4"), [((B, T, 128), torch.float32)]),
        "index_score": ((e(B, T, H, hd), e(B, T, H), e(B, R, nb, dt=torch.uint8), e(B, T, R, dt=b),
                         "index_fp4"), [((B, T, R), torch.float32)]),
        "stable_topk": ((e(B, T, R), k), [((B, T, k), i64), ((B, T, k), torch.float32)]),
        "attend": ((e(B, T, H, hd), e(B, W, hd), e(B, T, W, dt=b), e(B, T, k, hd),
                    e(B, T, k, dt=b), e(H), 0.1), [((B, T, H, hd), torch.float32)]),
        "attend_packed": ((e(B, T, H, hd), rows, e(B, W, dt=i64), e(B, T, W, dt=b), "window_fp8",
                           rows, e(B, T, k, dt=i64), e(B, T, k, dt=b), "window_fp8", e(H), 0.1),
                          [((B, T, H, hd), torch.float32)]),
    }


@pytest.mark.parametrize("name", OPS)
def test_custom_ops_under_fake_cuda(name):
    """Each op traced on fake CUDA tensors: the output's shape, dtype and device."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=False):
        args, want = _op_args("cuda")[name]
        out = getattr(torch.ops.cedlm, name)(*args)
    outs = out if isinstance(out, tuple) else (out,)
    assert [(tuple(o.shape), o.dtype) for o in outs] == want
    assert all(o.device.type == "cuda" for o in outs)


@pytest.mark.parametrize("name", OPS)
def test_op_kernels_take_the_torch_path_off_the_cpu(name):
    """The Python kernel registered for CUDA, run on tensors off the CPU (meta), never reaches
    the C++ kernels (which would fail on them): the torch path gives the shapes."""
    args, want = _op_args("meta")[name]
    out = getattr(ops, name)(*args)
    outs = out if isinstance(out, tuple) else (out,)
    assert [(tuple(o.shape), o.dtype) for o in outs] == want
    assert all(o.device.type == "meta" for o in outs)


@pytest.mark.parametrize("dev", sorted({"cuda", FAKE_DEVICE}))
def test_codecs_under_fake_cuda(dev):
    """The codecs themselves (what the model calls) on fake CUDA tensors (and on the harness's
    ``FAKE_DEVICE``): shapes and devices. They index with ``narrow`` and copy through the aten
    op, so they run on fake ``cuda`` even on this CPU build of torch."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=dev == "meta"):
        for fmt in FORMATS + ("bf16",):
            f = F.get_format(fmt)
            x = torch.empty(3, 5, f.default_dim, device=dev)
            b = encode(x, fmt)
            d, q = decode(b, fmt, f.default_dim), quant_dequant(x, fmt)
            assert b.shape == (3, 5, f.bytes_per_entry(f.default_dim)) and b.dtype == torch.uint8
            assert d.shape == q.shape == x.shape and d.dtype == q.dtype == torch.float32
            assert b.device.type == d.device.type == q.device.type == dev


@pytest.mark.parametrize("path", ["reference", "torch", "device", "ext"])
def test_codecs_under_implicit_device_guard(path, monkeypatch):
    """No codec makes a tensor without a device: under the guard (device-less factories land on
    ``meta``) every path gives the same bits as outside it."""
    if path == "ext" and gate.compiled() is None:
        pytest.skip("compiled codecs not built")
    monkeypatch.setattr(N, "DEVICE_PATH_ON_CPU", path == "device")
    prev_ref = gate.set_reference_kernels(path == "reference")
    prev = gate.set_fast_backend("ext" if path == "ext" else "torch")
    try:
        for fmt in FORMATS + ("bf16",):
            f = F.get_format(fmt)
            g = torch.Generator().manual_seed(3)
            x = sprinkle(wide_random(6, f.default_dim, g), g, n=2)
            want = (encode(x, fmt), quant_dequant(x, fmt))
            with implicit_device_guard():
                b, q = encode(x, fmt), quant_dequant(x, fmt)
                d = decode(b, fmt, f.default_dim)
            assert torch.equal(b, want[0]) and torch.equal(bits(q), bits(want[1])), fmt
            assert torch.equal(bits(d), bits(decode(want[0], fmt, f.default_dim))), fmt
            assert b.device.type == q.device.type == d.device.type == "cpu"
    finally:
        gate.set_fast_backend(prev)
        gate.set_reference_kernels(prev_ref)
