"""Figure builders for the per-step charts, the blame breakdown and the A/B view.

Every number plotted is a column of an analysis table (``Report.tables``); these functions only
choose what to draw and thin long series for the browser (min/max per bucket, so spikes survive).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from analysis import Report
from analysis.lead import STARVED_LEAD_NS
from dashboard.theme import GRID, IDLE, MUTED, base_layout, color_for

__all__ = [
    "decimate_minmax",
    "step_series",
    "steps_figure",
    "blame_figure",
    "compare_steps_figure",
    "empty_figure",
    "note_no_data",
    "STEP_PANELS",
    "LEAD_PANEL",
]

MAX_POINTS = 4000
LEAD_PANEL = "CPU lead (ms): device reached the step's end event − host recorded it"
# (panel title, [(series label, table, column, scale, colour)])
STEP_PANELS: tuple[tuple[str, tuple[tuple[str, str, str, float, str], ...]], ...] = (
    (
        "overlap (hidden share of schedule + prepare_inputs)",
        (("overlap", "overlap", "overlap", 1.0, "#4f7fd9"),),
    ),
    (
        "step time (ms)",
        (
            ("step time", "steps", "step_ns", 1e-6, "#1f2430"),
            ("device busy", "steps", "device_busy_ns", 1e-6, "#2f9e5b"),
        ),
    ),
    (
        LEAD_PANEL,
        (("CPU lead", "steps", "cpu_lead_us", 1e-3, "#c2410c"),),
    ),
    (
        "accepted-count wait (µs)",
        (
            ("exposed", "waits", "exposed_ns", 1e-3, IDLE),
            ("hidden", "waits", "hidden_ns", 1e-3, "#9aa1ab"),
        ),
    ),
    (
        "batch size",
        (
            ("tokens", "steps", "num_tokens", 1.0, "#7a6fd0"),
            ("requests", "steps", "num_reqs", 1.0, "#35a7a0"),
        ),
    ),
    ("accepted tokens", (("accepted", "steps", "num_accepted", 1.0, "#e5732e"),)),
)


def note_no_data(fig: go.Figure, text: str, row: int | None = None) -> None:
    """A muted note in the middle of subplot ``row`` (the only plot when None) with no data."""
    ref = "" if row is None or row == 1 else str(row)
    fig.add_annotation(
        text=text,
        xref=f"x{ref} domain",
        yref=f"y{ref} domain",
        x=0.5,
        y=0.5,
        showarrow=False,
        font={"color": MUTED},
    )


def decimate_minmax(
    x: np.ndarray, y: np.ndarray, max_points: int = MAX_POINTS
) -> tuple[np.ndarray, np.ndarray]:
    """At most ~``max_points`` points: per bucket of consecutive points, its min and its max
    (in x order). Short series come back unchanged; NaNs are ignored within a bucket."""
    n = x.size
    if n <= max_points:
        return x, y
    buckets = max(max_points // 2, 1)
    bucket = (np.arange(n, dtype=np.int64) * buckets) // n
    first = np.ones(n, dtype=bool)
    first[1:] = bucket[1:] != bucket[:-1]
    last = np.roll(first, -1)
    by_min = np.lexsort((np.where(np.isnan(y), np.inf, y), bucket))
    by_max = np.lexsort((np.where(np.isnan(y), -np.inf, y), bucket))
    keep = np.unique(np.concatenate([by_min[first], by_max[last]]))
    return x[keep], y[keep]


def step_series(
    report: Report, table: str, column: str, scale: float, step_range: tuple[int, int] | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """``(step, value * scale)`` from ``report.tables[table][column]``; None when absent."""
    df = report.tables.get(table)
    if df is None or column not in df.columns or df.empty:
        return None
    if step_range is not None:
        df = df[(df["step"] >= step_range[0]) & (df["step"] <= step_range[1])]
    values = pd.to_numeric(df[column], errors="coerce").astype("float64").to_numpy() * scale
    return df["step"].to_numpy(np.int64), values


def steps_figure(
    report: Report, step_range: tuple[int, int] | None = None, max_points: int = MAX_POINTS
) -> go.Figure:
    """Stacked panels sharing the step axis, one per :data:`STEP_PANELS` entry; the CPU lead
    panel has a dotted line at the starved threshold (below it the device waited for the host)."""
    fig = make_subplots(
        rows=len(STEP_PANELS),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.045,
        subplot_titles=[title for title, _ in STEP_PANELS],
    )
    for row, (_, series) in enumerate(STEP_PANELS, start=1):
        drawn = False
        for label, table, column, scale, color in series:
            data = step_series(report, table, column, scale, step_range)
            if data is None:
                continue
            x, y = decimate_minmax(*data, max_points=max_points)
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=y,
                    mode="lines",
                    name=label,
                    line={"color": color, "width": 1.3},
                    hovertemplate=f"step %{{x}}<br>{label}: %{{y:,.3f}}<extra></extra>",
                ),
                row=row,
                col=1,
            )
            drawn = True
        if not drawn:
            note_no_data(fig, "not recorded in this trace", row)
        elif STEP_PANELS[row - 1][0] == LEAD_PANEL:
            fig.add_hline(
                y=STARVED_LEAD_NS / 1e6, row=row, col=1, line={"dash": "dot", "color": IDLE}
            )
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%", row=1, col=1)
    fig.update_xaxes(title_text="step", row=len(STEP_PANELS), col=1)
    fig.update_xaxes(gridcolor=GRID, showspikes=True, spikemode="across", spikethickness=1)
    fig.update_yaxes(gridcolor=GRID, zeroline=False)
    fig.update_annotations(font={"size": 12}, selector={"showarrow": False, "yref": "paper"})
    fig.update_layout(
        base_layout(
            height=170 * len(STEP_PANELS),
            hovermode="x unified",
            margin={"l": 60, "r": 20, "t": 50, "b": 40},
        )
    )
    return fig


def blame_figure(report: Report) -> go.Figure:
    """Device idle time by blamed CPU slice (the analysis' ``blame`` table), largest first."""
    blame = report.tables.get("blame", pd.DataFrame(columns=["label", "idle_ns", "share"]))
    blame = blame.head(8).iloc[::-1]
    fig = go.Figure(
        go.Bar(
            orientation="h",
            y=blame["label"],
            x=blame["idle_ns"] / 1e6,
            marker={"color": [color_for(str(label)) for label in blame["label"]]},
            text=[f"{s:.0%}" for s in blame["share"]],
            textposition="outside",
            cliponaxis=False,
            hovertemplate="%{y}<br>%{x:,.3f} ms idle<extra></extra>",
        )
    )
    fig.update_layout(
        base_layout(
            height=60 + 28 * max(len(blame), 1),
            showlegend=False,
            margin={"l": 200, "r": 50, "t": 10, "b": 36},
        )
    )
    fig.update_xaxes(title_text="device idle time blamed (ms)", gridcolor=GRID)
    return fig


def compare_steps_figure(a: Report, b: Report, label_a: str, label_b: str) -> go.Figure:
    """A and B overlaid per panel: overlap, step time, exposed wait (thinned like the step view)."""
    panels = [STEP_PANELS[0], STEP_PANELS[1], STEP_PANELS[2]]
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=False,
        vertical_spacing=0.12,
        subplot_titles=[title for title, _ in panels],
    )
    for row, (_, series) in enumerate(panels, start=1):
        label, table, column, scale, _ = series[0]
        for report, name, color in (
            (a, f"A: {label_a}", "#4f7fd9"),
            (b, f"B: {label_b}", "#e5732e"),
        ):
            data = step_series(report, table, column, scale)
            if data is None:
                continue
            x, y = decimate_minmax(*data)
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=y,
                    mode="lines",
                    name=name,
                    legendgroup=name,
                    showlegend=row == 1,
                    line={"color": color, "width": 1.3},
                    hovertemplate=f"{name}<br>step %{{x}}: %{{y:,.3f}}<extra></extra>",
                ),
                row=row,
                col=1,
            )
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%", row=1, col=1)
    fig.update_xaxes(gridcolor=GRID)
    fig.update_xaxes(title_text="step", row=3, col=1)
    fig.update_yaxes(gridcolor=GRID, zeroline=False)
    fig.update_layout(base_layout(height=620, margin={"l": 60, "r": 20, "t": 60, "b": 40}))
    return fig


def empty_figure(message: str) -> dict[str, Any]:
    """A blank figure with a centred message (before a trace is chosen)."""
    return {
        "data": [],
        "layout": base_layout(
            height=260,
            xaxis={"visible": False},
            yaxis={"visible": False},
            annotations=[
                {"text": message, "showarrow": False, "font": {"color": MUTED, "size": 14}}
            ],
        ),
    }
