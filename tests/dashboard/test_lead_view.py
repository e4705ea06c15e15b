"""The CPU-lead cards and the per-step lead panel show the analysis' own numbers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from analysis import analyze_trace
from dashboard.figures import LEAD_PANEL, steps_figure
from dashboard.views import DEFINITIONS, _cards
from tests.analysis.test_lead import _trace
from tests.analysis.tracegen import write

KEYS = ("cpu_lead_us_p50", "starved_steps_frac", "bubble_ratio_starvation_aware")


def test_lead_cards_and_panel_equal_the_report(tmp_path: Path) -> None:
    spec, _ = _trace()
    report = analyze_trace(write(spec, tmp_path / "lead.pftrace"), window="all", skip_steps=0)
    cards = {c.key: c for c in _cards(report)}
    for key in KEYS:
        assert cards[key].value == report.headline[key] and DEFINITIONS[key]
    assert cards["cpu_lead_us_p50"].shown == f"{report.headline['cpu_lead_us_p50'] / 1e3:,.2f} ms"
    assert "lower bound" in cards["bubble_ratio"].sub
    fig = steps_figure(report)
    lead = next(t for t in fig.data if t.name == "CPU lead")
    steps = report.tables["steps"]
    np.testing.assert_array_equal(lead.x, steps["step"].to_numpy())
    np.testing.assert_allclose(lead.y, steps["cpu_lead_us"].to_numpy(float) / 1e3)
    assert [s.y0 for s in fig.layout.shapes] == pytest.approx([0.05])  # the starved threshold


def test_without_host_end_ns_the_cards_say_so(tmp_path: Path) -> None:
    spec, _ = _trace(with_lead=False)
    report = analyze_trace(write(spec, tmp_path / "nolead.pftrace"), window="all", skip_steps=0)
    cards = {c.key: c for c in _cards(report)}
    assert cards["cpu_lead_us_p50"].shown == "n/a"
    assert cards["cpu_lead_us_p50"].sub == "not recorded in this trace"
    fig = steps_figure(report)
    assert "CPU lead" not in {t.name for t in fig.data}
    notes = [a.text for a in fig.layout.annotations]
    assert LEAD_PANEL in notes and "not recorded in this trace" in notes
