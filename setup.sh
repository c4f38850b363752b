#!/usr/bin/env bash
# Create .venv and install cedlm: torch 2.13.0 (the CPU build on a machine without an NVIDIA GPU),
# then the exact tested set of requirements.lock (cedlm's dependencies, its test and evaluation
# tools), then cedlm itself (editable), then its compiled kernels.
#   ./setup.sh             everything the test suite needs
#   ./setup.sh --runtime   only what `cedlm serve` / `cedlm generate` need (the lock's versions)
# TORCH_INDEX_URL picks the index torch comes from, e.g. the CUDA build of the same version:
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 ./setup.sh
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
PIP=(.venv/bin/pip install -q --disable-pip-version-check)
CPU_INDEX=https://download.pytorch.org/whl/cpu
[ -x .venv/bin/python ] || "$PY" -m venv .venv

reachable() {     # $1's index page answers within 5 s (curl, else Python's urllib)
  if command -v curl >/dev/null 2>&1; then
    curl -sf --max-time 5 -o /dev/null "$1/" 2>/dev/null
  else
    .venv/bin/python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/', timeout=5)" \
      "$1" >/dev/null 2>&1
  fi
}

# torch first, pinned, from the index that matches the machine. PyPI's Linux torch is the CUDA
# build (with the CUDA toolkit, cuDNN and NCCL: gigabytes); without an NVIDIA GPU the CPU build
# from PyTorch's CPU index serves, and where that index cannot be reached, the default index does.
if ! .venv/bin/python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    index=("--index-url" "$TORCH_INDEX_URL")
  elif [ "$(uname -s)" = Linux ] && ! command -v nvidia-smi >/dev/null 2>&1 && [ ! -e /proc/driver/nvidia ] \
       && reachable "$CPU_INDEX"; then
    index=("--index-url" "$CPU_INDEX")
  else
    index=()
  fi
  echo "setup.sh: torch 2.13.0 from ${index[1]:-the default index}" >&2
  "${PIP[@]}" torch==2.13.0 ${index[@]+"${index[@]}"}
fi
if [ "${1:-}" = --runtime ]; then
  "${PIP[@]}" -c requirements.lock -e .
else
  # the whole closure, so no resolution: exactly the tested versions
  "${PIP[@]}" --no-deps -r requirements.lock
  "${PIP[@]}" --no-deps -e .
fi
# cedlm's bytecode, as pip writes it for every package it installs (an editable install does not):
# without it each `python -m cedlm ...` process compiles the sources it imports again, wherever
# PYTHONDONTWRITEBYTECODE is set
.venv/bin/python -m compileall -q cedlm >/dev/null || echo "setup.sh: cedlm's bytecode not written" >&2
# Compiled kernels (cedlm/kernels/csrc, 1-2 minutes) into the per-user cache ~/.cache/cedlm/kernels
# (CEDLM_KERNEL_DIR overrides it): optional. Without them cedlm logs one line and runs the torch
# paths (bit-identical codecs). Needs g++ and ninja (pip's ninja if absent).
command -v ninja >/dev/null || "${PIP[@]}" ninja || true
.venv/bin/python -m cedlm.kernels.build \
  || echo "setup.sh: compiled kernels not built; cedlm uses its torch paths" >&2
