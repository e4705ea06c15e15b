"""Table-driven synthetic traces with answers worked out by hand (times in µs, S = 1000 ns)."""

from __future__ import annotations

from pathlib import Path

import pytest

from analysis import analyze_trace, load_trace
from tracekit.perfetto import TraceSpec, write
from tracekit.recipes import blocked_trace as _blocked

S = 1000


def _hidden() -> TraceSpec:
    """Scheduling entirely under device work, device never idle between steps."""
    t = TraceSpec()
    for step in range(1, 4):
        t.gpu("forward", step * 100 * S, (step + 1) * 100 * S, step=step)
        t.cpu("schedule", (step * 100 + 10) * S, (step * 100 + 40) * S, step=step)
        t.cpu(
            "wait_output",
            (step * 100 + 50) * S,
            (step * 100 + 90) * S,
            step=step,
            kind="accepted_count",
        )
    return t


CASES = [
    pytest.param(
        _blocked,
        {
            "overlap": 70 / 190,
            "bubble_ratio": 200 / 500,
            "bubbles.count": 2,
            "top_blame.label": "wait_output(accepted_count)",
            "top_blame.share": 120 / 200,
            "wait_accepted_total_us": 140.0,
            "wait_accepted_exposed_us": 120.0,
            "wait_accepted_hidden_us": 20.0,
            "hot_syncs": 1,
            "ttft_ms.p50": 0.150,
            "tpot_ms.p50": 0.100,
            "window.num_steps": 3,
        },
        id="blocked",
    ),
    pytest.param(
        _hidden,
        {
            "overlap": 1.0,
            "bubble_ratio": 0.0,
            "bubbles.count": 0,
            "top_blame": None,
            "wait_accepted_total_us": 120.0,
            "wait_accepted_exposed_us": 0.0,
            "wait_accepted_hidden_us": 120.0,
            "hot_syncs": 0,
            "ttft_ms.count": 0,
        },
        id="hidden",
    ),
]


def _get(d: dict, dotted: str) -> object:
    for key in dotted.split("."):
        d = d[key]
    return d


@pytest.mark.parametrize(("build", "expected"), CASES)
@pytest.mark.parametrize("intern", [False, True])
def test_headline_numbers(tmp_path: Path, build, expected: dict, intern: bool) -> None:
    path = write(build(), tmp_path / "t.pftrace", intern=intern)
    report = analyze_trace(path, skip_steps=0)
    for key, want in expected.items():
        got = _get(report.headline, key)
        if isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-9), key
        else:
            assert got == want, key


def test_bubble_blame_and_decisions(tmp_path: Path) -> None:
    report = analyze_trace(write(_blocked(), tmp_path / "t.pftrace"), skip_steps=0)
    bubbles = report.tables["bubbles"]
    assert bubbles["blame"].tolist() == ["schedule", "wait_output(accepted_count)"]
    assert bubbles["blame_share"].tolist() == pytest.approx([0.5, 0.8])
    blame = dict(
        zip(report.tables["blame"]["label"], report.tables["blame"]["idle_ns"], strict=False)
    )
    assert blame == {
        "wait_output(accepted_count)": 120 * S,
        "schedule": 70 * S,
        "(no cpu slice)": 10 * S,
    }
    silent = {r["feature"]: r["why"] for r in report.headline["silent_fallbacks"]}
    assert set(silent) == {"cuda_graphs", "triton"}
    assert "no reason" in silent["triton"]
    (ineff,) = report.headline["ineffective"]
    assert ineff["feature"] == "async_scheduling"
    assert ineff["top_blocker"] == "wait_output(accepted_count)"
    assert report.verdicts[0].startswith(
        "async_scheduling is on but hides only 37% of CPU scheduling; 60%"
    )


def test_step_table_and_per_step_overlap(tmp_path: Path) -> None:
    report = analyze_trace(write(_blocked(), tmp_path / "t.pftrace"), skip_steps=0)
    steps = report.tables["steps"]
    assert steps["step"].tolist() == [1, 2, 3]
    assert steps["schedule_ns"].tolist() == [100 * S, 50 * S, 40 * S]
    assert steps["device_busy_ns"].tolist() == [100 * S] * 3
    assert steps["num_tokens"].tolist() == [8, 8, 8]
    per = report.tables["overlap"]
    assert per["overlap"].tolist() == pytest.approx([0.5, 0.0, 0.5])


def test_warmup_step_is_skipped_by_default(tmp_path: Path) -> None:
    report = analyze_trace(write(_blocked(), tmp_path / "t.pftrace"))
    w = report.headline["window"]
    assert (w["first_step"], w["last_step"], w["num_steps"]) == (2, 3, 2)
    assert report.headline["overlap"] == pytest.approx(20 / 90)


def test_interned_and_plain_encodings_load_the_same(tmp_path: Path) -> None:
    plain = load_trace(write(_blocked(), tmp_path / "a.pftrace"))
    interned = load_trace(write(_blocked(), tmp_path / "b.pftrace", intern=True))
    cols = ["track", "name", "ts_ns", "end_ns", "depth", "step", "kind"]
    assert plain.slices[cols].equals(interned.slices[cols])
    assert plain.decisions.equals(interned.decisions)
