"""bench/bench_sampled_trace.py's verdict: medians per mode, the ±0.05 check, and every ratio
of every report inside [0, 1] (the engine runs themselves are covered by
tests/analysis/test_sampled_engine.py; this checks the bench's arithmetic)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "bench_sampled_trace.py"
_spec = importlib.util.spec_from_file_location("bench_sampled_trace", _PATH)
assert _spec is not None and _spec.loader is not None
bst = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bst)


def _row(overlap: float, bubble: float, bad: list[str] | None = None) -> dict[str, object]:
    return {
        "overlap": overlap,
        "bubble_ratio": bubble,
        "cpu_lead_us_p50": 100.0,
        "starved_steps_frac": 0.0,
        "out_of_range": bad or [],
    }


def test_ratios_outside_0_1_are_found_at_any_depth() -> None:
    report = {
        "headline": {"overlap": 0.9, "bubble_ratio": 3.21, "cpu_lead_us_p50": 2100.0},
        "tables": {"phases": [{"bubble_ratio": 0.2, "starved_steps_frac": -0.1}]},
        "share_list": [{"share": 1.0}],
    }
    bad = bst.out_of_range_ratios(report)
    assert bad == [(".headline.bubble_ratio", 3.21), (".tables.phases[0].starved_steps_frac", -0.1)]


def test_compare_takes_medians_and_checks_the_tolerance() -> None:
    full = [_row(0.90, 0.10), _row(0.96, 0.02), _row(0.93, 0.05)]
    close = [_row(0.95, 0.04), _row(0.92, 0.07)]
    res = bst.compare(full, close)
    assert res["overlap"]["full"] == pytest.approx(0.93)
    assert res["overlap"]["full_spread"] == pytest.approx(0.06)
    assert res["overlap"]["diff"] == pytest.approx(0.935 - 0.93)
    assert res["overlap"]["within_tolerance"] and res["bubble_ratio"]["within_tolerance"]
    assert res["no_ratio_outside_0_1"]
    far = bst.compare(full, [_row(0.00, 0.73, ["headline.bubble_ratio=3.210"])])
    assert not far["overlap"]["within_tolerance"]
    assert not far["bubble_ratio"]["within_tolerance"]
    assert not far["no_ratio_outside_0_1"] and far["out_of_range"]
