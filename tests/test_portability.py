"""The numerics tests pass on other instruction-set paths, not only on this CPU's.

A user's CPU picks other SIMD kernels than the developer's: MKL chooses its GEMM code path from
the CPU (forced here with MKL_ENABLE_INSTRUCTIONS), and the compiled kernels choose AVX2 + FMA or
SSE2 at run time (forced with CEDLM_KERNEL_ISA=sse2), or are turned off (CEDLM_REFERENCE_KERNELS=1). Each path rounds differently in the last
bits; the tests that compare two computations (fast vs reference kernels, batched vs single rows,
verify vs one-token steps, two ranks vs one, the golden logits) must hold on all of them. This test
re-runs that subset under each forced path in a subprocess: for each path, the files whose
computations reach what the path changes (a file outside a path's list would run there exactly as
in the suite's own run). An MKL path is skipped, with the reason, where MKL takes the same code
path with and without the setting (a CPU that has nothing above it, or one MKL runs its generic
code on): the suite's own run is then that path's run. `bench/scripts/portability.sh --full` runs
the whole suite under each path (what a release is checked with).
"""
from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SWEEP_VAR = "CEDLM_PORTABILITY_SWEEP"      # set in the re-runs: they do not recurse

# Tests comparing two computations that round differently, by what they reach:
# the model's forward, decode, verify and engine paths: matrix products (MKL), every fast kernel
# (the index scorer's and the packed attention's AVX2 + FMA paths among them), the reference switch
MODEL = ["tests/test_golden.py", "tests/test_rollback.py", "tests/test_model.py",
         "tests/test_speculative.py", "tests/test_mechanisms.py", "tests/test_compressor_indexer.py",
         "tests/test_engine.py"]
# a fast kernel against a reference that multiplies matrices (MKL rounds the reference)
GEMM_REFERENCES = ["tests/test_mhc_fast.py", "tests/test_index_fast.py", "tests/test_attend_fast.py",
                   "tests/test_attend_packed.py", "tests/test_moe_fast.py"]
# the compiled kernels with an AVX2 + FMA path (CEDLM_KERNEL_ISA=sse2 turns it off): the index
# scorer (with its FP4 key decode) and the packed attention; csrc/attend.h, mhc.h, rope.h and the
# codecs' encode / decode / quant_dequant have one path only
ISA_KERNELS = ["tests/test_index_fast.py", "tests/test_attend_packed.py"]
# training: matrix products only (autograd takes the reference kernels; the fake-quant codecs are
# bit-identical on every backend, tests/test_quant_fast.py)
DDP = ["tests/test_train.py::test_ddp_two_ranks_match_one_process"]
# Left out of every path, as each runs the same there as in the suite's own run: test_quant_fast
# (bit-exact codecs with no matrix product and no AVX2 path; it turns the reference switch off
# itself), test_rope_fast (elementwise, one path; skipped under the reference switch) and
# test_window_fast (byte copies). Under the reference switch the fast kernels' files skip
# themselves or compare the reference with itself, and training is unchanged: the model's files.

PATHS = {
    "mkl-sse4_2": ({"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}, MODEL + GEMM_REFERENCES + DDP),
    "mkl-avx2": ({"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, MODEL + GEMM_REFERENCES + DDP),
    "kernels-sse2": ({"CEDLM_KERNEL_ISA": "sse2"}, MODEL + ISA_KERNELS),
    "reference-kernels": ({"CEDLM_REFERENCE_KERNELS": "1"}, MODEL),
}
NUMERICS = sorted({t for _, files in PATHS.values() for t in files})

# MKL's code path (the processor line MKL_VERBOSE prints) and the bits of a few products
_MKL_PROBE = """
import hashlib, torch
torch.manual_seed(0)
h = hashlib.sha256()
for m, k, n in [(1, 256, 4096), (7, 256, 128), (64, 128, 256), (3, 1000, 333)]:
    a, b = torch.randn(m, k), torch.randn(k, n)
    h.update((a @ b).numpy().tobytes())
print("DIGEST", h.hexdigest())
"""


@functools.lru_cache(maxsize=None)
def _mkl_path(setting: str | None) -> tuple[str | None, str]:
    """(MKL's processor line or None, digest of the products) with MKL_ENABLE_INSTRUCTIONS=setting
    (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_ENABLE_INSTRUCTIONS"}
    env.update({"MKL_VERBOSE": "1", "OMP_NUM_THREADS": "1"})
    if setting is not None:
        env["MKL_ENABLE_INSTRUCTIONS"] = setting
    out = subprocess.run([sys.executable, "-c", _MKL_PROBE], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    line = re.search(r"^MKL_VERBOSE oneMKL.* for (.*?), Lnx", out, re.M) or \
        re.search(r"^MKL_VERBOSE (?:Intel\(R\) )?MKL.*? for (.*?)(?:, Lnx|$)", out, re.M)
    return (line.group(1) if line else None), re.search(r"^DIGEST (\w+)", out, re.M).group(1)


@pytest.mark.ahead
@pytest.mark.skipif(os.environ.get(SWEEP_VAR) == "1", reason="inside a portability re-run")
@pytest.mark.parametrize("path", sorted(PATHS))
def test_numerics_hold_on_another_instruction_set(path):
    forced, files = PATHS[path]
    if "MKL_ENABLE_INSTRUCTIONS" in forced:
        here, there = _mkl_path(os.environ.get("MKL_ENABLE_INSTRUCTIONS")), _mkl_path(forced["MKL_ENABLE_INSTRUCTIONS"])
        if here == there:
            pytest.skip(f"{path}: MKL takes the same code path here with and without "
                        f"MKL_ENABLE_INSTRUCTIONS={forced['MKL_ENABLE_INSTRUCTIONS']} "
                        f"({here[0] or 'no MKL_VERBOSE line'}; the same bits): the suite's own run is its run")
    env = {**os.environ, **forced, SWEEP_VAR: "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, f"{path}: {forced}\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"


def test_the_subset_exists():
    for t in NUMERICS:
        assert (ROOT / t.split("::")[0]).exists(), t
