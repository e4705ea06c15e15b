#!/usr/bin/env bash
# Set up stepscope on a fresh machine: a virtualenv in .venv with the CPU build of torch and the
# project (editable, with dev tools), plus Debian's chromium for the browser tests.
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip
# Pin the CPU build: an unpinned torch pulls a multi-GB CUDA build.
"$VPY" -c "import torch" 2>/dev/null || "$VPY" -m pip install -q "torch==2.13.0"
"$VPY" -m pip install -q -e ".[dev,structured]"
# The compiled stage core (instrument/native.py): one cc call, redone only when its source changed.
# Without a C compiler the device timeline runs its Python classes (the trace's metadata says so).
"$VPY" -m instrument.native status >/dev/null 2>&1 || "$VPY" -m instrument.native build \
  || echo "warning: the compiled stage core was not built; tracing uses the Python stage path" >&2

if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
    >/dev/null 2>&1 || echo "warning: could not install chromium; browser tests will be skipped" >&2
fi
echo "stepscope is set up in .venv (activate with: source .venv/bin/activate)"
