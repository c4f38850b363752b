"""The compiled kernels' instruction-set setting (CEDLM_KERNEL_ISA, cedlm/kernels/build.py).

The portable paths give the default path's results: the same kernels run once per setting in a
fresh process on the same inputs, and compared

* ``generic`` (a scalar build, no intrinsics) against ``sse2`` (the default build, AVX2 off):
  BIT FOR BIT, every kernel (the scalar loops keep the SSE2 lanes' order; no FP contraction);
* ``sse2`` against ``auto``: bit for bit except the indexer's scores, where ``auto`` may take the
  AVX2 + FMA scorer (8 fused lanes instead of 4): those agree within test_index_fast.py's bound
  (1e-5 of sum_h |w| |q| |k| plus 1e-5 of |score|), and bit for bit where the CPU lacks AVX2.

The ``generic`` build is made here when the cache lacks it (1-2 minutes): marked slow.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cedlm.kernels import build, gate

# One process per setting: every kernel on fixed inputs (specials included), saved to argv[1].
SCRIPT = r"""
import sys, torch
from cedlm.kernels import build, gate
from cedlm.kernels.codecs import ext_format
assert gate.active_backend() == "ext", gate.compiled_status()
op = gate.compiled
g = torch.Generator().manual_seed(0)
x = torch.randn(64, 512, generator=g) * torch.logspace(-8, 8, 64).unsqueeze(1)
x[0, :7] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 6.0, 448.0])
x[1, 5] = 1e-42
out = {"isa": build.isa(), "key": build.key()}
for fmt, dim in (("kv_fp4", 512), ("index_fp4", 128), ("window_fp8", 512)):
    kind, block = ext_format(fmt)
    xs = x[:, :dim].contiguous()
    b = op().encode(xs, kind, block)
    out[fmt + "/encode"] = b
    out[fmt + "/decode"] = op().decode(b, kind, dim, block)
    out[fmt + "/quant_dequant"] = op().quant_dequant(xs, kind, block)
B, T, H, D, N = 2, 3, 4, 128, 70
q, w = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, H, generator=g)
raw = op().encode(torch.randn(B * N, D, generator=g), *ext_format("index_fp4")).view(B, N, -1)
vis = torch.rand(B, T, N, generator=g) > 0.2
out["index_score"] = op().index_score(q, w, raw, vis, *ext_format("index_fp4"))
keys = op().decode(raw.view(B * N, -1), ext_format("index_fp4")[0], D, 32).view(B, N, D)
out["index_bound"] = torch.einsum("bthd,bnd,bth->btn", q.abs(), keys.abs(), w.abs())
s = torch.randn(3, 300, generator=g).relu()
out["stable_topk"] = op().stable_topk(s, 40)
m, base, scale = torch.randn(10, 24, generator=g), torch.randn(24, generator=g), torch.rand(3, generator=g)
out["mhc_mixes"] = op().mhc_mixes(m, base, scale, 1e-6, 20)
xr, ang = torch.randn(5, 4, 64, generator=g), torch.rand(5, 1, 8, generator=g) * 6
out["rope_rotate"] = op().rope_rotate(xr, ang.cos(), ang.sin(), 4, False)
qa, win = torch.randn(2, 1, 4, 64, generator=g), torch.randn(2, 16, 64, generator=g)
comp = torch.randn(2, 1, 8, 64, generator=g)
out["attend_sparse"] = op().attend_sparse(qa, win, torch.rand(2, 1, 16, generator=g) > 0.3, comp,
                                          torch.rand(2, 1, 8, generator=g) > 0.2,
                                          torch.randn(4, generator=g), 0.125)
torch.save(out, sys.argv[1])
"""


def _run(isa: str, path) -> dict:
    env = dict(os.environ, CEDLM_KERNEL_ISA=isa, CEDLM_REFERENCE_KERNELS="0")
    subprocess.run([sys.executable, "-c", SCRIPT, str(path)], env=env, check=True, timeout=600)
    return torch.load(path)


def _bits(t):
    if isinstance(t, (tuple, list)):
        return [_bits(u) for u in t]
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


def _same(a, b) -> bool:
    a, b = _bits(a), _bits(b)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_isa_setting_is_validated_and_keys_the_build(monkeypatch):
    monkeypatch.setenv(build.ISA_VAR, "avx9")
    with pytest.raises(ValueError, match="CEDLM_KERNEL_ISA"):
        build.isa()
    assert build.load()[0] is None and "CEDLM_KERNEL_ISA" in build.load()[1]
    monkeypatch.delenv(build.ISA_VAR)
    assert build.isa() == "auto" and build.isa(" SSE2 ") == "sse2"
    assert build.key("auto") == build.key("sse2") != build.key("generic")   # sse2: a run-time switch
    assert "-DCEDLM_CODECS_SCALAR" in build.flags("generic")
    assert not any(f.startswith("-march") for f in build.flags("auto"))       # portable build


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(build.DIR_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.build_dir() == tmp_path / "xdg" / "cedlm" / "kernels" / build.key()
    monkeypatch.setenv(build.DIR_VAR, str(tmp_path / "k"))
    assert build.build_dir() == tmp_path / "k" / build.key()


@pytest.mark.skipif(gate.compiled() is None, reason="compiled kernels not built")
def test_sse2_switch_turns_the_avx2_scorer_off():
    """In-process: the same index scores with the AVX2 choice forbidden, within the bound."""
    from cedlm.kernels.codecs import ext_format
    mod = gate.compiled()
    g = torch.Generator().manual_seed(1)
    q, w = torch.randn(1, 2, 4, 64, generator=g), torch.randn(1, 2, 4, generator=g)
    keys = torch.randn(90, 64, generator=g)
    raw = mod.encode(keys, *ext_format("index_fp4")).view(1, 90, -1)
    vis = torch.ones(1, 2, 90, dtype=torch.bool)
    try:
        has_avx2 = mod.set_avx2(True)
        a = mod.index_score(q, w, raw, vis, *ext_format("index_fp4"))
        mod.set_avx2(False)
        b = mod.index_score(q, w, raw, vis, *ext_format("index_fp4"))
    finally:
        mod.set_avx2(build.isa() == "auto")
    kind, block = ext_format("index_fp4")
    kd = mod.decode(raw.view(90, -1), kind, 64, block)
    scale = torch.einsum("bthd,nd,bth->btn", q.abs(), kd.abs(), w.abs())
    assert ((a - b).abs() <= 1e-5 * scale + 1e-5 * b.abs()).all()
    if not has_avx2:
        assert _same(a, b)


@pytest.mark.slow
def test_portable_paths_match_the_default_path(tmp_path):
    if not build.status("generic")[0]:
        subprocess.run([sys.executable, "-m", "cedlm.kernels.build", "--isa", "generic"],
                       check=True, timeout=900, capture_output=True)
    auto, sse2, generic = (_run(isa, tmp_path / f"{isa}.pt") for isa in ("auto", "sse2", "generic"))
    assert (auto["isa"], sse2["isa"], generic["isa"]) == ("auto", "sse2", "generic")
    assert auto["key"] == sse2["key"] != generic["key"]
    names = [k for k in auto if k not in ("isa", "key", "index_bound")]
    for k in names:
        assert _same(generic[k], sse2[k]), k                  # scalar build == SSE2 build, bitwise
        if k != "index_score":
            assert _same(auto[k], sse2[k]), k
    a, b = auto["index_score"], sse2["index_score"]
    assert torch.equal(a.isinf(), b.isinf())
    fin = ~b.isinf()
    bound = 1e-5 * auto["index_bound"][fin] + 1e-5 * b[fin].abs()
    assert ((a[fin] - b[fin]).abs() <= bound).all()
