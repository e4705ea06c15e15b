"""CPU lead, starvation-aware idle, kernel windows and sampled runs on hand-built traces whose
answers are computed independently (a 1 µs bitmap of the device timeline, numpy percentiles)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from analysis import analyze_trace
from analysis.metrics.lead import STARVED_LEAD_NS, clock_correction_ns, stage_lead
from tracekit.perfetto import write
from tracekit.recipes import (
    KERNEL_STEPS,
    PATTERN,
    REPEATS,
    US,
)
from tracekit.recipes import bitmap as _bitmap
from tracekit.recipes import lead_kernels as _kernels
from tracekit.recipes import lead_trace as _trace


def _ratios(d: Any, path: str = "") -> list[tuple[str, float]]:
    """Every number in a report dict whose key names a ratio, fraction, overlap or fill."""
    out = []
    if isinstance(d, dict):
        for k, v in d.items():
            key = str(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                if re.search(r"(^|_)(ratio|frac|overlap|fill|share)(_|$)", key):
                    out.append((f"{path}.{key}", float(v)))
            else:
                out += _ratios(v, f"{path}.{key}")
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out += _ratios(v, f"{path}[{i}]")
    return out


def test_lead_and_starvation_have_the_known_answers(tmp_path: Path) -> None:
    spec, truth = _trace()
    report = analyze_trace(write(spec, tmp_path / "t.pftrace"), window="all", skip_steps=0)
    h = report.headline
    lead = np.array(truth["lead"], dtype=np.float64)
    assert h["cpu_lead_us_p50"] == pytest.approx(np.percentile(lead, 50))
    assert h["cpu_lead_us_p10"] == pytest.approx(np.percentile(lead, 10))
    starved = lead * US < STARVED_LEAD_NS
    assert h["starved_steps_frac"] == pytest.approx(starved.mean()) and starved.sum() == REPEATS
    steps = report.tables["steps"].set_index("step")
    assert steps["cpu_lead_forward_us"].to_numpy() == pytest.approx(lead)
    # Idle from stage slices: a brute-force bitmap over the window.
    lo, hi = truth["busy"][0][0], truth["busy"][-1][1]
    idle = int((~_bitmap(truth["busy"], lo, hi)).sum())
    assert h["bubble_ratio"] == pytest.approx(idle / (hi - lo))
    assert h["busy_source"] == "stage_slices" and h["bubble_ratio_bound"] == "lower_bound"
    # Starved mixed forwards: reference fit over decode forwards is exactly 800 + 25 * tokens.
    hidden = sum(
        (b - a) - (800 + 25 * 16)
        for (a, b), k in zip(truth["busy"], truth["kind"], strict=True)
        if k == "mixed"
    )
    assert report.tables["starved"]["hidden_idle_ns"].sum() == hidden * US
    assert (report.tables["starved"]["method"] == "reference_fit").all()
    assert h["bubble_ratio_starvation_aware"] == pytest.approx((idle + hidden) / (hi - lo))
    phases = report.tables["phases"].set_index("phase")
    assert phases.loc["mixed", "starved_steps_frac"] == 1.0
    assert phases.loc["decode_only", "starved_steps_frac"] == 0.0
    st = report.tables["starvation"].set_index("phase")
    assert st.loc["mixed", "blame"] == "launch (mixed)"
    assert st.loc["mixed", "launch_ms_p50"] == pytest.approx(3.1)
    assert st.loc["mixed", "stage_ms_p50"] == pytest.approx(2.92)
    says = " ".join(report.verdicts)
    assert "Mixed steps are launch-bound" in says and "100% of them" in says
    assert "host launch 3.10 ms vs device slices 2.92 ms" in says and "launch (mixed)" in says
    assert "lower bound" in says
    assert all(0.0 <= v <= 1.0 for _, v in _ratios(report.to_dict())), _ratios(report.to_dict())


def test_no_host_end_ns_gives_null_lead_and_says_why(tmp_path: Path) -> None:
    spec, _ = _trace(with_lead=False)
    report = analyze_trace(write(spec, tmp_path / "t.pftrace"), window="all", skip_steps=0)
    for key in ("cpu_lead_us_p50", "cpu_lead_us_p10", "starved_steps_frac"):
        assert report.headline[key] is None
    assert report.headline["bubble_ratio_starvation_aware"] == report.headline["bubble_ratio"]
    assert any("CPU lead not measured" in v and "host_end_ns" in v for v in report.verdicts)


def test_kernel_window_replaces_stage_slices(tmp_path: Path) -> None:
    spec, truth = _trace(with_kernels=True)
    report = analyze_trace(write(spec, tmp_path / "t.pftrace"), window="all", skip_steps=0)
    # The kernel window's edges split the measured runs (the profiler starts before step 8 and
    # stops before step 16 or 17): runs 0..7, 8..15, 16, 17..; each measured over its cycles,
    # from the end of its first step's device work to its last step's end.
    busy = truth["busy"]
    runs = [(0, 7), (8, 15), (16, 16), (17, len(busy) - 1)]
    idle = span = 0
    for first, last in runs:
        lo, hi = busy[first][1], busy[last][1]
        inside = [(a, b) for a, b in truth["kernel_busy"] if b > lo and a < hi]
        idle += int((~_bitmap(inside, lo, hi)).sum())
        span += hi - lo
    assert report.headline["bubble_ratio"] == pytest.approx(idle / span)
    assert list(report.tables["runs"]["split"]) == ["first", "profiler", "profiler", "profiler"]
    # Step 16 alone measures no cycle; its span lies in the kernel window's span.
    sources = list(report.tables["runs"]["busy_source"])
    assert sources[:2] == ["stage_slices", "kernels"] and sources[3] == "stage_slices"
    assert report.headline["busy_source"] == "kernels_and_stage_slices"
    fill = report.tables["fill"].set_index("step")
    assert list(fill.index) == list(KERNEL_STEPS)
    for step in KERNEL_STEPS:
        a, b = truth["busy"][step]
        kern = sum(min(k1, b) - max(k0, a) for k0, k1 in _kernels(truth["kind"][step], a, b))
        assert fill.loc[step, "fill"] == pytest.approx(kern / (b - a))
    # Starved stages inside the kernel window are measured, not estimated; outside it the
    # window's measured fill of starved mixed forwards (5 x 100 µs of 2920) calibrates them.
    starved = report.tables["starved"]
    assert not starved["step"].isin(list(KERNEL_STEPS)).any() and len(starved) == REPEATS - 2
    assert (starved["method"] == "kernel_fill").all()
    dur = (starved["end_ns"] - starved["ts_ns"]).to_numpy()
    np.testing.assert_allclose(starved["est_busy_ns"], np.rint(dur * 500 / 2920), atol=1)
    # Over the kernel window alone, busy is all kernels: bubble_ratio is measured.
    window = analyze_trace(tmp_path / "t.pftrace", window="8:16", skip_steps=0)
    assert window.headline["busy_source"] == "kernels"
    assert window.headline["bubble_ratio_bound"] == "measured"


def _drop_steps(frames: Any, keep: np.ndarray) -> Any:
    step = frames.slices["step"].to_numpy(np.int64)
    frames.slices = frames.slices[(step < 0) | np.isin(step, keep)].reset_index(drop=True)
    return frames


def test_sampled_runs_measure_what_the_full_trace_does(tmp_path: Path) -> None:
    from analysis import analyze_frames, load_trace

    spec, _ = _trace()
    path = write(spec, tmp_path / "t.pftrace")
    full = analyze_frames(load_trace(path), window="all", skip_steps=1)
    steps = np.arange(len(PATTERN) * REPEATS)
    # Runs of 4 consecutive steps (one whole pattern), one run in 2 kept.
    keep = steps[(steps // 4) % 2 == 0]
    sampled = analyze_frames(_drop_steps(load_trace(path), keep), window="all", skip_steps=1)
    assert len(sampled.tables["runs"]) == REPEATS // 2
    # Every kept step's schedule is paired with the forward it ran under: the first step of a
    # run ran under a dropped forward and is left out, not counted as exposed.
    assert full.headline["overlap"] == 1.0 and sampled.headline["overlap"] == 1.0
    # Idle is measured inside runs only; each run loses the one inter-step gap at its edge.
    for key in ("bubble_ratio", "bubble_ratio_starvation_aware", "starved_steps_frac"):
        assert sampled.headline[key] == pytest.approx(full.headline[key], abs=0.05), key
    naive_window = sampled.headline["window"]["duration_ms"] * 1e6
    idle_ns = sampled.headline["bubbles"]["idle_ms"] * 1e6
    assert idle_ns / naive_window < sampled.headline["bubble_ratio"]  # the gaps are not idle
    assert all(0.0 <= v <= 1.0 for _, v in _ratios(sampled.to_dict()))


def test_negative_leads_shift_the_device_clock_and_say_by_how_much() -> None:
    """A stream cannot reach an event before the host records it: leads of -40 us mean the
    device times are early. The shift is the most negative lead (p1 over >= 100 stages)."""
    import pandas as pd

    rng = np.random.default_rng(0)
    n = 200
    host = np.arange(n, dtype=np.int64) * 1_000_000
    raw = np.where(np.arange(n) % 2 == 0, -40_000, 2_000_000) + rng.integers(0, 500, n)
    slices = pd.DataFrame(
        {
            "step": np.arange(n) // 2,
            "name": np.where(np.arange(n) % 2 == 0, "input_prep", "forward"),
            "role": "compute",
            "ts_ns": host - 10_000,
            "end_ns": host + raw,
            "host_end_ns": host,
        }
    )
    shift = clock_correction_ns(raw)
    assert shift == -int(np.quantile(raw, 0.01))
    stages = stage_lead(slices)
    assert stages.attrs["clock_correction_ns"] == shift
    assert stages["lead_ns"].min() >= -500  # p1, not the minimum: within the 500 ns jitter
    assert np.quantile(stages["lead_ns"], 0.01) == pytest.approx(0, abs=1)
    # Leads that are all positive are left as they are.
    assert clock_correction_ns(np.array([5_000, 2_000_000])) == 0
