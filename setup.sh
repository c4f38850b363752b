#!/usr/bin/env bash
# Create .venv and install cedlm with its pinned dependencies (torch 2.13.0 CPU wheel).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build. On a machine with an
# NVIDIA GPU, TORCH_INDEX_URL picks the CUDA build of the same version, e.g.
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 ./setup.sh
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 --index-url "$TORCH_INDEX_URL"
else
  .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
fi
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
# Compiled kernels (cedlm/kernels/csrc, 1-2 minutes) into the per-user cache ~/.cache/cedlm/kernels
# (CEDLM_KERNEL_DIR overrides it): optional. Without them cedlm logs one line and runs the torch
# paths (bit-identical codecs). Needs g++ and ninja (pip's ninja if absent).
command -v ninja >/dev/null || .venv/bin/pip install -q --disable-pip-version-check ninja || true
.venv/bin/python -m cedlm.kernels.build \
  || echo "setup.sh: compiled kernels not built; cedlm uses its torch paths" >&2
