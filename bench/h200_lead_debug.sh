#!/usr/bin/env bash
# One device call: a warm kernel-window run kept in $OUT (lead/alignment data), its analysis,
# then the GPU tests and the tracing-overhead bench (OVERHEAD_ARGS="--rounds 5" for more rounds).
# Usage: bash bench/h200_lead_debug.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
RUN="python3 -m stepscope.cli run --model-config qwen3-0.6b --random-weights --tokenizer samples/models/pycoder-14m --dtype bfloat16 --device cuda --workload synthetic:n=256,in=128-128,out=128-128,seed=0 --max-num-seqs 256 --max-num-batched-tokens 2048 --num-kv-blocks 16384 --no-progress"
$RUN > /dev/null 2>&1   # warm the Triton cache: the timed window must not hold JIT compiles
$RUN --trace "$OUT/kw.pftrace" --trace-kernels 4:44 2>&1 | grep -E "tok/s|trace_kernels"
timeout 120 python3 bench/bench_kernel_window.py --trace-path "$OUT/kw.pftrace" --kernel-steps 4:44 --out "$OUT/kernel_window.json" 2>&1 | tail -6
timeout 60 python3 - "$OUT/kw.pftrace" <<'PY' 2>&1 | tail -30
import sys
import numpy as np
from analysis import load_trace
fr = load_trace(sys.argv[1])
sl = fr.slices
print({k: v for k, v in fr.metadata.items() if "kernel" in k or "clock" in k})
dev = sl[sl["role"].isin(["compute", "copy"])]
col = "host_end_ns"
if col in dev.columns:
    d = dev.dropna(subset=[col])
    lead = (d["end_ns"] - d[col].astype(np.int64)) / 1e3
    t = (d["end_ns"] - d["end_ns"].min()) / 1e9
    for name, g in d.assign(lead=lead, t=t).groupby("name"):
        q = g["lead"].quantile([0.1, 0.5, 0.9]).round(1).tolist()
        print(name, len(g), "lead p10/p50/p90 us", q, "first/last-10 median", round(g["lead"].head(10).median(), 1), round(g["lead"].tail(10).median(), 1), "span s", round(g["t"].max(), 2))
PY
bash bench/h200_session.sh tests overhead
