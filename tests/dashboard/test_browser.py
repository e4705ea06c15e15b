"""The dashboard in headless Chromium: each view loads a real trace and shows the analysis API's
numbers; bad uploads and path escapes are refused; the Perfetto handshake delivers the bytes."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest

from analysis import analyze_trace, compare_reports
from analysis.compare import wait_and_idle_lines
from dashboard.views import fmt_pct
from tests.dashboard.conftest import UPLOAD_CAP_MB, Server, TraceSet, screenshot

pytestmark = pytest.mark.browser


def choose(page: Any, name: str) -> None:
    """Click the open dropdown's option labelled exactly ``name``."""
    page.get_by_role("option", name=name, exact=True).click()


def pick(page: Any, name: str) -> None:
    """Choose ``name`` in the header's trace picker and wait for the overview cards."""
    page.click("#trace-picker")
    choose(page, name)
    page.wait_for_selector(f".trace-title:text-is('{name}')")
    page.wait_for_selector("#overview .card")


def open_tab(page: Any, label: str) -> None:
    page.locator(".tab", has_text=label).click()


def _array(value: Any) -> list[Any]:
    """A plotly data array as sent to the browser: a list, or a typed-array spec (bdata)."""
    if isinstance(value, dict) and "bdata" in value:
        return np.frombuffer(
            base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"])
        ).tolist()
    return list(value or [])


def graph_data(page: Any, graph_id: str) -> list[dict[str, Any]]:
    """The plotly traces currently drawn in ``graph_id`` (read from the live plot's data)."""
    page.wait_for_function(
        f"() => {{ const g = document.querySelector('#{graph_id} .js-plotly-plot'); return g && g.data && g.data.length; }}"
    )
    raw = page.evaluate(
        f"""() => JSON.stringify(document.querySelector('#{graph_id} .js-plotly-plot').data.map(t => {{
            const plain = v => (v && v.bdata) ? v : (v ? Array.from(v) : []);
            return {{ name: t.name, type: t.type, x: plain(t.x), y: plain(t.y), base: plain(t.base),
                      text: t.text ? Array.from(t.text) : null }}; }}))"""
    )
    traces = json.loads(raw)
    for t in traces:
        for key in ("x", "y", "base"):
            t[key] = _array(t[key])
    return traces


def test_overview_shows_the_api_numbers(page: Any, traces: TraceSet) -> None:
    report = analyze_trace(traces.sync)
    pick(page, "sync.pftrace")
    page.wait_for_selector("#overview .js-plotly-plot")
    verdicts = page.locator(".verdicts li").all_inner_texts()
    assert verdicts == report.verdicts
    h = report.headline
    expected = {
        "overlap": h["overlap"],
        "bubble_ratio": h["bubble_ratio"],
        "wait_accepted_exposed_us": h["wait_accepted_exposed_us"],
        "hot_syncs": h["hot_syncs"],
        "silent_fallbacks": len(h["silent_fallbacks"]),
        "top_blame": h["top_blame"]["label"],
    }
    for key, value in expected.items():
        card = page.locator(f".card[data-metric='{key}']")
        shown = card.get_attribute("data-value")
        assert (
            (float(shown) == pytest.approx(value, rel=1e-12))
            if isinstance(value, float)
            else shown == str(value)
        )
    assert page.locator(".card[data-metric='overlap'] .card-value").inner_text() == fmt_pct(
        h["overlap"]
    )
    assert page.locator(".card[data-metric='bubble_ratio'] .card-value").inner_text() == fmt_pct(
        h["bubble_ratio"]
    )
    assert page.locator(".card[data-metric='hot_syncs'] .card-value").inner_text() == str(
        h["hot_syncs"]
    )
    # These traces carry no host_end_ns: the CPU lead cards say n/a, with their definitions.
    for key in ("cpu_lead_us_p50", "starved_steps_frac"):
        card = page.locator(f".card[data-metric='{key}']")
        assert card.get_attribute("data-value") == ""
        assert card.locator(".card-value").inner_text() == "n/a"
    aware = page.locator(".card[data-metric='bubble_ratio_starvation_aware']")
    assert float(aware.get_attribute("data-value")) == h["bubble_ratio_starvation_aware"]
    page.hover(".card[data-metric='overlap']")
    definition = page.locator(".card[data-metric='overlap'] .card-def")
    assert definition.is_visible() and "|W ∩ B| / |W|" in definition.inner_text()
    blame = graph_data(page, "overview")[0]
    assert blame["y"][::-1] == report.tables["blame"]["label"].head(8).tolist()
    screenshot(page, "overview")


def test_timeline_lanes_bubbles_and_zoom(page: Any, traces: TraceSet) -> None:
    report = analyze_trace(traces.sync)
    pick(page, "sync.pftrace")
    open_tab(page, "Timeline")
    page.wait_for_selector("#timeline-info:has-text('detail')")
    data = graph_data(page, "timeline")
    lanes = set(np.concatenate([t["y"] for t in data]).tolist())
    assert {
        "schedule",
        "prepare_inputs",
        "launch",
        "wait_output(accepted_count)",
        "update_from_output",
        "gpu:0 compute",
        "gpu:0 copy",
        "device idle",
    } <= lanes
    idle = [t for t in data if t["name"].startswith("idle: ")]
    assert sum(len(t["base"]) for t in idle) == len(report.tables["bubbles"])
    labels = sorted(x for t in idle for x in t["text"])
    assert labels == sorted(report.tables["bubbles"]["blame"].tolist())
    screenshot(page, "timeline_detail")


def _drag_zoom(page: Any, graph_id: str, x0: float, x1: float) -> None:
    box = page.locator(f"#{graph_id} .nsewdrag").first.bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] * x0, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * (x0 + x1) / 2, y, steps=4)
    page.mouse.move(box["x"] + box["width"] * x1, y, steps=4)
    page.mouse.up()


def test_big_trace_is_decimated_then_detailed_on_zoom(page: Any, traces: TraceSet) -> None:
    pick(page, "big.pftrace")
    open_tab(page, "Timeline")
    page.wait_for_selector("#timeline-info:has-text('density')")
    heat = graph_data(page, "timeline")
    assert [t["type"] for t in heat] == ["heatmap"]
    screenshot(page, "timeline_density")
    _drag_zoom(page, "timeline", 0.40, 0.41)
    page.wait_for_selector("#timeline-info:has-text('detail')")
    assert {t["type"] for t in graph_data(page, "timeline")} == {"bar"}
    screenshot(page, "timeline_zoomed")
    page.click("#timeline-reset")
    page.wait_for_selector("#timeline-info:has-text('density')")


def set_step_box(page: Any, which: int, value: str) -> None:
    """Type into one of the step slider's number boxes (they commit on blur) and wait for the
    timeline to redraw. A box typed into while the slider re-renders can lose the text, so the
    entry is retried (at most 5 times) until a redraw follows."""
    box = page.locator("#step-range input").nth(which)
    for _ in range(5):
        before = page.inner_text("#timeline-info")
        box.fill(value)
        box.press("Tab")
        try:
            page.wait_for_function(
                "b => document.querySelector('#timeline-info').innerText !== b",
                arg=before,
                timeout=10_000,
            )
            return
        except Exception:
            continue
    raise AssertionError(f"the timeline did not redraw after step box {which} = {value}")


def test_step_range_narrows_the_timeline(page: Any, traces: TraceSet) -> None:
    report = analyze_trace(traces.big)
    pick(page, "big.pftrace")
    open_tab(page, "Timeline")
    page.wait_for_selector("#timeline-info:has-text('density')")
    set_step_box(page, 1, "1020")
    set_step_box(page, 0, "1000")
    page.wait_for_selector("#timeline-info:has-text('detail')")
    steps = report.tables["steps"].set_index("step")
    lo, hi = int(steps.loc[1000, "start_ns"]), int(steps.loc[1020, "end_ns"])
    xr = page.evaluate(
        "() => document.querySelector('#timeline .js-plotly-plot').layout.xaxis.range"
    )
    t0 = int(
        report.frames.slices.query("role in ['cpu', 'compute', 'copy'] and name != 'step'")[
            "ts_ns"
        ].min()
    )
    assert xr == pytest.approx([(lo - t0) / 1e6, (hi - t0) / 1e6], abs=1e-6)


def test_per_step_charts_equal_the_tables(page: Any, traces: TraceSet) -> None:
    report = analyze_trace(traces.async_)
    pick(page, "async.pftrace")
    open_tab(page, "Per step")
    data = {t["name"]: t for t in graph_data(page, "steps-graph")}
    overlap = report.tables["overlap"]
    assert data["overlap"]["x"] == overlap["step"].tolist()
    np.testing.assert_allclose(data["overlap"]["y"], overlap["overlap"].to_numpy(float))
    steps = report.tables["steps"]
    np.testing.assert_allclose(
        np.array(data["step time"]["y"], dtype=float), steps["step_ns"].to_numpy(float) / 1e6
    )
    np.testing.assert_allclose(
        data["exposed"]["y"], report.tables["waits"]["exposed_ns"].to_numpy(float) / 1e3
    )
    np.testing.assert_allclose(data["tokens"]["y"], steps["num_tokens"].to_numpy(float))
    np.testing.assert_allclose(data["accepted"]["y"], steps["num_accepted"].to_numpy(float))
    screenshot(page, "per_step")


def test_decisions_and_syncs_tables(page: Any, traces: TraceSet) -> None:
    report = analyze_trace(traces.sync)
    pick(page, "sync.pftrace")
    open_tab(page, "Decisions & syncs")
    page.wait_for_selector("#decisions-table td")
    rows = page.locator("#decisions-table tbody tr").all()
    silent = set(report.tables["silent_fallbacks"]["feature"])
    seen = {}
    for row in rows[1:]:  # the first row holds the headers
        cells = row.locator("td").all_inner_texts()
        seen[cells[0]] = row.locator("td").first.evaluate(
            "td => getComputedStyle(td).backgroundColor"
        )
    assert set(seen) == set(report.tables["decisions"]["feature"])
    assert {f for f, bg in seen.items() if bg == "rgb(253, 236, 236)"} == silent
    sync_cells = page.locator("#syncs-table tbody tr").nth(1).locator("td").all_inner_texts()
    top = report.tables["syncs"].iloc[0]
    assert sync_cells[:4] == [
        top["op"],
        top["where"],
        str(top["count"]),
        str(top["hot_after_warmup"]),
    ]
    screenshot(page, "decisions_syncs")


def test_compare_view_checks_the_contract(page: Any, traces: TraceSet) -> None:
    a, b = analyze_trace(traces.sync), analyze_trace(traces.async_)
    cmp = compare_reports(a, b)
    open_tab(page, "Compare")
    for box, name in (("#compare-a", "sync.pftrace"), ("#compare-b", "async.pftrace")):
        page.click(box)
        choose(page, name)
    status = page.wait_for_selector("#contract-status")
    assert (
        status.inner_text().startswith("A/B contract holds")
        and "async_scheduling" in status.inner_text()
    )
    cells = page.locator("#compare-deltas tbody tr").nth(1).locator("td").all_inner_texts()
    assert cells[:3] == [
        "overlap",
        fmt_pct(cmp.deltas["overlap"]["a"]),
        fmt_pct(cmp.deltas["overlap"]["b"]),
    ]
    card_a = page.locator("#compare-a-cards .card[data-metric='overlap']").get_attribute(
        "data-value"
    )
    card_b = page.locator("#compare-b-cards .card[data-metric='overlap']").get_attribute(
        "data-value"
    )
    assert float(card_a) == a.headline["overlap"] and float(card_b) == b.headline["overlap"]
    # The sentences `stepscope compare` prints after the contract: here the device idle per step.
    shown = page.locator("#compare-waits li").all_inner_texts()
    assert shown == wait_and_idle_lines(cmp) and shown[-1].startswith("device idle per step")
    page.wait_for_selector("#compare-body .js-plotly-plot")
    screenshot(page, "compare_ok")
    page.click("#compare-b")
    choose(page, "nested/other_model.pftrace")
    page.wait_for_selector("#contract-status:has-text('broken')")
    assert "model" in page.inner_text("#contract-status")
    screenshot(page, "compare_broken")


def _upload(page: Any, name: str, data: bytes) -> None:
    page.set_input_files(
        "#upload input[type=file]",
        files=[{"name": name, "mimeType": "application/octet-stream", "buffer": data}],
    )


def test_garbage_upload_shows_a_banner_and_the_app_stays_up(page: Any, traces: TraceSet) -> None:
    _upload(page, "garbage.pftrace", b"this is not a trace at all\n" * 40)
    banner = page.wait_for_selector(".banner--error")
    assert "not a trace stepscope can read" in banner.inner_text()
    screenshot(page, "banner_garbage")
    _upload(page, "huge.pftrace", b"\x0a" * int(UPLOAD_CAP_MB * 1024 * 1024 + 10))
    page.wait_for_selector(".banner--error:has-text('over the upload limit')")
    _upload(page, "sync-again.pftrace", traces.sync.read_bytes())  # a good upload still works
    page.wait_for_selector("#overview .card")
    assert page.locator(".banner--error").count() == 0
    value = page.locator(".card[data-metric='overlap']").get_attribute("data-value")
    assert float(value) == analyze_trace(traces.sync).headline["overlap"]


def test_path_traversal_is_refused(page: Any, dashboard: Server, traces: TraceSet) -> None:
    page.click("#trace-picker")
    # the menu renders after the click: wait for it (read at once, it was empty once in CI)
    page.wait_for_selector(".dash-dropdown-option:has-text('nested/other_model.pftrace')")
    options = page.locator(".dash-dropdown-option").all_inner_texts()
    assert "escape.pftrace" not in options and "nested/other_model.pftrace" in options
    page.keyboard.press("Escape")
    statuses = page.evaluate(
        """async (urls) => Promise.all(urls.map(async u => {
            const r = await fetch(u); const t = await r.text();
            return [r.status, t.includes('not for the browser')]; }))""",
        [
            "/stepscope/trace/traces/..%2Fsecret.pftrace",
            "/stepscope/trace/traces/escape.pftrace",
            "/stepscope/trace/traces/nested/..%2F..%2Fsecret.pftrace",
            "/stepscope/trace/traces/%2Fetc%2Fpasswd",
            "/stepscope/trace/traces//etc/passwd",
        ],
    )
    assert statuses == [[404, False]] * 5
    ok = page.evaluate("async () => (await fetch('/stepscope/trace/traces/sync.pftrace')).status")
    assert ok == 200


def test_open_in_perfetto_hands_over_the_exact_bytes(
    page: Any, traces: TraceSet, perfetto_stub: Server
) -> None:
    pick(page, "async.pftrace")
    with page.context.expect_page() as popup_info:
        page.click("#open-perfetto")
    popup = popup_info.value
    popup.wait_for_function("() => window.received !== null", timeout=30_000)
    received = popup.evaluate("() => window.received")
    assert base64.b64decode(received["b64"]) == traces.async_.read_bytes()
    assert received["title"] == "async.pftrace" and received["fileName"] == "async.pftrace"
    assert received["pings"] >= 3  # PING was repeated until the window answered
    page.wait_for_selector("#perfetto-status:has-text('sent')")
    href = page.get_attribute("#download-trace", "href")
    assert href.endswith("?download=1")
    body = page.evaluate(
        "async (u) => new Uint8Array(await (await fetch(u)).arrayBuffer()).length", href
    )
    assert body == traces.async_.stat().st_size
