"""Decode step time against the memory-bandwidth floor, Qwen3-0.6B shape (random weights).

floor = (weight bytes + KV bytes read per step) / measured device copy bandwidth, where the
bandwidth comes from a large device-to-device copy counting bytes read plus bytes written.
Device step time is the union of a decode step's compute slices (CUDA events).

Usage (CUDA): python bench/bench_decode.py [--batches 1,32,256] [--prompt-len 128]
              [--output-len 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _engine_run import decode_steps, decode_workload, run_engine  # noqa: E402


def copy_bandwidth_bytes_per_s(nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * nbytes / times[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batches", default="1,32,256")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--model-config", default="qwen3-0.6b")
    p.add_argument("--cuda-graphs", choices=["on", "off"], default="on")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    bw = copy_bandwidth_bytes_per_s()
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        res = run_engine(
            decode_workload(batch, args.prompt_len, args.output_len, 151936),
            model_config=args.model_config,
            random_weights=True,
            device="cuda",
            dtype="bfloat16",
            async_scheduling=False,
            cuda_graphs=args.cuda_graphs == "on",
            max_num_seqs=max(batch, 1),
            max_num_batched_tokens=max(2048, batch * args.prompt_len),
            num_kv_blocks=max(256, batch * (args.prompt_len + args.output_len) // 16 + 64),
            max_model_len=args.prompt_len + args.output_len + 16,
            tag=f"decode_b{batch}",
        )
        cfg = res.model.config
        weight_bytes = sum(t.numel() * t.element_size() for t in res.model.parameters())
        mean_ctx = args.prompt_len + args.output_len / 2
        kv_bytes = int(
            batch
            * mean_ctx
            * cfg.num_hidden_layers
            * 2
            * cfg.num_key_value_heads
            * cfg.head_dim
            * 2
        )
        floor_us = (weight_bytes + kv_bytes) / bw * 1e6
        steps = decode_steps(res.steps, batch)
        dev_us = float(steps["device_busy_ns"].median()) / 1e3
        wall_us = float(steps["step_ns"].median()) / 1e3
        rows.append(
            {
                "batch": batch,
                "steps": len(steps),
                "device_step_us": dev_us,
                "wall_step_us": wall_us,
                "floor_us": floor_us,
                "x_floor": dev_us / floor_us,
                "weight_MB": weight_bytes / 1e6,
                "kv_MB": kv_bytes / 1e6,
            }
        )
    print(f"copy bandwidth (read+write): {bw / 1e12:.2f} TB/s")
    print(
        f"{'batch':>5} {'steps':>5} {'device us':>10} {'wall us':>9} {'floor us':>9} "
        f"{'x floor':>7} {'weights MB':>10} {'KV MB':>7}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['steps']:>5} {r['device_step_us']:>10.1f} {r['wall_step_us']:>9.1f}"
            f" {r['floor_us']:>9.1f} {r['x_floor']:>7.2f} {r['weight_MB']:>10.1f} {r['kv_MB']:>7.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth_Bps": bw, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
