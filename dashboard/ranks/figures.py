"""Figures of a rank set: the straggler rank and forward spread per step, and the all-reduce wait
per rank and step as a heat map.

Every number plotted is a column of a :class:`~analysis.ranks.report.RankReport` table
(``stragglers``, ``collectives``), scaled to µs; long runs are thinned for the browser the way
the per-step charts are (min/max per bucket, max per column bucket in the heat map, so spikes
survive).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from analysis.ranks.report import RankReport
from dashboard.figures import MAX_POINTS, decimate_minmax, note_no_data
from dashboard.theme import GRID, IDLE, base_layout

__all__ = [
    "straggler_figure",
    "collective_wait_figure",
    "wait_matrix",
    "rank_color",
    "MAX_HEAT_COLUMNS",
]

MAX_HEAT_COLUMNS = 2000
_RANK_COLORS = ["#4f7fd9", "#e5732e", "#2f9e5b", "#b36bb0", "#35a7a0", "#c9892a", "#7a6fd0"]
_MARKERS_UP_TO = 400  # steps drawn with a marker each; beyond, lines only
_WAIT_SCALE = [[0.0, "#f4f6fa"], [0.35, "#f3c98b"], [0.7, "#e5732e"], [1.0, "#9b1c1c"]]


def rank_color(rank: int) -> str:
    return _RANK_COLORS[rank % len(_RANK_COLORS)]


def straggler_figure(report: RankReport, max_points: int = MAX_POINTS) -> go.Figure:
    """Two panels on the step axis: the straggler rank (whose ``forward`` ends last) and the
    forward end / start spread across ranks, in µs (``stragglers`` table)."""
    df = report.tables["stragglers"]
    ranks = report.ranks.ranks
    fig = make_subplots(
        rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.4, 0.6]
    )
    steps = df["step"].to_numpy(np.int64)
    mode = "markers" if len(df) <= _MARKERS_UP_TO else "lines"
    x, y = decimate_minmax(steps, df["straggler_rank"].to_numpy(np.float64), max_points)
    fig.add_trace(
        go.Scatter(
            x=x,
            y=y,
            mode="markers",
            name="straggler rank (its forward ends last)",
            marker={"color": [rank_color(int(r)) for r in y], "size": 8, "symbol": "square"},
            hovertemplate="step %{x}<br>rank %{y} ends last<extra></extra>",
        ),
        row=1,
        col=1,
    )
    for label, column, color in (
        ("forward-end spread", "end_spread_ns", IDLE),
        ("forward-start spread", "start_spread_ns", "#9aa1ab"),
    ):
        x, y = decimate_minmax(steps, df[column].to_numpy(np.float64) / 1e3, max_points)
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode=mode if mode == "lines" else "lines+markers",
                name=label,
                line={"color": color, "width": 1.3},
                marker={"size": 4},
                hovertemplate=f"step %{{x}}<br>{label}: %{{y:,.1f}} µs<extra></extra>",
            ),
            row=2,
            col=1,
        )
    if df.empty:
        note_no_data(fig, "no step has a forward on every rank", row=1)
    fig.update_yaxes(
        title_text="straggler",
        tickvals=ranks,
        ticktext=[f"rank {r}" for r in ranks],
        range=[min(ranks, default=0) - 0.5, max(ranks, default=0) + 0.5],
        row=1,
        col=1,
    )
    fig.update_yaxes(title_text="spread (µs)", rangemode="tozero", row=2, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_xaxes(gridcolor=GRID, showspikes=True, spikemode="across", spikethickness=1)
    fig.update_yaxes(gridcolor=GRID, zeroline=False)
    fig.update_annotations(font={"size": 12}, selector={"showarrow": False, "yref": "paper"})
    fig.update_layout(
        base_layout(height=240 + 24 * len(ranks), margin={"l": 70, "r": 20, "t": 50, "b": 40})
    )
    return fig


def wait_matrix(collectives: pd.DataFrame) -> tuple[np.ndarray, list[int], np.ndarray]:
    """``(steps, ranks, z)`` with ``z[rank row, step column]`` = collective + arrival wait of that
    rank and step in µs (NaN where the rank has no forward in the step)."""
    wait_ns = collectives["collective_ns"] + collectives["arrival_wait_ns"]
    grid = collectives.assign(wait_us=wait_ns / 1e3).pivot(index="rank", columns="step")["wait_us"]
    return grid.columns.to_numpy(np.int64), grid.index.tolist(), grid.to_numpy(np.float64)


def collective_wait_figure(report: RankReport, max_columns: int = MAX_HEAT_COLUMNS) -> go.Figure:
    """Heat map of the all-reduce wait (``collective_ns + arrival_wait_ns`` of the
    ``collectives`` table, µs), one row per rank, one column per step (column buckets beyond
    ``max_columns`` steps show their maximum)."""
    coll = report.tables["collectives"]
    fig = go.Figure()
    if coll.empty:
        note_no_data(fig, "no collectives in the window")
        fig.update_layout(base_layout(height=200))
        return fig
    steps, ranks, z = wait_matrix(coll)
    parts = np.stack(
        [
            coll.pivot(index="rank", columns="step")[c].to_numpy(np.float64) / 1e3
            for c in ("collective_ns", "arrival_wait_ns")
        ],
        axis=-1,
    )  # [rank, step, 2]: collective, arrival
    hover = (
        "rank %{y}, step %{x}<br>all-reduce wait %{z:,.1f} µs<br>"
        "collectives %{customdata[0]:,.1f} µs + arrival %{customdata[1]:,.1f} µs<extra></extra>"
    )
    if len(steps) > max_columns:
        starts = np.linspace(0, len(steps), max_columns + 1).astype(np.int64)[:-1]
        z = np.fmax.reduceat(z, starts, axis=1)
        parts = np.fmax.reduceat(parts, starts, axis=1)
        steps = steps[starts]
        hover = hover.replace("step %{x}", "steps from %{x} (max)")
    fig.add_trace(
        go.Heatmap(
            x=steps,
            y=ranks,
            z=z,
            customdata=parts,
            name="all-reduce wait",
            colorscale=_WAIT_SCALE,
            zmin=0,
            colorbar={"title": {"text": "µs", "side": "top"}, "thickness": 12},
            hovertemplate=hover,
            xgap=0,
            ygap=2,
        )
    )
    fig.update_yaxes(
        tickvals=ranks, ticktext=[f"rank {r}" for r in ranks], autorange="reversed", gridcolor=GRID
    )
    fig.update_xaxes(title_text="step", gridcolor=GRID)
    fig.update_layout(
        base_layout(height=150 + 34 * len(ranks), margin={"l": 70, "r": 20, "t": 20, "b": 40})
    )
    return fig
