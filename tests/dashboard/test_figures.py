"""Figure builders against references: every slice and bubble drawn in detail, density equal to
a brute-force occupancy, per-step series equal to the analysis tables, min/max thinning exact."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis import Report, analyze_trace
from dashboard.figures import STEP_PANELS, decimate_minmax, steps_figure
from dashboard.lanes import IDLE_LANE, LaneIndex
from dashboard.timeline import timeline_figure
from tests.dashboard.conftest import TraceSet


@pytest.fixture(scope="module")
def report(traces: TraceSet) -> Report:
    return analyze_trace(traces.sync)


@pytest.fixture(scope="module")
def index(report: Report) -> LaneIndex:
    return LaneIndex.from_frames(report.frames.slices, report.tables["bubbles"])


def _drawn(slices: pd.DataFrame) -> pd.DataFrame:
    cpu = (slices["role"] == "cpu") & (slices["name"] != "step")
    return slices[cpu | slices["role"].isin(["compute", "copy"])]


def test_detail_draws_every_slice_and_bubble(report: Report, index: LaneIndex) -> None:
    fig = timeline_figure(index, bar_budget=1_000_000)
    assert fig.layout.meta["mode"] == "detail"
    bars = [t for t in fig.data if t.type == "bar"]
    idle = [t for t in bars if t.name.startswith("idle: ")]
    work = [t for t in bars if not t.name.startswith("idle: ")]
    assert sum(len(t.base) for t in work) == len(_drawn(report.frames.slices))
    bubbles = report.tables["bubbles"].sort_values("start_ns")
    base = np.sort(np.concatenate([np.asarray(t.base, dtype=float) for t in idle]))
    np.testing.assert_allclose(
        base, (bubbles["start_ns"].to_numpy() - index.t0_ns) / 1e6, rtol=0, atol=1e-9
    )
    by_label = {t.name[len("idle: ") :]: len(t.base) for t in idle}
    assert by_label == bubbles["blame"].value_counts().to_dict()
    assert all(list(t.text) == [t.name[len("idle: ") :]] * len(t.base) for t in idle)


def test_zoom_window_keeps_only_intersecting_slices(report: Report, index: LaneIndex) -> None:
    lo = index.t0_ns + (index.end_ns - index.t0_ns) // 3
    hi = lo + (index.end_ns - index.t0_ns) // 10
    fig = timeline_figure(index, lo, hi, bar_budget=1_000_000)
    drawn = _drawn(report.frames.slices)
    expected = int(((drawn["end_ns"] > lo) & (drawn["ts_ns"] < hi)).sum())
    work = [t for t in fig.data if t.type == "bar" and not t.name.startswith("idle: ")]
    assert sum(len(t.base) for t in work) == expected
    assert tuple(fig.layout.xaxis.range) == pytest.approx(
        ((lo - index.t0_ns) / 1e6, (hi - index.t0_ns) / 1e6)
    )


def _brute_occupancy(starts: np.ndarray, ends: np.ndarray, edges: np.ndarray) -> np.ndarray:
    out = []
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        covered = np.zeros(int(b - a), dtype=bool)
        for s, e in zip(starts, ends, strict=True):
            lo, hi = max(int(s), int(a)), min(int(e), int(b))
            if hi > lo:
                covered[lo - int(a) : hi - int(a)] = True
        out.append(covered.mean())
    return np.array(out)


def test_density_equals_brute_force_occupancy(report: Report, index: LaneIndex) -> None:
    lo = index.t0_ns + 1_000_000
    hi = lo + 400_000  # 0.4 ms so the per-nanosecond reference stays cheap
    fig = timeline_figure(index, lo, hi, bar_budget=0, num_bins=20)  # density forced
    assert fig.layout.meta["mode"] == "density"
    edges = np.linspace(lo, hi, 21).round().astype(np.int64)
    drawn = _drawn(report.frames.slices)
    (heat,) = fig.data
    for label, row in zip(heat.y, heat.z, strict=True):
        if label == IDLE_LANE:
            offset, part = 4, report.tables["bubbles"].rename(columns={"start_ns": "ts_ns"})
        elif label.startswith("gpu:"):
            offset, part = 2, drawn[drawn["track"] == label]
        else:
            name, _, kind = label.partition("(")
            cpu = drawn[drawn["role"] == "cpu"]
            offset, part = 0, cpu[(cpu["name"] == name) & (cpu["kind"] == kind.rstrip(")"))]
        ref = _brute_occupancy(part["ts_ns"].to_numpy(), part["end_ns"].to_numpy(), edges)
        np.testing.assert_allclose(
            np.asarray(row, dtype=float) - offset, ref, atol=1e-12, err_msg=label
        )


def test_density_is_chosen_above_the_budget(traces: TraceSet) -> None:
    report = analyze_trace(traces.big)
    index = LaneIndex.from_frames(report.frames.slices, report.tables["bubbles"])
    assert timeline_figure(index).layout.meta["mode"] == "density"
    narrow = timeline_figure(index, index.t0_ns, index.t0_ns + 2_000_000)
    assert narrow.layout.meta["mode"] == "detail"


@pytest.mark.parametrize("n,budget", [(10, 100), (1000, 100), (1001, 64), (50_000, 4000)])
def test_decimate_minmax_keeps_each_buckets_extremes(n: int, budget: int) -> None:
    rng = np.random.default_rng(n)
    x = np.arange(n)
    y = rng.normal(size=n)
    y[rng.integers(0, n, size=max(n // 50, 1))] = np.nan
    dx, dy = decimate_minmax(x, y, budget)
    if n <= budget:
        assert dx is x and dy is y
        return
    assert dx.size <= budget and np.all(np.diff(dx) > 0)
    bucket = (x * (budget // 2)) // n
    for b in range(budget // 2):
        sel = bucket == b
        vals = y[sel]
        if np.all(np.isnan(vals)):
            continue
        kept = dy[np.isin(dx, x[sel])]
        assert np.nanmin(vals) in kept and np.nanmax(vals) in kept


def test_steps_figure_series_equal_analysis_tables(report: Report) -> None:
    fig = steps_figure(report)
    by_name = {t.name: t for t in fig.data}
    for _, series in STEP_PANELS:
        for label, table, column, scale, _ in series:
            df = report.tables[table]
            if column not in df.columns:
                assert label not in by_name
                continue
            trace = by_name[label]
            np.testing.assert_array_equal(trace.x, df["step"].to_numpy())
            np.testing.assert_allclose(
                np.asarray(trace.y, dtype=float),
                pd.to_numeric(df[column]).to_numpy(dtype=float) * scale,
            )
