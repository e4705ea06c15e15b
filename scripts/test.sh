#!/usr/bin/env bash
# Set up (see setup.sh) and run the test suite on the CPU. GPU tests (-m gpu) run on a CUDA machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
