#!/usr/bin/env bash
# Set up (see setup.sh), lint, type-check and run the test suite on the CPU. GPU tests (-m gpu)
# run on a CUDA machine. STEPSCOPE_SKIP_CHECKS=1 skips ruff and mypy (pytest only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${STEPSCOPE_SKIP_CHECKS:-0}" != 1 ]; then
  .venv/bin/ruff check .
  .venv/bin/ruff format --check .
  # Every package type-checks (pyproject.toml [tool.mypy]); tests/, bench/ and samples/ are not
  # checked: they are scripts and fixtures, run rather than imported.
  .venv/bin/mypy engine instrument analysis stepscope dashboard
fi
exec .venv/bin/python -m pytest -q "$@"
