"""Dynamic page parts built from an analysis report: verdict cards, tables, compare, actions.

Numbers are the report's own (``Report.headline`` / ``Report.tables``), formatted for reading;
each card also carries the exact value in ``data-value`` so a test can compare without parsing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import pandas as pd
from dash import dash_table, dcc, html

from analysis import Comparison, Report
from analysis.compare import wait_and_idle_lines
from analysis.metrics_registry import COMPARED, METRICS, STARVED_LEAD_US, fmt_num, fmt_pct, metric
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

# One definition per headline key, from the registry (docs/design.md §5.11); nothing here.
DEFINITIONS: dict[str, str] = {m.key: m.definition for m in METRICS}


@dataclass(frozen=True)
class Card:
    key: str
    label: str
    value: Any
    shown: str
    sub: str
    tone: str  # "good", "warn", "bad" or ""


_HEADLINE: Any = object()  # _card's default: the headline's own value


def _card(key: str, h: Mapping[str, Any], sub: str, value: Any = _HEADLINE) -> Card:
    """The card of headline ``key``: label, shown value and tone from its registry entry."""
    m = metric(key)
    v = h[key] if value is _HEADLINE else value
    return Card(key, m.label, v, m.show(v), sub, m.tone(h))


def _cards(report: Report) -> list[Card]:
    h = report.headline
    window = h["window"]
    steps = max(int(window.get("num_steps") or 0), 1)
    exposed = h["wait_accepted_exposed_us"]
    silent = h["silent_fallbacks"]
    top = h["top_blame"]
    bound = " · lower bound" if h.get("bubble_ratio_bound") == "lower_bound" else ""
    cards = [
        _card("overlap", h, "of CPU scheduling hidden under device work"),
        _card(
            "bubble_ratio",
            h,
            f"{h['bubbles']['count']:,} bubbles · {fmt_num(h['bubbles']['idle_ms'], 'ms', 2)} idle"
            + bound,
        ),
        *_lead_cards(h),
        Card(
            "wait_accepted_exposed_us",
            metric("wait_accepted_exposed_us").label,
            exposed,
            metric("wait_accepted_exposed_us").show(exposed / steps) + "/step",
            f"{fmt_num(exposed, 'µs')} exposed of {fmt_num(h['wait_accepted_total_us'], 'µs')} "
            f"(hidden {fmt_num(h['wait_accepted_hidden_us'], 'µs')})",
            metric("wait_accepted_exposed_us").tone(h),
        ),
        _card("hot_syncs", h, "host-device syncs on the hot path"),
        _card(
            "silent_fallbacks",
            h,
            ", ".join(str(r["feature"]) for r in silent) or "none",
            len(silent),
        ),
        Card(
            "top_blame",
            metric("top_blame").label,
            top["label"] if top else None,
            top["label"] if top else "n/a",
            f"{fmt_pct(top['share'])} of idle · {fmt_num(top['idle_ms'], 'ms', 2)}"
            if top
            else "no bubbles",
            "",
        ),
    ]
    if h.get("grammar_mask_ms"):  # structured output ran: how much grammar work was hidden
        cards.append(
            _card(
                "grammar_hidden_frac",
                h,
                f"{metric('grammar_mask_ms').show(h['grammar_mask_ms'])} of masks · forward early "
                f"in {fmt_pct(h['grammar_overlap_steps_frac'])} of steps · "
                f"{fmt_num(h['grammar_wait_exposed_us'], 'µs')} wait exposed",
            )
        )
    tpot = (h.get("tpot_ms") or {}).get("p50")
    if tpot is not None:
        ttft = (h.get("ttft_ms") or {}).get("p50")
        m = metric("tpot_ms")
        sub = f"{metric('ttft_ms').label} p50 {metric('ttft_ms').show(ttft)}"
        cards.append(Card("tpot_ms", f"{m.label} p50", tpot, m.show(tpot), sub, ""))
    return cards


def _lead_cards(h: Mapping[str, Any]) -> list[Card]:
    """CPU lead, starved steps and the starvation-aware idle (n/a without host_end_ns)."""
    p10 = h.get("cpu_lead_us_p10")
    lead_p10 = metric("cpu_lead_us_p10")
    starved = f"device waited for the host (lead < {STARVED_LEAD_US:.0f} µs)"
    return [
        Card(
            "cpu_lead_us_p50",
            metric("cpu_lead_us_p50").label,
            h.get("cpu_lead_us_p50"),
            metric("cpu_lead_us_p50").show(h.get("cpu_lead_us_p50")),
            "not recorded in this trace" if p10 is None else f"p10 {lead_p10.show(p10)}",
            lead_p10.tone(h),
        ),
        _card("starved_steps_frac", h, starved),
        _card(
            "bubble_ratio_starvation_aware",
            h,
            "estimate: starved stages' launch gaps counted as idle",
        ),
    ]


def _numeric(value: Any) -> bool:
    return value is None or isinstance(value, (int, float))


def _card_div(card: Card) -> html.Div:
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
    return html.Div([_card_div(c) for c in _cards(report)], className="cards")


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


_COMPARED_UNITS = {c.name: c.unit for c in COMPARED}


def _delta_rows(cmp: Comparison) -> list[dict[str, str]]:
    out = []
    for name, d in cmp.deltas.items():
        pct = _COMPARED_UNITS.get(name) == "ratio"
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
        html.Ul(
            [html.Li(line) for line in wait_and_idle_lines(cmp)],
            className="notes",
            id="compare-waits",
        ),
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
