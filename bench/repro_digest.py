"""Does an engine ever give other tokens for the same prompts? Several engines (modes of
``bench_trace_overhead.py``) in one process run the same greedy workloads, round after round;
every request's output is compared with the first mode's in the same round.

Printed per mismatching run: how many requests differ, and for the first few the position of the
first differing token, the sequence length, and the tokens there. One late token in one request
points at numerics (a near tie decided differently); many requests, or early positions, at a race
(inputs or outputs read before they were written).

    python bench/repro_digest.py --device cuda --dtype bfloat16 --model-config qwen3-0.6b \\
        --random-weights --tokenizer samples/models/pycoder-14m --num-requests 1024 \\
        --in-len 128 --out-len 128 --num-kv-blocks 16384 --max-num-seqs 256 \\
        --max-num-batched-tokens 8192 --modes off,trace-derived,off#2 --rounds 8
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_trace_overhead import (  # noqa: E402
    MODES,
    build_mode,
    parse_args,
    token_differences,
    workload,
)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    names = args.modes.split(",")  # a mode twice: "off,off#2" (two engines of one mode)
    if any(n.split("#")[0] not in MODES for n in names):
        raise SystemExit(f"--modes must name only {list(MODES)} (optionally with #N)")
    trace_dir = tempfile.mkdtemp(prefix="stepscope-repro-")
    modes = [build_mode(n.split("#")[0], args, trace_dir) for n in names]
    seeds = iter(range(1, 1 << 30))
    warm = workload(args, next(seeds))
    for m in modes:
        m.llm.run_workload(warm)
    result: dict[str, Any] = {"rounds": []}
    for r in range(args.rounds):
        work = workload(args, next(seeds))
        outs = {}
        for name, m in zip(names, modes, strict=True):
            outs[name] = {o.id: list(o.output_token_ids) for o in m.llm.run_workload(work)}
        base = outs[names[0]]
        row = {}
        for name in names[1:]:
            diff = token_differences(base, outs[name])
            row[name] = {"num_differ": len(diff), "first": diff[:5]}
            mark = "same" if not diff else f"{len(diff)} requests differ: {diff[:3]}"
            print(f"round {r + 1} {name} vs {names[0]}: {mark}", flush=True)
        result["rounds"].append(row)
    result["any_differ"] = any(v["num_differ"] for row in result["rounds"] for v in row.values())
    print(f"any run differs: {result['any_differ']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    for m in modes:
        m.llm.close()
        if m.tracer is not None:
            m.tracer.close()
    return result


if __name__ == "__main__":
    main()
