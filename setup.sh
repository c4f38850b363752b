#!/usr/bin/env bash
# Create .venv and install cedlm with its pinned dependencies (torch 2.13.0 CPU wheel).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
# Compiled KV codecs (cedlm/quant/csrc, about a minute): optional. Without them cedlm logs one line
# and runs the bit-identical vectorised torch codecs. Needs g++ and ninja (pip's ninja if absent).
command -v ninja >/dev/null || .venv/bin/pip install -q --disable-pip-version-check ninja || true
.venv/bin/python -m cedlm.quant.ext build \
  || echo "setup.sh: compiled KV codecs not built; cedlm uses its vectorised torch codecs" >&2
