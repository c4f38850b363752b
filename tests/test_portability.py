"""The numerics tests pass on other instruction-set paths, not only on this CPU's.

A user's CPU picks other SIMD kernels than the developer's: MKL chooses its GEMM code path from
the CPU (forced here with MKL_ENABLE_INSTRUCTIONS), and the compiled kernels choose AVX2 + FMA or
SSE2 at run time (forced with CEDLM_KERNEL_ISA=sse2), or are turned off (CEDLM_REFERENCE_KERNELS=1). Each path rounds differently in the last
bits; the tests that compare two computations (fast vs reference kernels, batched vs single rows,
verify vs one-token steps, two ranks vs one, the golden logits) must hold on all of them. This test
re-runs that subset under each forced path in a subprocess. `bench/scripts/portability.sh --full`
runs the whole suite under each path (what a release is checked with).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SWEEP_VAR = "CEDLM_PORTABILITY_SWEEP"      # set in the re-runs: they do not recurse

# Tests comparing two computations that round differently.
NUMERICS = ["tests/test_golden.py", "tests/test_rollback.py", "tests/test_model.py",
            "tests/test_quant_fast.py", "tests/test_mhc_fast.py", "tests/test_rope_fast.py",
            "tests/test_index_fast.py", "tests/test_attend_fast.py", "tests/test_window_fast.py",
            "tests/test_moe_fast.py", "tests/test_speculative.py", "tests/test_mechanisms.py",
            "tests/test_compressor_indexer.py", "tests/test_engine.py",
            "tests/test_train.py::test_ddp_two_ranks_match_one_process"]

PATHS = {
    "mkl-sse4_2": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "kernels-sse2": {"CEDLM_KERNEL_ISA": "sse2"},
    "reference-kernels": {"CEDLM_REFERENCE_KERNELS": "1"},
}


@pytest.mark.skipif(os.environ.get(SWEEP_VAR) == "1", reason="inside a portability re-run")
@pytest.mark.parametrize("path", sorted(PATHS))
def test_numerics_hold_on_another_instruction_set(path):
    env = {**os.environ, **PATHS[path], SWEEP_VAR: "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *NUMERICS],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, f"{path}: {PATHS[path]}\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"


def test_the_subset_exists():
    for t in NUMERICS:
        assert (ROOT / t.split("::")[0]).exists(), t
