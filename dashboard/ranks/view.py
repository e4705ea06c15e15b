"""The page of a rank set: verdicts, the per-rank table, the straggler and all-reduce wait
figures, and a way to each rank's own single-trace page.

The table's cells are the analysis' numbers (``RankReport.tables["ranks"]``) unchanged; the
DataTable formats them in the browser (percent, ms), so nothing is rounded on the server.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from dash import dash_table, dcc, html
from dash.dash_table.Format import Format, Group, Scheme

from analysis.metrics_registry import RANK_TABLE_METRICS
from analysis.ranks.report import RankReport
from dashboard.layout import IDS, TABLE_STYLE
from dashboard.ranks.figures import collective_wait_figure, straggler_figure
from dashboard.ranks.sets import LoadedRankSet, RankSetRef, rank_set_label
from dashboard.store import TraceRef

__all__ = [
    "rank_overview",
    "rank_rows",
    "rank_columns",
    "rank_set_link",
    "open_button",
    "RANK_COLUMNS",
    "RANK_DEFINITIONS",
]

_PCT = Format(precision=1, scheme=Scheme.percentage, nully="n/a")
_MS = Format(precision=2, scheme=Scheme.fixed, group=Group.yes, nully="n/a")
_US = Format(precision=1, scheme=Scheme.fixed, group=Group.yes, nully="n/a")
_COUNT = Format(group=Group.yes, nully="n/a")

# The DataTable format of each registry unit (None: shown as text).
_FORMATS: dict[str, Format | None] = {
    "ratio": _PCT,
    "ms": _MS,
    "µs": _US,
    "count": _COUNT,
    "id": None,
    "text": None,
}
# (column of the analysis' ``ranks`` table, header, format): from the metric registry's
# ``RANK_TABLE_METRICS``, as are the header tooltips (docs/design.md §5.13).
RANK_COLUMNS: tuple[tuple[str, str, Format | None], ...] = tuple(
    (m.key, m.label, _FORMATS[m.unit]) for m in RANK_TABLE_METRICS
)
RANK_DEFINITIONS: dict[str, str] = {m.key: m.definition for m in RANK_TABLE_METRICS}


def _plain(value: Any) -> Any:
    """A JSON-ready cell: numpy scalars as Python numbers, NaN as None."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def rank_columns(report: RankReport) -> list[dict[str, Any]]:
    """DataTable columns of :data:`RANK_COLUMNS` (the clock offset only across hosts)."""
    cols = []
    for col, name, fmt in RANK_COLUMNS:
        if col == "clock_offset_us" and report.ranks.same_host:
            continue  # one host: one clock, nothing was shifted
        spec: dict[str, Any] = {"name": name, "id": col}
        if fmt is not None:
            spec.update(type="numeric", format=fmt)
        cols.append(spec)
    return cols


def rank_rows(report: RankReport) -> list[dict[str, Any]]:
    """One row per rank: the ``ranks`` table's values, unchanged (NaN as None)."""
    summary = report.tables["ranks"]
    return [{k: _plain(v) for k, v in row.items()} for row in summary.to_dict("records")]


def _straggler_style(report: RankReport) -> list[dict[str, Any]]:
    """The rank(s) holding the most steps back, highlighted."""
    summary = report.tables["ranks"]
    most = int(summary["straggler_steps"].max()) if len(summary) else 0
    if most == 0:
        return []
    worst = summary.loc[summary["straggler_steps"] == most, "rank"]
    return [
        {
            "if": {"filter_query": f"{{rank}} = {int(r)}"},
            "backgroundColor": "#fff4e5",
            "fontWeight": "600",
        }
        for r in worst
    ]


def open_button(label: str, ref_id: str, title: str, class_name: str = "btn") -> html.Button:
    """A button that opens ``ref_id`` (a trace or a rank set) as the current page."""
    return html.Button(
        label, id={"type": IDS.OPEN_REF, "index": ref_id}, title=title, className=class_name
    )


def rank_set_link(ref: RankSetRef, members: list[TraceRef]) -> html.Button:
    """For a rank's own page: back to the set it belongs to."""
    label = rank_set_label(ref.stem, len(members))
    return open_button(f"← {label}", ref.id, "open the rank set of this trace", "btn rank-set-link")


def _facts(loaded: LoadedRankSet) -> str:
    report = loaded.report
    w = report.headline["window"]
    clocks = (
        "one host: clocks shared, not shifted"
        if report.ranks.same_host
        else f"{len({f.metadata.get('host') for f in report.ranks.frames.values()})} hosts: "
        "clocks shifted onto rank 0's"
    )
    return (
        f"{len(report.ranks.ranks)} of {report.headline['world_size']} ranks · {clocks} · "
        f"rank 0's window ({w.get('rule')}): steps {w.get('first_step')}…{w.get('last_step')} · "
        f"{loaded.size_bytes / 1e6:.2f} MB analysed in {loaded.load_s:.2f} s"
    )


def _rank_pages(loaded: LoadedRankSet) -> html.Div:
    buttons = [
        open_button(f"rank {r}", m.id, f"open {m.name} (timeline, per step, decisions)")
        for r, m in sorted(loaded.members.items())
    ]
    return html.Div(
        [html.Span("each rank's own page:", className="toolbar-label"), *buttons],
        className="rank-pages",
    )


def _panel(title: str, hint: str, body: Any) -> html.Div:
    return html.Div([html.H3(title), html.P(hint, className="hint"), body], className="panel")


def rank_overview(loaded: LoadedRankSet) -> list[Any]:
    """Notes, verdicts, what was measured, the per-rank table and the two per-step figures."""
    report = loaded.report
    notes = [html.Li(n) for n in report.ranks.notes]
    return [
        html.Ul(notes, className="notes rank-notes") if notes else None,
        html.Ul([html.Li(v) for v in report.verdicts], className="verdicts"),
        html.P(_facts(loaded), className="hint rank-facts"),
        _panel(
            "Per rank",
            "Overlap and bubbles over each rank's own trace; times summed over rank 0's window. "
            "Hover a header for its definition; the highlighted row holds the most steps back.",
            html.Div(
                [
                    dash_table.DataTable(
                        id=IDS.RANK_TABLE,
                        columns=rank_columns(report),
                        data=rank_rows(report),
                        sort_action="native",
                        tooltip_header=RANK_DEFINITIONS,
                        style_data_conditional=_straggler_style(report),
                        **TABLE_STYLE,
                    ),
                    _rank_pages(loaded),
                ]
            ),
        ),
        _panel(
            "Stragglers per step",
            "The straggler is the rank whose forward ends last; the spread is the last end minus "
            "the first (and the same for starts, which is what the others wait for at the first "
            "collective).",
            dcc.Graph(
                id=IDS.RANK_STRAGGLERS,
                figure=straggler_figure(report),
                config={"displaylogo": False},
            ),
        ),
        _panel(
            "All-reduce wait per rank and step",
            "Host-timed collectives plus the arrival wait (the last rank's forward start minus "
            "this rank's), in µs; hover a cell for the two parts.",
            dcc.Graph(
                id=IDS.RANK_COLLECTIVES,
                figure=collective_wait_figure(report),
                config={"displaylogo": False},
            ),
        ),
    ]
