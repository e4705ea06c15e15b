"""Where the host's time goes in a decode step: cProfile over steady decode steps of the engine.

Runs ``batch`` requests (random-weight Qwen3-0.6B shape by default) to warm up, then profiles the
measured run's engine steps with cProfile and prints the functions with the most own time and
the most cumulative time, plus the host cost of one CUDA-graph replay measured on its own.
cProfile slows Python-heavy code down (each call is counted), so read the shares, not the
absolute times; the per-phase times without it come from ``bench_decode.py``.

Usage: python bench/profile_cpu_step.py [--batch 256] [--device cuda] [--top 30]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _engine_run import decode_workload  # noqa: E402

from engine.llm import LLM  # noqa: E402


def graph_replay_host_us(llm: LLM, iters: int = 50) -> float | None:
    """Host time of ``graph.replay()`` (cudaGraphLaunch) for the largest captured decode graph."""
    import torch

    from engine.runner.cuda_graphs import GraphShape

    graphs = llm.engine.runner.graphs if hasattr(llm.engine, "runner") else None
    if graphs is None or not graphs.enabled:
        return None
    size = max(graphs.sizes)
    shape = GraphShape(size, size, True)
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        graphs.replay(shape)
        times.append(time.perf_counter_ns() - start)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2] / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--model-config", default="qwen3-0.6b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    cuda = args.device == "cuda"
    workload = decode_workload(args.batch, args.prompt_len, args.output_len, 151936)
    llm = LLM(
        model_config=args.model_config,
        random_weights=True,
        device=args.device,
        dtype="bfloat16" if cuda else "float32",
        async_scheduling=True,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(2048, args.batch * args.prompt_len),
        num_kv_blocks=args.batch * (args.prompt_len + args.output_len) // 16 + 64,
        max_model_len=args.prompt_len + args.output_len + 16,
    )
    warm = [
        dataclasses.replace(
            w, id=f"warm-{w.id}", params=dataclasses.replace(w.params, max_tokens=4)
        )
        for w in workload
    ]
    llm.run_workload(warm)
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    llm.run_workload(workload)
    prof.disable()
    elapsed = time.perf_counter() - start
    print(f"batch {args.batch}: {args.output_len} steps in {elapsed * 1e3:.0f} ms under cProfile "
          f"({elapsed / args.output_len * 1e3:.2f} ms per step)")  # fmt: skip
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumtime").print_stats(args.top)
    if cuda:
        print(f"graph.replay() host time: {graph_replay_host_us(llm)} us (median of 50)")
    llm.close()


if __name__ == "__main__":
    main()
