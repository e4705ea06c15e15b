"""How big is a stepscope trace per engine step, and how fast is it written and loaded?

Writes ``--steps`` engine steps through the real :class:`~instrument.tracer.Tracer` (the slices,
args and counters the engine emits per step, see ``bench/_trace_steps.py``) at batch 1, 32 and 256,
with and without per-request tracks, then loads each trace with ``analysis.load_trace``.
bytes/step is the file size minus that of a trace with no steps, divided by the steps. Prints a
table and writes JSON (``--out``).

    python bench/bench_trace_size.py [--steps 2000] [--out out/bench_trace_size.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from analysis import load_trace  # noqa: E402
from bench._trace_steps import StepPattern, emit_steps  # noqa: E402
from instrument.tracer import Tracer  # noqa: E402

BATCHES = (1, 32, 256)
TARGET_BYTES_PER_STEP = 2048  # issue 9: batch 256, no request tracks


def write_trace(path: Path, steps: int, pattern: StepPattern) -> dict[str, float]:
    """Write ``steps`` steps; returns size and write times (wall and CPU, close included)."""
    c0, t0 = time.process_time(), time.perf_counter()
    tracer = Tracer(path, flush_interval_s=0.2)
    emit_steps(tracer, 0, steps, pattern)
    tracer.close()
    return {
        "bytes": path.stat().st_size,
        "write_s": time.perf_counter() - t0,
        "write_cpu_s": time.process_time() - c0,
    }


def load_times(path: Path) -> dict[str, float]:
    c0, t0 = time.process_time(), time.perf_counter()
    frames = load_trace(path)
    return {
        "load_s": time.perf_counter() - t0,
        "load_cpu_s": time.process_time() - c0,
        "slices": len(frames.slices),
    }


def measure(steps: int, tmp: str) -> list[dict[str, Any]]:
    empty = Path(tmp) / "empty.pftrace"
    header = write_trace(empty, 0, StepPattern(batch=1))["bytes"]
    rows: list[dict[str, Any]] = []
    for requests in (False, True):
        for batch in BATCHES:
            pattern = StepPattern(batch=batch, request_tracks=requests)
            path = Path(tmp) / f"b{batch}_r{int(requests)}.pftrace"
            w = write_trace(path, steps, pattern)
            row: dict[str, Any] = {
                "batch": batch,
                "request_tracks": requests,
                "steps": steps,
                **w,
                "bytes_per_step": (w["bytes"] - header) / steps,
                **load_times(path),
            }
            rows.append(row)
            os.remove(path)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "bench_trace_size.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(args.steps, tmp)
    print(
        f"{'batch':>6} {'req tracks':>10} {'bytes/step':>11} {'MB':>7} {'write s':>8} "
        f"{'(cpu)':>6} {'load s':>7} {'(cpu)':>6}"
    )
    for r in rows:
        print(
            f"{r['batch']:>6} {str(r['request_tracks']):>10} {r['bytes_per_step']:>11.0f} "
            f"{r['bytes'] / 1e6:>7.2f} {r['write_s']:>8.2f} {r['write_cpu_s']:>6.2f} "
            f"{r['load_s']:>7.2f} {r['load_cpu_s']:>6.2f}"
        )
    target = next(r for r in rows if r["batch"] == 256 and not r["request_tracks"])
    ok = target["bytes_per_step"] <= TARGET_BYTES_PER_STEP
    print(
        f"batch 256 without request tracks: {target['bytes_per_step']:.0f} B/step "
        f"(target <= {TARGET_BYTES_PER_STEP}: {'met' if ok else 'MISSED'})"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
