#!/usr/bin/env bash
# The main job: set up, run the sample workload on the sample model with --trace, analyse the
# trace, and say how to open the dashboard and ui.perfetto.dev.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p out
MODEL=samples/models/pycoder-14m
WORKLOAD=samples/workloads/pycode_prompts.jsonl
# The sample target with EAGLE speculation (3 drafts per step), async scheduling on (auto).
.venv/bin/stepscope run --model "$MODEL" --workload "$WORKLOAD" \
  --spec-method eagle --spec-model samples/models/pycoder-14m-eagle --num-spec-tokens 3 \
  --trace out/demo.pftrace --trace-requests --output out/demo.jsonl "$@"
.venv/bin/stepscope analyze out/demo.pftrace
cat <<MSG

Next:
  dashboard:  .venv/bin/stepscope dashboard --traces out     (then open http://127.0.0.1:8050)
  Perfetto:   open https://ui.perfetto.dev and load out/demo.pftrace (or use the dashboard's
              "Open in Perfetto UI" button)
  outputs:    out/demo.jsonl (one JSON line per request)
MSG
