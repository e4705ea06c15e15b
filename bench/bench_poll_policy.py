"""The device timeline's poll policy on a host-bound engine, with no device: tracer CPU per step.

A host-bound engine finds every step's output ready when it reaches its wait, so it never blocks
and never hands the GIL over by itself. This runs the tracer calls of engine steps
(``bench_trace_overhead._micro_steps``: five CPU spans, five device stages on three streams over
stand-in events, counters) with no wait and the output always ready, untraced (``off``) and
traced with the process writer under two policies, alternated ``--rounds`` times:

* ``auto`` (the engine's): the timeline polls on the engine thread once ``MAX_DEFERRED`` stages
  are pending (docs/design.md §4.3, "Polls");
* ``background`` (the earlier policy): it wakes its poller thread, which must take the GIL from
  the engine thread.

Prints per policy the loop's wall µs per step (the engine's throughput cost) and the engine
thread's CPU µs per step, per round and their median. CPU numbers on a shared machine move by tens
of µs; compare within one run.

    python bench/bench_poll_policy.py [--steps 3000] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_trace_overhead import _micro_steps  # noqa: E402
from instrument.tracer import Tracer  # noqa: E402

POLICIES = ("off", "auto", "background")


def one_run(policy: str, steps: int) -> tuple[float, float]:
    """(loop wall µs per step, engine-thread CPU µs per step) of one host-bound run."""
    with tempfile.TemporaryDirectory() as tmp:
        if policy == "off":
            tracer = Tracer(enabled=False)
        else:
            tracer = Tracer(os.path.join(tmp, "t.pftrace"), writer="process")
        start = time.perf_counter_ns()
        cpu_ns, _ = _micro_steps(
            tracer, steps, 0, clock=time.thread_time_ns, wait_s=0.0, output_ready=True,
            inline_when_host_bound=policy != "background",
        )  # fmt: skip
        wall_ns = time.perf_counter_ns() - start
        tracer.close()
    return wall_ns / steps / 1e3, cpu_ns / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in POLICIES}
    for _ in range(args.rounds):
        for name in POLICIES:
            runs[name].append(one_run(name, args.steps))
    print(f"host-bound tracer calls, {args.steps} steps, {args.rounds} rounds alternated "
          "(process writer): wall / engine CPU µs per step")  # fmt: skip
    out = {}
    for name, rows in runs.items():
        wall = statistics.median(r[0] for r in rows)
        cpu = statistics.median(r[1] for r in rows)
        out[name] = {"wall_us": [r[0] for r in rows], "engine_cpu_us": [r[1] for r in rows],
                     "wall_us_median": wall, "engine_cpu_us_median": cpu}  # fmt: skip
        cells = " ".join(f"{r[0]:6.1f}/{r[1]:6.1f}" for r in rows)
        print(f"  {name:<11} {cells}   median {wall:6.1f} / {cpu:6.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
