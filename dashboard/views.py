"""Dynamic page parts built from an analysis report: verdict cards, tables, compare, actions.

Numbers are the report's own (``Report.headline`` / ``Report.tables``), formatted for reading;
each card also carries the exact value in ``data-value`` so a test can compare without parsing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import pandas as pd
from dash import dash_table, dcc, html

from analysis import Comparison, Report
from dashboard.config import DashboardConfig
from dashboard.figures import blame_figure, compare_steps_figure
from dashboard.layout import TABLE_STYLE
from dashboard.store import LoadedTrace, TraceRef

__all__ = [
    "overview",
    "decision_rows",
    "silent_row_style",
    "sync_rows",
    "compare_body",
    "trace_actions",
    "banner",
    "fmt_pct",
    "fmt_num",
    "DEFINITIONS",
    "trace_url",
]

DEFINITIONS: dict[str, str] = {
    "overlap": "Schedule/forward overlap = |W ∩ B| / |W|. W: union of schedule and prepare_inputs slices "
    "(measured steps); B: union of device compute slices. 1.0 means all CPU scheduling is "
    "hidden under device work.",
    "bubble_ratio": "Σ device idle / window. Idle is the complement of device compute slices inside "
    "[first device slice start, last device slice end] of the measured steps; each "
    "maximal idle interval is a bubble. From stage slices it is a lower bound (a starved stage's "
    "slice covers launch gaps); from CUPTI kernels (--trace-kernels, Kineto) it is measured. "
    "Sampled traces: measured inside runs of consecutive kept steps only.",
    "wait_accepted_exposed_us": "Accepted-count wait exposure: |A ∩ idle|, A = wait_output(accepted_count) "
    "slices. Only the exposed part is recoverable; the hidden part (|A ∩ B|) "
    "waited while the device was busy, which costs nothing.",
    "hot_syncs": "Host-device syncs (.item(), .tolist(), .cpu(), bool(t), synchronize) marked hot=True "
    "after warm-up: each stalls the CPU until the device drains, a defect on the hot path.",
    "silent_fallbacks": "Features that ended up off without the user seeing why: requested True resolved "
    "False with no reason, or auto (None) resolved False.",
    "grammar_hidden_frac": "Structured output: Σ|G ∩ B| / Σ|G|, G = grammar_mask slices (the "
    "bitmask of step N+1, built once output N is back), B = device compute slices. With deferred "
    "sampling the forward of N+1 runs meanwhile; 'forward early' is the share of masked steps "
    "whose device work began before their mask was built. Exposed grammar wait: "
    "|wait_output(grammar) ∩ idle|.",
    "cpu_lead_us_p50": "CPU lead = (device time the stream reached a stage's end event) − (host "
    "time the CPU recorded that event), per device stage; a step's lead is its smallest compute "
    "stage lead. p50/p10 over the measured steps. Large: the CPU runs ahead of the device; near "
    "zero: the device caught up and waited for the host.",
    "starved_steps_frac": "Share of measured steps whose CPU lead fell below 50 µs: the device "
    "caught up with the host inside the step (starved), so that step's stage slices also hold "
    "launch gaps, not only device work.",
    "bubble_ratio_starvation_aware": "Device idle estimate that counts launch gaps inside starved "
    "stages: (stage-slice idle + Σ estimated gaps) / window. A starved stage's busy time is "
    "predicted from unstarved slices of the same stage (busy ≈ a + b·tokens, least squares); "
    "the rest of its slice is idle, blamed on launch (by phase). Equal to bubble_ratio where "
    "busy came from CUPTI kernels.",
    "top_blame": "The CPU slice running (deepest slice, largest share) during most of the device idle time.",
    "tpot_ms": "Time per output token after the first, per request, from the per-request tracks (p50).",
}


def fmt_pct(value: float | None) -> str:
    return (
        "n/a"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else f"{100 * value:.1f}%"
    )


def fmt_num(value: float | None, unit: str = "", digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:,.{digits}f}{(' ' + unit) if unit else ''}"


@dataclass(frozen=True)
class Card:
    key: str
    label: str
    value: Any
    shown: str
    sub: str
    tone: str  # "good", "warn", "bad" or ""


def _tone(bad: bool, warn: bool = False) -> str:
    return "bad" if bad else ("warn" if warn else "good")


def _cards(report: Report) -> list[Card]:
    h = report.headline
    window = h["window"]
    steps = max(int(window.get("num_steps") or 0), 1)
    exposed = h["wait_accepted_exposed_us"]
    silent = h["silent_fallbacks"]
    top = h["top_blame"]
    overlap = h["overlap"]
    cards = [
        Card(
            "overlap",
            "schedule/forward overlap",
            overlap,
            fmt_pct(overlap),
            "of CPU scheduling hidden under device work",
            "" if overlap is None else _tone(overlap < 0.5, overlap < 0.8),
        ),
        Card(
            "bubble_ratio",
            "bubble ratio",
            h["bubble_ratio"],
            fmt_pct(h["bubble_ratio"]),
            f"{h['bubbles']['count']:,} bubbles · {fmt_num(h['bubbles']['idle_ms'], 'ms', 2)} idle"
            + (" · lower bound" if h.get("bubble_ratio_bound") == "lower_bound" else ""),
            ""
            if h["bubble_ratio"] is None
            else _tone(h["bubble_ratio"] > 0.2, h["bubble_ratio"] > 0.05),
        ),
        *_lead_cards(h),
        Card(
            "wait_accepted_exposed_us",
            "exposed accepted-count wait",
            exposed,
            fmt_num(exposed / steps, "µs/step", 2),
            f"{fmt_num(exposed, 'µs')} exposed of {fmt_num(h['wait_accepted_total_us'], 'µs')} "
            f"(hidden {fmt_num(h['wait_accepted_hidden_us'], 'µs')})",
            _tone(exposed > 0.1 * max(h["wait_accepted_total_us"], 1e-9), exposed > 0),
        ),
        Card(
            "hot_syncs",
            "hot syncs after warm-up",
            h["hot_syncs"],
            f"{h['hot_syncs']:,}",
            "host-device syncs on the hot path",
            _tone(h["hot_syncs"] > 0),
        ),
        Card(
            "silent_fallbacks",
            "silent fallbacks",
            len(silent),
            f"{len(silent)}",
            ", ".join(str(r["feature"]) for r in silent) or "none",
            _tone(len(silent) > 0),
        ),
        Card(
            "top_blame",
            "top blame for idle",
            top["label"] if top else None,
            top["label"] if top else "n/a",
            f"{fmt_pct(top['share'])} of idle · {fmt_num(top['idle_ms'], 'ms', 2)}"
            if top
            else "no bubbles",
            "",
        ),
    ]
    if h.get("grammar_mask_ms"):  # structured output ran: how much grammar work was hidden
        hidden = h["grammar_hidden_frac"]
        cards.append(
            Card(
                "grammar_hidden_frac",
                "grammar work hidden",
                hidden,
                fmt_pct(hidden),
                f"{fmt_num(h['grammar_mask_ms'], 'ms', 2)} of masks · forward early in "
                f"{fmt_pct(h['grammar_overlap_steps_frac'])} of steps · "
                f"{fmt_num(h['grammar_wait_exposed_us'], 'µs')} wait exposed",
                "" if hidden is None else _tone(hidden < 0.5, hidden < 0.8),
            )
        )
    tpot = (h.get("tpot_ms") or {}).get("p50")
    if tpot is not None:
        ttft = (h.get("ttft_ms") or {}).get("p50")
        cards.append(
            Card(
                "tpot_ms",
                "TPOT p50",
                tpot,
                fmt_num(tpot, "ms", 3),
                f"TTFT p50 {fmt_num(ttft, 'ms', 2)}",
                "",
            )
        )
    return cards


def _lead_cards(h: dict[str, Any]) -> list[Card]:
    """CPU lead, starved steps and the starvation-aware idle (n/a without host_end_ns)."""
    p50, p10, starved = (
        h.get("cpu_lead_us_p50"),
        h.get("cpu_lead_us_p10"),
        h.get("starved_steps_frac"),
    )
    aware = h.get("bubble_ratio_starvation_aware")
    return [
        Card(
            "cpu_lead_us_p50",
            "CPU lead p50",
            p50,
            "n/a" if p50 is None else fmt_num(p50 / 1e3, "ms", 2),
            "not recorded in this trace" if p10 is None else f"p10 {fmt_num(p10 / 1e3, 'ms', 2)}",
            "" if p10 is None else _tone(p10 < 50, p10 < 500),
        ),
        Card(
            "starved_steps_frac",
            "starved steps",
            starved,
            fmt_pct(starved),
            "device waited for the host (lead < 50 µs)",
            "" if starved is None else _tone(starved > 0.5, starved > 0.05),
        ),
        Card(
            "bubble_ratio_starvation_aware",
            "idle, starvation-aware",
            aware,
            fmt_pct(aware),
            "estimate: starved stages' launch gaps counted as idle",
            "" if aware is None else _tone(aware > 0.2, aware > 0.05),
        ),
    ]


def _numeric(value: Any) -> bool:
    return value is None or isinstance(value, (int, float))


def _card(card: Card) -> html.Div:
    return html.Div(
        className=f"card card--{card.tone}" if card.tone else "card",
        title=DEFINITIONS.get(card.key, ""),
        **{"data-metric": card.key, "data-value": "" if card.value is None else str(card.value)},
        children=[
            html.Div(card.label, className="card-label"),
            html.Div(
                card.shown,
                className="card-value" + ("" if _numeric(card.value) else " card-value--text"),
            ),
            html.Div(card.sub, className="card-sub"),
            html.Div(DEFINITIONS.get(card.key, ""), className="card-def"),
        ],
    )


def cards_row(report: Report) -> html.Div:
    return html.Div([_card(c) for c in _cards(report)], className="cards")


def overview(loaded: LoadedTrace) -> list[Any]:
    """Verdict sentences, the verdict cards, idle-time blame, and what was measured."""
    report = loaded.report
    window = report.headline["window"]
    meta = report.frames.metadata
    info = [
        (
            "steps measured",
            f"{window.get('first_step')}…{window.get('last_step')} "
            f"({window.get('num_steps'):,}; {window.get('skipped_steps')} warm-up skipped)",
        ),
        ("window", fmt_num(window.get("duration_ms"), "ms", 2)),
        ("slices", f"{len(report.frames.slices):,}"),
        ("format", f"{meta.get('format')} · profile {meta.get('profile')}"),
        ("file", f"{loaded.size_bytes / 1e6:.2f} MB · analysed in {loaded.load_s:.2f} s"),
    ]
    if meta.get("bytes_dropped"):
        info.append(("truncated", f"{meta['bytes_dropped']:,} bytes cut off at the end"))
    return [
        html.Ul([html.Li(v) for v in report.verdicts], className="verdicts"),
        cards_row(report),
        html.Div(
            className="split",
            children=[
                html.Div(
                    [
                        html.H3("Device idle time, by blamed CPU slice"),
                        dcc.Graph(figure=blame_figure(report), config={"displayModeBar": False}),
                    ],
                    className="panel",
                ),
                html.Div(
                    [
                        html.H3("Measured"),
                        html.Dl(
                            [x for k, v in info for x in (html.Dt(k), html.Dd(v))],
                            className="facts",
                        ),
                    ],
                    className="panel",
                ),
            ],
        ),
    ]


def _text(value: Any) -> str:
    return "auto" if value is None else str(value)


def decision_rows(report: Report) -> list[dict[str, str]]:
    """Decisions table rows; ``silent`` holds the analysis' explanation for silent fallbacks."""
    silent = report.tables["silent_fallbacks"]
    why = {(r.feature, r.ts_ns): r.why for r in silent.itertuples()}
    return [
        {
            "feature": str(r.feature),
            "requested": _text(r.requested),
            "resolved": str(bool(r.resolved)),
            "reason": str(r.reason) or "—",
            "silent": why.get((r.feature, r.ts_ns), ""),
        }
        for r in report.tables["decisions"].itertuples()
    ]


def silent_row_style() -> list[dict[str, Any]]:
    return [
        {
            "if": {"filter_query": '{silent} != ""'},
            "backgroundColor": "#fdecec",
            "color": "#9b1c1c",
            "fontWeight": "600",
        }
    ]


def sync_rows(report: Report) -> list[dict[str, Any]]:
    """The analysis' sync summary, with one example stack per (op, where) from the sync frame."""
    summary = report.tables["syncs"]
    frame = report.frames.syncs
    stacks = frame.groupby(["op", "where"])["stack"].first().to_dict() if len(frame) else {}
    return [
        {
            "op": r.op,
            "where": r.where,
            "count": int(r.count),
            "hot_after_warmup": int(r.hot_after_warmup),
            "stack": stacks.get((r.op, r.where), ""),
        }
        for r in summary.itertuples()
    ]


def trace_url(ref: TraceRef) -> str:
    return "/stepscope/trace/" + quote(ref.id)


def trace_actions(loaded: LoadedTrace, config: DashboardConfig) -> list[Any]:
    """ "Open in Perfetto UI" (handled by assets/perfetto.js) and a plain download link."""
    url = trace_url(loaded.ref)
    return [
        html.Button(
            "Open in Perfetto UI",
            id="open-perfetto",
            className="btn btn-primary",
            **{
                "data-trace-url": url,
                "data-perfetto-url": config.perfetto_url,
                "data-perfetto-origin": config.perfetto_origin,
                "data-title": loaded.title,
                "data-file-name": loaded.title,
            },
        ),
        html.A("download", href=url + "?download=1", className="btn", id="download-trace"),
        html.Span(id="perfetto-status", className="perfetto-status"),
    ]


def banner(message: str, tone: str = "error") -> html.Div:
    return html.Div(
        [html.Strong("Could not open the trace. " if tone == "error" else ""), message],
        className=f"banner banner--{tone}",
        role="alert",
    )


def _table(rows: list[dict[str, Any]], table_id: str) -> dash_table.DataTable:
    cols = list(rows[0]) if rows else ["—"]
    return dash_table.DataTable(
        id=table_id, data=rows, columns=[{"name": c, "id": c} for c in cols], **TABLE_STYLE
    )


def _delta_rows(cmp: Comparison) -> list[dict[str, str]]:
    out = []
    for name, d in cmp.deltas.items():
        pct = name in (
            "overlap",
            "bubble_ratio",
            "grammar_hidden_frac",
            "starved_steps_frac",
            "bubble_ratio_starvation_aware",
        )
        fmt = (lambda v: fmt_pct(v)) if pct else (lambda v: fmt_num(v, digits=3))
        delta = d["delta"]
        shown = "n/a" if delta is None else (f"{100 * delta:+.1f} pp" if pct else f"{delta:+,.3f}")
        out.append({"metric": name, "A": fmt(d["a"]), "B": fmt(d["b"]), "Δ (B − A)": shown})
    return out


def compare_body(a: LoadedTrace, b: LoadedTrace, cmp: Comparison) -> list[Any]:
    """Contract check first, then the deltas, then both traces' cards and per-step curves."""
    if cmp.contract_ok:
        status = html.Div(
            [
                "A/B contract holds",
                html.Span(f" · differs only in: {', '.join(cmp.differences) or 'nothing'}"),
            ],
            className="contract contract--ok",
            id="contract-status",
        )
    else:
        status = html.Div(
            [
                "A/B contract broken",
                html.Span(
                    f" · undeclared differences: {', '.join(cmp.violations) or 'no engine_config to check'}"
                ),
            ],
            className="contract contract--bad",
            id="contract-status",
        )
    diffs = [
        {
            "config key": k,
            "A": str(va),
            "B": str(vb),
            "under test": "no" if k in cmp.violations else "yes",
        }
        for k, (va, vb) in cmp.differences.items()
    ]
    agree = {True: ["outputs agree (digests equal)"], False: ["OUTPUTS DIFFER"], None: []}[
        cmp.outputs_agree
    ]
    return [
        status,
        html.Ul([html.Li(a) for a in agree] + [html.Li(n) for n in cmp.notes], className="notes"),
        html.Div(
            className="split",
            children=[
                html.Div(
                    [html.H3("Deltas"), _table(_delta_rows(cmp), "compare-deltas")],
                    className="panel",
                ),
                html.Div(
                    [
                        html.H3("Config differences"),
                        _table(diffs, "compare-diffs")
                        if diffs
                        else html.P("configs are identical", className="hint"),
                    ],
                    className="panel",
                ),
            ],
        ),
        html.Div(
            className="split",
            children=[
                html.Div(
                    [html.H3(["A · ", a.title]), cards_row(a.report)],
                    className="panel",
                    id="compare-a-cards",
                ),
                html.Div(
                    [html.H3(["B · ", b.title]), cards_row(b.report)],
                    className="panel",
                    id="compare-b-cards",
                ),
            ],
        ),
        dcc.Graph(
            figure=compare_steps_figure(a.report, b.report, a.title, b.title),
            config={"displaylogo": False},
        ),
    ]


def steps_bounds(report: Report) -> tuple[int, int]:
    """First and last step of the per-step table ((0, 0) when the trace has no steps)."""
    steps: pd.DataFrame = report.tables["steps"]
    if steps.empty:
        return 0, 0
    return int(steps["step"].min()), int(steps["step"].max())
