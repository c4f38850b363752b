"""The custom ops' CPU kernels in C++ (cedlm/kernels/csrc/dispatch.h), registered with torch's
dispatcher once the compiled module is loaded: what the compiled steps' generated C++ calls.

* Each op has its own CPU kernel beside the Python kernel (CompositeExplicitAutograd) of ops.py.
* Through the dispatcher, every op gives exactly what its Python kernel gives (bit for bit), for
  each V4.1 format, batched, strided and zero-row inputs, and the formats the extension does not
  code.
* Routing: while the gate answers "ext" the C++ kernel never calls Python; with the reference
  forced or the torch backend chosen, it calls the Python kernel (a spy registered in its place
  sees the call), and the results follow the switch (the reference's bytes).
"""
from __future__ import annotations

import pytest
import torch

from cedlm.kernels import gate, ops
from cedlm.quant import formats as F

pytestmark = pytest.mark.skipif(gate.ext_op("encode") is None,
                                reason="compiled extension not built (or reference kernels forced)")
OPS = ("encode", "decode", "quant_dequant", "index_score", "stable_topk", "attend",
       "attend_packed")
cedlm = torch.ops.cedlm


def _same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _cases(seed: int = 0):
    """(op name, args) covering each op and format; strided and batched tensors included."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)                             # noqa: E731
    out = []
    for fmt in ("kv_fp4", "index_fp4", "window_fp8", "v4_fp8"):
        dim = 512 if fmt in ("kv_fp4", "v4_fp8") else 128
        x = r(3, 5, dim) * 4
        out += [("encode", (x, fmt)), ("encode", (x[:, 1:4], fmt)),     # strided rows
                ("quant_dequant", (x, fmt)), ("quant_dequant", (x.double(), fmt)),
                ("decode", (ops.encode(x, fmt), fmt, dim)),
                ("encode", (x[:, :0], fmt)), ("quant_dequant", (x[:, :0], fmt)),   # zero rows
                ("decode", (ops.encode(x, fmt)[:, :0], fmt, dim))]
    out.append(("encode", (r(2, 256), "bf16")))                         # not an extension format
    B, T, H, hd, N, W, k, R = 2, 3, 4, 128, 37, 6, 5, 40
    raw = ops.encode(r(B, N, hd), "index_fp4")
    vis = torch.rand(B, T, N, generator=g) > 0.3
    out += [("index_score", (r(B, T, H, hd), r(B, T, H), raw, vis, "index_fp4")),
            ("index_score", (r(B, T, H, hd), r(B, T, H), raw[:, :0], vis[..., :0], "index_fp4"))]
    score = r(B, T, N)
    score[0, 0, :10] = 1.0                                               # ties
    out += [("stable_topk", (score, 7)), ("stable_topk", (score.double(), 7))]
    wv, cv = torch.rand(B, T, W, generator=g) > 0.3, torch.rand(B, T, k, generator=g) > 0.2
    out.append(("attend", (r(B, T, H, hd), r(B, W, hd), wv, r(B, T, k, hd), cv, r(H), 0.08)))
    for wfmt, cfmt in (("window_fp8", "kv_fp4"), ("", "kv_fp4"), ("window_fp8", "v4_fp8")):
        wrows = r(R, hd) if wfmt == "" else ops.encode(r(R, hd), wfmt)
        crows = ops.encode(r(R, hd) * 3, cfmt)
        out.append(("attend_packed", (r(B, T, H, hd), wrows, torch.randint(0, R, (B, W), generator=g),
                                      wv, wfmt, crows, torch.randint(0, R, (B, T, k), generator=g),
                                      cv, cfmt, r(H), 0.08)))
    return out


@pytest.mark.parametrize("name", OPS)
def test_every_op_has_a_cpu_kernel_of_its_own(name):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"cedlm::{name}", "CPU")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"cedlm::{name}",
                                                           "CompositeExplicitAutograd")


def test_dispatcher_kernels_equal_the_python_kernels():
    for name, args in _cases():
        got, want = getattr(cedlm, name)(*args), getattr(ops, name)(*args)
        assert _same(got, want), (name, [getattr(a, "shape", a) for a in args])


@pytest.fixture
def spies():
    """Replace the Python kernels the C++ kernels fall back to by recording wrappers."""
    mod, calls = gate.compiled(), []
    def spy(name):
        fn = getattr(ops, name)
        def wrapped(*a):
            calls.append(name)
            return fn(*a)
        return wrapped
    mod.register_ops({}, {n: spy(n) for n in OPS})
    try:
        yield calls
    finally:
        mod.register_ops({}, {n: getattr(ops, n) for n in OPS})


def test_the_ext_path_stays_in_cpp_and_the_switches_reach_python(spies):
    cases = [(n, a) for n, a in _cases(1)
             if not any(isinstance(v, str) and v in ("v4_fp8", "bf16") for v in a)
             and not (n in ("quant_dequant", "stable_topk") and a[0].dtype == torch.float64)
             and not (n == "index_score" and a[2].shape[1] == 0)]
    for name, args in cases:
        getattr(cedlm, name)(*args)
    assert spies == []                                 # the extension ran, no Python kernel
    x = torch.randn(4, 128) * 3
    want_ext = cedlm.encode(x, "window_fp8")
    with gate.reference_kernels_forced():
        for name, args in cases:
            assert _same(getattr(cedlm, name)(*args), getattr(ops, name)(*args)), name
        assert torch.equal(cedlm.encode(x, "window_fp8"), F.encode_reference(x, "window_fp8"))
    assert sorted(set(spies)) == sorted(OPS)
    del spies[:]
    prev = gate.set_fast_backend("torch")
    try:
        assert torch.equal(cedlm.encode(x, "window_fp8"), want_ext)
    finally:
        gate.set_fast_backend(prev)
    assert spies == ["encode"]
    del spies[:]
    cedlm.encode(x, "window_fp8")
    cedlm.encode(torch.randn(2, 512), "v4_fp8")            # a format the extension does not code
    assert spies == ["encode"]


def test_compiled_graph_calls_the_cpu_kernel(spies):
    f = torch.compile(lambda x: cedlm.encode(x * 2.0, "kv_fp4"), fullgraph=True, dynamic=False)
    x = torch.randn(3, 512)
    assert torch.equal(f(x), ops.encode(x * 2.0, "kv_fp4"))
    assert spies == []
