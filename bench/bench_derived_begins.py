"""How far derived device begins fall from recorded ones, on a ``--trace-begins both`` trace.

A ``both`` trace keeps every device slice's recorded begin (the CUDA event on the stream) and
writes, on each slice that does not begin at the previous slice's end, the begin the timeline
derives without that event as the ``derived_begin_ns`` arg: the latest of the host time the
stage's enqueue began, the end of the slice before it on its stream and the end of the stage its
stream waited for (docs/design.md §4.3). That is a lower bound of the recorded begin, early by
the device's reaction latency. Per stage name this prints how many slices carry one and the
error recorded - derived in µs (p50, p90, p99, max), and how many errors are negative (< 0; and
< -1 µs, beyond the clock conversion's rounding): a lower bound has none. Then the report's
``overlap`` and ``bubble_ratio`` computed by the analysis package twice over the same trace: with
the recorded begins, and with the derived begins put in their place (what a ``derived`` trace of
the same run would have said).

    stepscope run ... --trace run.pftrace --trace-begins both
    python bench/bench_derived_begins.py run.pftrace [--window steady] [--json out.json]

(``bench/bench_trace_overhead.py --trace-begins both`` writes such traces too, under its
``trace_dir``.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from analysis import analyze_frames, load_trace  # noqa: E402
from analysis.errors import TraceError  # noqa: E402
from analysis.frames import TraceFrames  # noqa: E402
from instrument.schema import Arg, DeviceBegins  # noqa: E402

DERIVED = Arg.DERIVED_BEGIN_NS.value
ROUNDING_US = 1.0  # the clock conversion's rounding: negative errors within it are not counted
METRICS = ("overlap", "bubble_ratio")


def stage_errors(frames: TraceFrames) -> dict[str, dict[str, float]]:
    """Per stage name: ``count`` of slices with a derived begin, the error recorded - derived in
    µs (``p50_us``, ``p90_us``, ``p99_us``, ``max_us``, ``min_us``), ``negative`` (error < 0)
    and ``negative_beyond_rounding`` (error < -1 µs)."""
    slices = frames.slices
    if DERIVED not in slices.columns:
        return {}
    has = slices.dropna(subset=[DERIVED])
    out: dict[str, dict[str, float]] = {}
    for name, group in has.groupby("name", observed=True, sort=True):
        err = (group["ts_ns"].to_numpy(np.int64) - group[DERIVED].to_numpy(np.int64)) / 1e3
        p50, p90, p99 = np.percentile(err, [50, 90, 99])
        out[str(name)] = {
            "count": int(err.size),
            "p50_us": float(p50),
            "p90_us": float(p90),
            "p99_us": float(p99),
            "max_us": float(err.max()),
            "min_us": float(err.min()),
            "negative": int((err < 0).sum()),
            "negative_beyond_rounding": int((err < -ROUNDING_US).sum()),
        }
    return out


def with_derived_begins(frames: TraceFrames) -> TraceFrames:
    """The same frames with every slice that carries a derived begin starting there instead."""
    slices = frames.slices.copy()
    if DERIVED in slices.columns:
        has = slices[DERIVED].notna().to_numpy()
        begins = slices.loc[has, DERIVED].to_numpy(np.int64)
        slices.loc[has, "ts_ns"] = begins
        slices.loc[has, "dur_ns"] = slices.loc[has, "end_ns"].to_numpy(np.int64) - begins
    return dataclasses.replace(frames, slices=slices)


def metrics(frames: TraceFrames, window: str) -> dict[str, dict[str, float | None]]:
    """``overlap`` and ``bubble_ratio`` of the analysis report, with recorded and with derived
    begins."""
    out: dict[str, dict[str, float | None]] = {}
    for which, f in (("recorded", frames), ("derived", with_derived_begins(frames))):
        head = analyze_frames(f, window=window).headline
        out[which] = {m: None if head[m] is None else float(head[m]) for m in METRICS}
    return out


def measure(path: str, window: str = "steady") -> dict[str, Any]:
    """Everything the script prints, as a dict (``begins``: the trace's ``device_begins``)."""
    frames = load_trace(path)
    begins = str(frames.metadata.get(Arg.DEVICE_BEGINS.value, DeviceBegins.RECORDED.value))
    if begins != DeviceBegins.BOTH.value:
        raise SystemExit(
            f"{path}: device_begins is {begins!r}; run with --trace-begins both to measure derived "
            "begins against recorded ones"
        )
    return {
        "trace": path,
        "begins": begins,
        "stages": stage_errors(frames),
        "metrics": metrics(frames, window),
    }


def print_result(result: dict[str, Any]) -> None:
    print(f"{result['trace']}: derived device begins, error = recorded - derived begin (µs)")
    print(f"{'stage':<12} {'count':>6} {'p50':>8} {'p90':>8} {'p99':>8} {'max':>8} {'<0':>5} "
          f"{'<-1µs':>6}")  # fmt: skip
    for name, e in result["stages"].items():
        print(f"{name:<12} {e['count']:>6} {e['p50_us']:>8.2f} {e['p90_us']:>8.2f} "
              f"{e['p99_us']:>8.2f} {e['max_us']:>8.2f} {e['negative']:>5} "
              f"{e['negative_beyond_rounding']:>6}")  # fmt: skip
    m = result["metrics"]
    for key in METRICS:
        rec, der = _percent(m["recorded"][key]), _percent(m["derived"][key])
        print(f"{key:<12} recorded begins {rec:>8}   derived begins {der:>8}")


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.2f}%"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="a .pftrace written with --trace-begins both")
    p.add_argument("--window", default="steady", help="the report's window (steady, all, A:B)")
    p.add_argument("--json", default=None, help="also write the numbers as JSON here")
    args = p.parse_args(argv)
    try:
        result = measure(args.trace, args.window)
    except TraceError as exc:  # a missing or malformed trace: say so, no traceback
        p.exit(2, f"bench_derived_begins: {exc}\n")
    print_result(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
