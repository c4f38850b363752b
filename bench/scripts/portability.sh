#!/usr/bin/env bash
# The test suite under other instruction-set paths than this CPU's (see tests/test_portability.py).
#   bench/scripts/portability.sh          the numerics subset under each forced path (~1-2 min each)
#   bench/scripts/portability.sh --full   the whole suite (-m "not slow") under each forced path
# Also with the compiled kernels' scalar build: CEDLM_KERNEL_ISA=generic (built on first use by
# `python -m cedlm.kernels.build --isa generic`, about a minute).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
full=0; [ "${1:-}" = "--full" ] && full=1
fail=0
run() {   # name, env assignments...
    local name=$1; shift
    echo "== $name: $*"
    if [ $full = 1 ]; then
        env "$@" CEDLM_PORTABILITY_SWEEP=1 $PY -m pytest -m "not slow" -q -p no:cacheprovider || fail=1
    else
        env "$@" $PY -m pytest -q -p no:cacheprovider "tests/test_portability.py::test_numerics_hold_on_another_instruction_set" -k "${name}" || fail=1
    fi
}
run mkl-sse4_2 MKL_ENABLE_INSTRUCTIONS=SSE4_2
run mkl-avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
run kernels-sse2 CEDLM_KERNEL_ISA=sse2
run reference-kernels CEDLM_REFERENCE_KERNELS=1
if [ $full = 1 ]; then
    $PY -m cedlm.kernels.build --isa generic >/dev/null && run kernels-generic CEDLM_KERNEL_ISA=generic
fi
exit $fail
