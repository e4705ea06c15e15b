"""What the device timeline's poll costs per slice it emits, on the poller thread (issue 15).

A traced engine run (the sample model, greedy decoding) with ``DeviceTimeline.poll`` wrapped: for
every poll that runs on the poller thread (``stepscope-device-poll``), its thread CPU time
(``time.thread_time_ns``) and the slices it emitted; with ``--bytecodes`` also the bytecodes it
executed (``sys.settrace`` opcode events: slower, so the CPU time is then not reported). Prints
µs and bytecodes per slice, and with ``--rounds`` > 1 the medians over rounds (each round a fresh
engine). On the H200 the same poll also makes the CUDA driver's query and conversion calls; here
(the CPU device) the events are host-stamped, so this measures the poll's Python only.

docs/design.md §4.3 (the poll); bench/README.md, session 16.

Usage: python bench/poll_cost.py [--rounds 3] [--chunk 16] [--bytecodes]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from instrument import device_timeline  # noqa: E402
from instrument.tracer import Tracer  # noqa: E402

POLLER = "stepscope-device-poll"


def count_opcodes(fn: Any) -> tuple[Any, int]:
    """``fn()`` and the bytecodes it executed on this thread (``sys.settrace`` opcode events; a C
    call counts as its one call instruction). tests/engine/test_trace_cost.py counts with it too."""
    count = 0

    def local(frame: Any, event: str, arg: object) -> Any:
        nonlocal count
        if event == "opcode":
            count += 1
        return local

    def start(frame: Any, event: str, arg: object) -> Any:
        frame.f_trace_opcodes = True
        return local

    sys.settrace(start)
    try:
        return fn(), count
    finally:
        sys.settrace(None)


def one_round(args: argparse.Namespace, path: str) -> dict[str, float]:
    """One engine run; the poller's polls measured."""
    tracer = Tracer(path)
    llm = LLM(tracer=tracer, model=args.model, max_num_seqs=args.max_num_seqs)
    timeline = llm.engine.runner.timeline
    poll = timeline.poll
    totals = {"cpu_ns": 0, "slices": 0, "bytecodes": 0, "polls": 0}

    def measured(limit: int | None = None) -> int:
        if threading.current_thread().name != POLLER:
            return poll(limit)
        if args.bytecodes:
            n, count = count_opcodes(lambda: poll(limit))
            totals["bytecodes"] += count
        else:
            t0 = time.thread_time_ns()
            n = poll(limit)
            totals["cpu_ns"] += time.thread_time_ns() - t0
        totals["slices"] += n
        totals["polls"] += 1
        return n

    timeline.poll = measured  # type: ignore[method-assign]
    prompts = [
        [(7 * i + 13 * j) % 1000 + 2 for j in range(args.in_len)] for i in range(args.requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.out_len, ignore_eos=True)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            llm.generate(prompts, params)
    finally:
        llm.close()
        tracer.close()
    slices = max(1, totals["slices"])
    row: dict[str, float] = {"slices": totals["slices"], "polls": totals["polls"]}
    if args.bytecodes:
        row["bytecodes_per_slice"] = totals["bytecodes"] / slices
    else:
        row["us_per_slice"] = totals["cpu_ns"] / 1e3 / slices
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="samples/models/pycoder-14m")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--in-len", type=int, default=32)
    p.add_argument("--out-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--chunk", type=int, default=None, help="POLL_CHUNK (default: the engine's)")
    p.add_argument("--bytecodes", action="store_true", help="count bytecodes, not CPU time")
    p.add_argument("--trace", default="/tmp/stepscope_poll_cost.pftrace")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.requests < 1 or args.out_len < 1:
        p.error("--rounds, --requests and --out-len must be >= 1")
    if args.chunk is not None and args.chunk < 1:
        p.error("--chunk must be >= 1")
    engine_chunk = device_timeline.POLL_CHUNK
    if args.chunk is not None:
        device_timeline.POLL_CHUNK = args.chunk  # read by the poller at each stretch
    try:
        rows = [one_round(args, args.trace) for _ in range(args.rounds)]
        chunk = device_timeline.POLL_CHUNK
    finally:
        device_timeline.POLL_CHUNK = engine_chunk
    key = "bytecodes_per_slice" if args.bytecodes else "us_per_slice"
    for i, row in enumerate(rows, 1):
        print(f"round {i}: {row['slices']} slices in {row['polls']} polls on the poller thread, "
              f"{row[key]:.2f} {key.replace('_', ' ')}")  # fmt: skip
    result = {"rounds": rows, key: statistics.median(r[key] for r in rows), "poll_chunk": chunk}
    print(f"median: {result[key]:.2f} {key.replace('_', ' ')} (poller stretch {chunk} stages)")
    return result


if __name__ == "__main__":
    main()
