#!/usr/bin/env bash
# Run N randomized engine scenarios (default 10000) on the CPU; a failure prints its replay
# command. Extra arguments go to `python -m tests.engine.fuzz` (--start S, --keep-going,
# --threaded). Example: scripts/fuzz.sh 10000 --keep-going
set -euo pipefail
cd "$(dirname "$0")/.."
count="${1:-10000}"
shift || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=python
    [[ -x .venv/bin/python ]] && PYTHON=.venv/bin/python
fi
exec "$PYTHON" -m tests.engine.fuzz --count "$count" "$@"
