"""The steady-state window on synthetic traces with a warm-up and a cool-down; --window A:B/all."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from analysis import TraceError, analyze_trace
from analysis.metrics.steady import SteadyRule, stable_steps, steady_range
from tracekit.perfetto import TraceSpec, write

MS = 1_000_000


def _trace(batches: list[int], step_ms: list[float]) -> TraceSpec:
    """One step per entry: a schedule slice (num_reqs = batch) and a forward filling the step."""
    t = TraceSpec()
    base = 0
    for step, (batch, ms) in enumerate(zip(batches, step_ms, strict=True)):
        dur = int(ms * MS)
        sched = {"num_reqs": batch, "num_tokens": batch, "num_prefill": 0}
        sched |= {"num_decode": batch, "num_spec_tokens": 0}
        t.cpu("schedule", base, base + dur // 10, step=step, **sched)
        t.gpu("forward", base + dur // 10, base + dur, step=step)
        base += dur
    return t


def _steps(batches: list[int], step_ms: list[float]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "step": range(len(batches)),
            "num_reqs": batches,
            "step_ns": [ms * MS for ms in step_ms[:-1]] + [float("nan")],
        }
    )


WARM = ([1, 4, 8, 16, 24], [5.0] * 5)  # ramping batch, slow first steps
STEADY = ([32, 31, 32, 33, 32] * 8, [1.0, 1.1, 0.9, 1.0, 1.0] * 8)
COOL = ([16, 8, 4, 2, 1, 1], [1.0] * 6)  # the batch drains

# name: (batches, step times, expected (first, last) or None)
CASES = {
    "warm-up and cool-down": (
        WARM[0] + STEADY[0] + COOL[0],
        WARM[1] + STEADY[1] + COOL[1],
        (5, 44),
    ),
    "warm-up only": (WARM[0] + STEADY[0], WARM[1] + STEADY[1], (5, 44)),
    "cool-down only": (STEADY[0] + COOL[0], STEADY[1] + COOL[1], (0, 39)),
    "one slow step inside stays inside": (
        STEADY[0][:20] + [32] + STEADY[0][:20],
        STEADY[1][:20] + [9.0] + STEADY[1][:20],
        (0, 40),
    ),
    "too few steps": ([32] * 5, [1.0] * 5, None),
    "never stable": ([1, 64] * 20, [1.0, 9.0] * 20, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_steady_range(name: str) -> None:
    batches, times, expected = CASES[name]
    assert steady_range(_steps(batches, times)) == expected


def test_stable_steps_without_batch_sizes_uses_step_time() -> None:
    steps = _steps(WARM[0] + STEADY[0], WARM[1] + STEADY[1]).drop(columns="num_reqs")
    ok = stable_steps(steps, SteadyRule())
    assert not ok.iloc[:5].any() and ok.iloc[5:].all()


def test_report_uses_the_steady_window_by_default(tmp_path: Path) -> None:
    batches, times, _ = CASES["warm-up and cool-down"]
    path = write(_trace(batches, times), tmp_path / "t.pftrace")
    window = analyze_trace(path).headline["window"]
    assert (window["rule"], window["first_step"], window["last_step"]) == ("steady", 5, 44)
    assert window["num_steps"] == 40 and window["skipped_steps"] == 5 and window["note"] == ""
    every = analyze_trace(path, window="all", skip_steps=0).headline["window"]
    assert (every["first_step"], every["last_step"], every["num_steps"]) == (0, 50, 51)


def test_explicit_step_window_is_half_open(tmp_path: Path) -> None:
    batches, times, _ = CASES["warm-up and cool-down"]
    path = write(_trace(batches, times), tmp_path / "t.pftrace")
    report = analyze_trace(path, window="10:20")
    w = report.headline["window"]
    assert (w["rule"], w["first_step"], w["last_step"], w["num_steps"]) == ("steps", 10, 19, 10)
    assert report.tables["steps"]["step"].tolist() == list(range(10, 20))
    with pytest.raises(TraceError):
        analyze_trace(path, window="100:200")
    with pytest.raises(TraceError):
        analyze_trace(path, window="steadyish")


def test_no_steady_state_falls_back_to_all_with_a_note(tmp_path: Path) -> None:
    batches, times, _ = CASES["never stable"]
    path = write(_trace(batches, times), tmp_path / "t.pftrace")
    w = analyze_trace(path).headline["window"]
    assert w["rule"] == "all" and "no steady state" in w["note"] and w["first_step"] == 1
