"""Which host call of a step's launch takes the time: wall-clock timers around the runner's
pieces (no profiler, so no CUPTI slowdown), async off vs on.

Wraps the device helpers (pinned host allocation, events, stream waits), the staged-write
flush/apply, input prep, the graph replay, logits, sampling and the output copy with
``perf_counter_ns`` timers and prints, per wrapped call, the median and 90th percentile host
time per step over the steady decode steps. A call that blocks on the device shows up as a
large host time.

Usage (CUDA): python bench/launch_breakdown.py [--batch 1] [--model-config qwen3-0.6b]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _engine_run import decode_workload  # noqa: E402

from engine.llm import LLM  # noqa: E402
from instrument.tracer import Tracer  # noqa: E402


def _wrap(obj: object, name: str, label: str, times: dict[str, list[int]]) -> None:
    fn = getattr(obj, name)

    def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
        start = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            times[label].append(time.perf_counter_ns() - start)

    setattr(obj, name, timed)


def run(args: argparse.Namespace, async_on: bool, trace: bool) -> None:
    tracer = Tracer(os.path.join(tempfile.mkdtemp(), "t.pftrace")) if trace else None
    llm = LLM(
        tracer=tracer,
        model_config=args.model_config, random_weights=True, device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32",
        async_scheduling=async_on, max_num_seqs=args.batch,
        max_num_batched_tokens=max(2048, args.batch * args.prompt_len),
        num_kv_blocks=args.batch * (args.prompt_len + args.output_len) // 16 + 64,
        max_model_len=args.prompt_len + args.output_len + 16,
    )  # fmt: skip
    workload = decode_workload(args.batch, args.prompt_len, args.output_len, 151936)
    warm = [dataclasses.replace(w, id=f"w{w.id}", params=dataclasses.replace(w.params, max_tokens=4))
            for w in workload]  # fmt: skip
    llm.run_workload(warm)
    times: dict[str, list[int]] = defaultdict(list)
    core = llm.engine
    runner = core.runner
    dev = runner.device
    for obj, name in [
        (dev, "host_empty"), (dev, "new_event"), (dev, "wait_event"),
        (runner.states, "flush"), (runner.states, "apply"), (runner.step_inputs, "flush"),
        (runner.step_inputs, "apply"), (runner.fwd, "prepare"), (runner.fwd.graphs, "replay"),
        (runner.fwd, "logits"), (runner, "_sample"), (runner, "_copy_out"),
        (runner, "_prepare_step"), (runner, "_launch_forward"), (runner, "_launch_sample"),
        (runner.timeline, "poll"), (core, "_launch"), (core, "_wait"), (core, "_update"),
        (core, "_schedule"),
    ]:  # fmt: skip
        _wrap(obj, name, f"{type(obj).__name__}.{name}", times)
    steps = [0]
    run_step = core.run_step

    def counted():  # type: ignore[no-untyped-def]
        steps[0] += 1
        return run_step()

    core.run_step = counted  # type: ignore[method-assign]
    start = time.perf_counter()
    llm.run_workload(workload)
    elapsed = time.perf_counter() - start
    llm.close()
    if tracer is not None:
        tracer.close()
    n = steps[0]
    print(f"batch {args.batch}, async {'on' if async_on else 'off'}, trace {trace}: {n} steps, "
          f"{elapsed / n * 1e6:.0f} us per step; host us per step (median, p90, calls/step):")  # fmt: skip
    for label, ts in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        per_call = np.asarray(ts) / 1e3
        print(f"    {label:<34} {sum(ts) / n / 1e3:9.1f} us/step  median {np.median(per_call):8.1f}"
              f"  p90 {np.percentile(per_call, 90):8.1f}  x{len(ts) / n:.1f}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--model-config", default="qwen3-0.6b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--async-scheduling", default="off,on", help="comma list of on/off")
    p.add_argument("--trace", default="off", help="comma list of on/off: with a Perfetto trace")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=48)
    args = p.parse_args()
    for async_on in map(lambda a: a == "on", args.async_scheduling.split(",")):
        for trace in map(lambda t: t == "on", args.trace.split(",")):
            run(args, async_on, trace)


if __name__ == "__main__":
    main()
