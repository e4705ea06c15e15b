"""A rank set in headless Chromium: picked as one entry, its per-rank table shows the analysis'
numbers, both figures render them, each rank's own page is one click away, a broken set is a
banner."""

from __future__ import annotations

import base64
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import numpy as np
import pytest

from analysis.ranks.report import analyze_ranks
from tests.dashboard.conftest import TraceSet, screenshot
from tests.dashboard.test_browser import choose, graph_data

pytestmark = pytest.mark.browser

_COLUMN_IDS = """() => Array.from(document.querySelectorAll('#rank-table th[data-dash-column]'),
    th => ({id: th.getAttribute('data-dash-column')}))"""


def open_set(page: Any, label: str) -> None:
    page.click("#trace-picker")
    choose(page, label)
    page.wait_for_selector(f".trace-title:text-is('{label}')")


def _fixed(value: float, places: int) -> str:
    """``value`` rounded as d3-format (JavaScript's ``toFixed``) rounds: the exact binary value,
    a tie away from zero. Python's format rounds a tie to even: 0.5625 as a percentage with one
    decimal is 56.3 % in the browser and 56.2 % in Python (a TP run with 9 straggler steps of 16
    showed it)."""
    if not np.isfinite(value):
        return f"{value:,.{places}f}"
    exact = Decimal(value).quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP)
    return f"{exact:,.{places}f}"


def _shown(value: Any, fmt: str) -> str:
    """What the DataTable's d3 format of a column shows for ``value`` (see rank_view)."""
    if fmt == "pct":
        return f"{_fixed(value * 100, 1)}%"
    if fmt == "ms":
        return _fixed(value, 2)
    if fmt == "count":
        return f"{value:,}"
    return str(value)


_FORMATS = {
    "overlap": "pct",
    "bubble_ratio": "pct",
    "straggler_share": "pct",
    "straggler_steps": "count",
    **{c: "ms" for c in ("forward_ms", "collective_ms", "arrival_wait_ms", "all_reduce_wait_ms")},
    "broadcast_idle_ms": "ms",
}


def _heat_z(page: Any) -> np.ndarray:
    spec = page.evaluate(
        """() => { const z = document.querySelector('#rank-collectives .js-plotly-plot').data[0].z;
                   return (z && z.bdata) ? z : Array.from(z, r => Array.from(r)); }"""
    )
    if isinstance(spec, dict):  # a typed-array spec: {dtype, bdata, shape}
        flat = np.frombuffer(base64.b64decode(spec["bdata"]), dtype=np.dtype(spec["dtype"]))
        return flat.reshape([int(n) for n in str(spec["shape"]).split(",")])
    return np.asarray(spec, dtype=float)


def test_rank_set_page_shows_the_analysis(page: Any, traces: TraceSet) -> None:
    report = analyze_ranks([str(p) for p in traces.ranks])
    open_set(page, "tp (2 ranks)")
    page.wait_for_selector("#rank-table td")
    assert page.locator(".verdicts li").all_inner_texts() == report.verdicts
    headers = page.locator("#rank-table th").all_inner_texts()
    columns = [c for c in report.tables["ranks"].columns if c != "clock_offset_us"]
    rows = page.locator("#rank-table tbody tr").all()[1:]  # the first row holds the headers
    assert len(rows) == 2 and "straggler share" in [h.strip() for h in headers]
    shown = {c["id"]: i for i, c in enumerate(page.evaluate(_COLUMN_IDS))}
    for row, expected in zip(rows, report.tables["ranks"].to_dict("records"), strict=True):
        cells = row.locator("td").all_inner_texts()
        for column in columns:
            want = _shown(expected[column], _FORMATS.get(column, ""))
            assert cells[shown[column]].strip() == want, column

    stragglers = report.tables["stragglers"]
    drawn = {t["name"]: t for t in graph_data(page, "rank-stragglers")}
    rank = drawn["straggler rank (its forward ends last)"]
    assert rank["x"] == stragglers["step"].tolist()
    assert rank["y"] == stragglers["straggler_rank"].tolist()
    np.testing.assert_allclose(
        drawn["forward-end spread"]["y"], stragglers["end_spread_ns"].to_numpy(float) / 1e3
    )
    assert page.locator("#rank-stragglers .scatterlayer .trace").count() == 3

    coll = report.tables["collectives"]
    heat = graph_data(page, "rank-collectives")[0]
    assert heat["type"] == "heatmap" and heat["y"] == [0, 1]
    z = _heat_z(page)
    for r in coll.itertuples():
        cell = z[heat["y"].index(r.rank), heat["x"].index(r.step)]
        assert cell == pytest.approx((r.collective_ns + r.arrival_wait_ns) / 1e3, rel=1e-12)
    page.wait_for_selector("#rank-collectives .heatmaplayer image")
    assert page.locator(".tab--disabled").count() == 3  # no single timeline for a set
    screenshot(page, "rank_set")

    page.click("#overview button:text-is('rank 1')")  # rank 1's own page
    page.wait_for_selector(".trace-title:text-is('tp.rank1.pftrace')")
    overlap = page.locator(".card[data-metric='overlap']").get_attribute("data-value")
    assert float(overlap) == report.reports[1].headline["overlap"]
    assert page.locator(".tab--disabled").count() == 0
    page.click(".rank-set-link")  # and back
    page.wait_for_selector(".trace-title:text-is('tp (2 ranks)')")
    page.wait_for_selector("#rank-table td")

    page.click("#trace-picker")
    choose(page, "broken (2 ranks)")
    page.wait_for_selector(".trace-title:text-is('broken · could not be loaded')")
    banner = page.wait_for_selector(".banner--error")
    assert "broken.rank1.pftrace: not a trace stepscope can read" in banner.inner_text()
    assert page.locator("#rank-table").count() == 0  # nothing of the previous set stays
    screenshot(page, "rank_set_broken")
