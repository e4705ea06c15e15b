"""Async scheduling on vs off on the same workload: overlap, CPU time, device time, step time.

For each batch size: per-step CPU time (schedule + prepare_inputs + launch + update_from_output),
device time (union of compute slices), step time (cadence of steady decode steps), and the
trace's schedule/forward overlap, with async off and on. The limit of hiding is
max(CPU, device): async on should bring the step time close to it.

Usage: python bench/bench_async.py [--device cuda] [--batches 8,32,64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _engine_run import decode_steps, decode_workload, run_engine  # noqa: E402

CPU_PHASES = ["schedule_ns", "prepare_inputs_ns", "launch_ns", "update_from_output_ns"]


def measure(batch: int, async_on: bool, args: argparse.Namespace) -> dict:
    res = run_engine(
        decode_workload(batch, args.prompt_len, args.output_len, args.vocab),
        model_config=args.model_config,
        random_weights=True,
        device=args.device,
        dtype=args.dtype,
        async_scheduling=async_on,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch * args.prompt_len),
        num_kv_blocks=max(256, batch * (args.prompt_len + args.output_len) // 16 + 64),
        max_model_len=args.prompt_len + args.output_len + 16,
        tag=f"async_{'on' if async_on else 'off'}_b{batch}",
    )
    steps = decode_steps(res.steps, batch)
    cpu_us = float(steps[CPU_PHASES].sum(axis=1).median()) / 1e3
    dev_us = float(steps["device_busy_ns"].median()) / 1e3
    step_us = float(steps["step_ns"].median()) / 1e3
    return {
        "batch": batch,
        "async": async_on,
        "cpu_us": cpu_us,
        "device_us": dev_us,
        "step_us": step_us,
        "limit_us": max(cpu_us, dev_us),
        "x_limit": step_us / max(cpu_us, dev_us),
        "overlap": res.headline.get("overlap"),
        "tok_per_s": res.num_output_tokens / res.elapsed_s,
        "trace": res.trace,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model-config", default="qwen3-0.6b")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batches", default="8,32,64")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = [measure(b, a, args) for b in map(int, args.batches.split(",")) for a in (False, True)]
    print(
        f"{'batch':>5} {'async':>5} {'cpu us':>8} {'dev us':>8} {'step us':>8} {'limit':>8} "
        f"{'x limit':>7} {'overlap':>7} {'tok/s':>8}"
    )
    for r in rows:
        ov = r["overlap"]
        print(
            f"{r['batch']:>5} {str(r['async']):>5} {r['cpu_us']:>8.1f} {r['device_us']:>8.1f} "
            f"{r['step_us']:>8.1f} {r['limit_us']:>8.1f} {r['x_limit']:>7.2f} "
            f"{(ov if ov is not None else float('nan')):>7.2f} {r['tok_per_s']:>8.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
