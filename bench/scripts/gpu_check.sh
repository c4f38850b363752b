#!/usr/bin/env bash
# The CUDA tests and the GPU figures, in at most 8 minutes on one GPU.
#
#   bench/scripts/gpu_check.sh [--out DIR] [--budget SECONDS] [--cpu-smoke]
#
# Phases, each a process of its own under its own `timeout`, in this order (cheap and decisive
# first; a phase that fails or hangs is recorded and the next one runs):
#
#   exact           CPU vs GPU codec bytes and logits               (cedlm/bench/gpu_exact.py)      35 s
#   capacity        small40 vs small40-v4flash in 40 GiB, live      (cedlm/bench/gpu_capacity.py)   45 s
#   tests_golden    tests/test_golden.py, its CUDA half (golden logits within their bounds)        60 s
#   tests           the CUDA half of every other device-parametrised test: each tests/test_*.py
#                   that uses tests/devices.py, and test_compiled_step.py (not slow, not compiled) 120 s
#   decode          tokens/s, batch 1/8/64 x context 512..32k, CED vs HF Llama (gpu_decode.py)   150 s
#   tests_compiled  the same files' torch.compile tests (-m compiled), with what time is left      50 s
#
# The test phases select -k "cuda and not fake": the tests that run on the real device. The
# fake-CUDA and implicit-device-guard tests are CPU checks the CPU suite runs already. pytest runs
# verbose (a test killed by the phase's timeout is named in the log) with faulthandler_timeout (a
# test past 45 s dumps its stack into the log).
#
# then `assemble` writes DIR/gpu_check.json (stable keys: device, phases, tests, figures) and
# DIR/gpu_check.md (the tables, also printed). No phase starts past the overall budget (default
# 465 s, leaving room for assembling): a phase gets min(its timeout, what is left). Exit status:
# 0 all phases ok, 1 some phase failed or timed out, 2 bad arguments, 3 no CUDA device, 4 the
# JSON could not be assembled (the phases' own JSON files are in DIR/parts).
#
# Without a CUDA device the script stops at once with a message; --cpu-smoke runs the whole path on
# the CPU with tiny sizes (the test phases only collect the tests there) - tests/test_gpu_check.py
# runs it.
#
# Environment (for reruns and tests): PYTHON (default .venv/bin/python, else python3);
# GPU_CHECK_PHASES (space-separated subset, in the order above); GPU_CHECK_TIMEOUT_<PHASE> (seconds,
# e.g. GPU_CHECK_TIMEOUT_DECODE=240); GPU_CHECK_TESTS (test files, instead of the selection above);
# GPU_CHECK_DECODE_STEP (the CED decode step mode for the decode figure; default the engine's).
set -u

T0=$(date +%s)                               # the budget counts from here, preflight included
CALLER_PWD="$PWD"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"

SMOKE=0
OUT=""
BUDGET="${GPU_CHECK_BUDGET_S:-465}"
RESERVE=15                                   # seconds kept for assembling the JSON (its timeout 20 s)
usage() { sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu-smoke) SMOKE=1 ;;
        --out) [ $# -ge 2 ] || { echo "gpu_check: --out needs a directory" >&2; exit 2; }; OUT="$2"; shift ;;
        --budget) [ $# -ge 2 ] || { echo "gpu_check: --budget needs seconds" >&2; exit 2; }; BUDGET="$2"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check: unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
case "$BUDGET" in ''|*[!0-9]*) echo "gpu_check: --budget: whole seconds, got '$BUDGET'" >&2; exit 2 ;; esac
case "$OUT" in ''|/*) ;; *) OUT="$CALLER_PWD/$OUT" ;; esac     # --out is relative to where it was given
SELECTED="${GPU_CHECK_PHASES:-exact capacity tests_golden tests decode tests_compiled}"
for phase in $SELECTED; do
    case "$phase" in
        exact|capacity|tests_golden|tests|decode|tests_compiled) ;;
        *) echo "gpu_check: GPU_CHECK_PHASES: unknown phase '$phase' (exact capacity tests_golden tests decode tests_compiled)" >&2; exit 2 ;;
    esac
done

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

# ---------------------------------------------------------------- preflight: is there a GPU?
INFO="$("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())' 2>&1)" || {
    echo "gpu_check: cannot import torch with $PY: $INFO" >&2; exit 2; }
read -r TORCH_V TORCH_CUDA CUDA_OK <<< "$(echo "$INFO" | tail -n 1)"
if [ "$SMOKE" = 0 ] && [ "$CUDA_OK" != "True" ]; then
    echo "gpu_check: no CUDA device: torch $TORCH_V (CUDA build: $TORCH_CUDA) sees no GPU" >&2
    echo "  (torch.cuda.is_available() is False). This script runs the CUDA tests and the GPU figures" >&2
    echo "  on a machine with an NVIDIA GPU and the CUDA build of torch (README: running on a GPU)." >&2
    echo "  To run the whole script on the CPU with tiny sizes: $0 --cpu-smoke" >&2
    exit 3
fi
if [ "$SMOKE" = 1 ]; then
    PROFILE=cpu-smoke; DEVICE=cpu; OUT="${OUT:-bench/results/gpu-smoke}"
else
    PROFILE=gpu; DEVICE=cuda; OUT="${OUT:-bench/results/gpu}"
fi
mkdir -p "$OUT/logs" "$OUT/parts"
rm -f "$OUT"/parts/*.json "$OUT"/tests*.xml "$OUT/phases.tsv" "$OUT/gpu_check.json" "$OUT/gpu_check.md"
PHASES="$OUT/phases.tsv"
: > "$PHASES"
DEADLINE=$((T0 + BUDGET))
echo "gpu_check: profile $PROFILE, device $DEVICE, torch $TORCH_V (CUDA $TORCH_CUDA), budget ${BUDGET}s, results in $OUT"
"$PY" -c 'import cedlm' 2>/dev/null || echo "gpu_check: WARNING: $PY cannot import cedlm from $ROOT; the phases will fail" >&2
"$PY" -c 'import transformers' 2>/dev/null || echo "gpu_check: note: transformers is not installed: the decode figure skips its HF Llama cells" >&2
[ "$DEVICE" = cuda ] && command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader

ms() { date +%s%3N; }

# run_phase NAME DEFAULT_TIMEOUT CMD...: run CMD under min(timeout, time left); one line in $PHASES
run_phase() {
    local name="$1" limit="$2"; shift 2
    local var="GPU_CHECK_TIMEOUT_$(echo "$name" | tr '[:lower:]' '[:upper:]')"
    limit="${!var:-$limit}"
    local left=$((DEADLINE - RESERVE - $(date +%s)))
    if [ "$left" -lt 5 ]; then
        echo "== $name: skipped (the ${BUDGET}s budget is spent)"
        printf '%s\tskipped\t0\t0\tthe %ss budget was spent before it could start\n' "$name" "$BUDGET" >> "$PHASES"
        return
    fi
    local t="$limit"
    [ "$left" -lt "$t" ] && t="$left"
    echo "== $name (timeout ${t}s)"
    local start rc
    start=$(ms)
    PHASE_TIMEOUT="$t" timeout --kill-after=5 "$t" "$@" 2>&1 | tee "$OUT/logs/$name.log"
    rc=${PIPESTATUS[0]}
    local wall
    wall=$(awk -v a="$start" -v b="$(ms)" 'BEGIN { printf "%.1f", (b - a) / 1000 }')
    local note=""
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && note="killed at its timeout of ${t}s"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$wall" "$t" "$note" >> "$PHASES"
    echo "== $name: rc $rc, ${wall}s"
}

# the test files: those that use tests/devices.py, and the golden and compiled-step tests
if [ -n "${GPU_CHECK_TESTS:-}" ]; then
    TEST_FILES="$GPU_CHECK_TESTS"
    GOLDEN_FILES="$GPU_CHECK_TESTS"
else
    TEST_FILES="$( (grep -l "tests.devices" tests/test_*.py; ls tests/test_compiled_step.py) 2>/dev/null | grep -v -e '^tests/test_golden.py$' -e '^tests/test_gpu_check.py$' | sort -u | tr '\n' ' ')"
    GOLDEN_FILES=tests/test_golden.py
fi
PYTEST=("$PY" -m pytest -p no:cacheprovider -v -rfEs -o faulthandler_timeout=45 -k "cuda and not fake")
[ "$SMOKE" = 1 ] && PYTEST+=(--collect-only)        # the CPU has no CUDA half to run: collect it

figure() { "$PY" -m cedlm.bench.gpu "$1" --out "$OUT" --profile "$PROFILE" --device "$DEVICE" \
               --timeout-s "$PHASE_TIMEOUT" ${GPU_CHECK_DECODE_STEP:+--decode-step "$GPU_CHECK_DECODE_STEP"}; }
export -f figure
export PY OUT PROFILE DEVICE

# pytest without files would run the whole suite: a test phase with none is skipped instead
no_files() {
    echo "== $1: skipped (no test files)"
    printf '%s\tskipped\t0\t0\tno test files were found\n' "$1" >> "$PHASES"
}

for phase in $SELECTED; do
    if [ "${phase#tests}" != "$phase" ]; then
        files="$TEST_FILES"; [ "$phase" = tests_golden ] && files="$GOLDEN_FILES"
        [ -z "${files// /}" ] && { no_files "$phase"; continue; }
    fi
    case "$phase" in
        exact)    run_phase exact 35 bash -c 'figure exact' ;;
        capacity) run_phase capacity 45 bash -c 'figure capacity' ;;
        decode)   run_phase decode 150 bash -c 'figure decode' ;;
        tests_golden) run_phase tests_golden 60 "${PYTEST[@]}" -m "not slow" \
                      --junitxml="$OUT/tests_golden.xml" $GOLDEN_FILES ;;
        tests)    run_phase tests 120 "${PYTEST[@]}" -m "not slow and not compiled" \
                      --junitxml="$OUT/tests.xml" $TEST_FILES ;;
        tests_compiled) run_phase tests_compiled 50 "${PYTEST[@]}" -m "compiled and not slow" \
                      --junitxml="$OUT/tests_compiled.xml" $TEST_FILES ;;
    esac
done

timeout 20 "$PY" -m cedlm.bench.gpu assemble --out "$OUT" --profile "$PROFILE" \
    --budget-s "$BUDGET" --started "$T0"
rc=$?
if [ ! -s "$OUT/gpu_check.json" ]; then
    echo "gpu_check: assembling the JSON failed (rc $rc); the phases' results are in $OUT/parts" >&2
    exit 4
fi
echo "gpu_check: $(( $(date +%s) - T0 ))s in all"
exit "$rc"
