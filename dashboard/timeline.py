"""The timeline figure: CPU lanes against device lanes, with device bubbles shaded and blamed.

Two renderings of the same lanes, chosen per zoom window:

* **detail** (at most ``bar_budget`` slices visible): one horizontal bar per slice, hover with
  step and duration; bubbles drawn on the ``device idle`` lane in the colour of their blame,
  labelled when wide enough, and shaded across every lane;
* **density** (more visible): each lane becomes a strip of ``num_bins`` cells holding the busy
  fraction of that cell (the idle lane: idle fraction and the dominant blame). Nothing is
  sampled away, so a bubble-heavy region stays visible at any zoom.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from dashboard.lanes import IDLE_LANE, Lane, LaneIndex
from dashboard.theme import IDLE, MUTED, base_layout, color_for

__all__ = ["timeline_figure", "TimelineView", "ns_to_ms", "DENSITY_BINS"]

DENSITY_BINS = 600
_MAX_SHADED = 150
_GROUPS = ("cpu", "device", "idle")
_GROUP_COLORS = ("#3b63b8", "#23804a", IDLE)
_BLANK = (244, 246, 250)
# Busy fraction -> colour intensity: small fractions stay visible (a 2% idle column is a real
# bubble worth zooming into); the hover text always gives the exact fraction.
_RAMP = ((0.0, 0.0), (0.01, 0.25), (0.05, 0.45), (0.2, 0.7), (0.5, 0.88), (1.0, 1.0))


def _blend(hex_color: str, t: float) -> str:
    rgb = [int(hex_color[i : i + 2], 16) for i in (1, 3, 5)]
    mixed = [round(b + (c - b) * t) for b, c in zip(_BLANK, rgb, strict=True)]
    return "rgb({}, {}, {})".format(*mixed)


def _colorscale() -> list[list[Any]]:
    """One scale for z in [0, 2 * len(_GROUPS) - 1]: group g's fractions live in [2g, 2g + 1]."""
    top = 2 * len(_GROUPS) - 1
    scale: list[list[Any]] = []
    for g, color in enumerate(_GROUP_COLORS):
        for frac, t in _RAMP:
            scale.append([(2 * g + frac) / top, _blend(color, t)])
        if g + 1 < len(_GROUP_COLORS):
            scale.append([(2 * g + 1.0001) / top, _blend(color, 0.0)])
    return scale


_SCALE = _colorscale()


def ns_to_ms(ns: np.ndarray | int, t0_ns: int) -> np.ndarray:
    """Trace time in milliseconds since ``t0_ns`` (the x axis of the timeline)."""
    return (np.asarray(ns, dtype=np.int64) - t0_ns) / 1e6


class TimelineView:
    """What the figure shows for one window: ``mode`` (``detail``/``density``) and the counts."""

    def __init__(self, index: LaneIndex, lo_ns: int, hi_ns: int, bar_budget: int) -> None:
        self.index = index
        self.lo_ns, self.hi_ns = index.clamp(lo_ns, hi_ns)
        self.num_visible = index.count_upper_bound(self.lo_ns, self.hi_ns)
        self.mode = "detail" if self.num_visible <= bar_budget else "density"


def _bar_traces(lanes: list[Lane], view: TimelineView) -> list[go.Bar]:
    """One bar trace per colour key (slice name; blame label on the idle lane), across lanes."""
    t0 = view.index.t0_ns
    parts: dict[tuple[bool, str], list[tuple[str, np.ndarray, Lane]]] = {}
    for lane in lanes:
        idx = lane.visible(view.lo_ns, view.hi_ns)
        keys = lane.names[idx]
        for key in dict.fromkeys(keys.tolist()):
            parts.setdefault((lane.group == "idle", str(key)), []).append(
                (lane.label, idx[keys == key], lane)
            )
    return [_bars(idle, key, pieces, t0) for (idle, key), pieces in parts.items()]


def _bars(idle: bool, key: str, pieces: list[tuple[str, np.ndarray, Lane]], t0: int) -> go.Bar:
    y = np.concatenate([np.full(i.size, label, dtype=object) for label, i, _ in pieces])
    start = np.concatenate([lane.start_ns[i] for _, i, lane in pieces])
    end = np.concatenate([lane.end_ns[i] for _, i, lane in pieces])
    step = np.concatenate([lane.steps[i] for _, i, lane in pieces])
    what = (
        "<b>bubble</b> blamed on %{text}"
        if idle
        else "<b>%{fullData.name}</b> step %{customdata[0]}"
    )
    return go.Bar(
        orientation="h",
        y=y,
        base=ns_to_ms(start, t0),
        x=(end - start) / 1e6,
        name=f"idle: {key}" if idle else key,
        legendgroup="idle" if idle else key,
        marker={"color": color_for(key), "line": {"width": 1.5 if idle else 0, "color": IDLE}},
        opacity=0.85 if idle else 1.0,
        customdata=np.stack([step, (end - start) / 1e3, ns_to_ms(start, t0)], axis=1),
        text=[key] * y.size if idle else None,
        textposition="inside" if idle else "none",
        insidetextanchor="middle",
        textfont={"color": "#ffffff", "size": 10},
        hovertemplate=what
        + "<br>%{customdata[1]:,.1f} µs at %{customdata[2]:,.3f} ms<extra>%{y}</extra>",
    )


def _bubble_shading(idle: Lane | None, view: TimelineView) -> list[dict[str, Any]]:
    if idle is None:
        return []
    idx = idle.visible(view.lo_ns, view.hi_ns)
    widest = idx[np.argsort(idle.start_ns[idx] - idle.end_ns[idx], kind="stable")[:_MAX_SHADED]]
    t0 = view.index.t0_ns
    return [
        {
            "type": "rect",
            "xref": "x",
            "yref": "paper",
            "x0": float(ns_to_ms(idle.start_ns[i], t0)),
            "x1": float(ns_to_ms(idle.end_ns[i], t0)),
            "y0": 0,
            "y1": 1,
            "fillcolor": "rgba(214,69,69,0.10)",
            "line": {"width": 0},
            "layer": "below",
        }
        for i in widest
    ]


def _density_traces(view: TimelineView, num_bins: int) -> list[go.Heatmap]:
    """One heatmap for all lanes (plotly.js fails on several heatmaps sharing a category axis).

    Each group's fractions are offset by ``2 * group`` so one colour scale shades CPU lanes blue,
    device lanes green and the idle lane red; the hover text carries the true fraction.
    """
    edges = np.linspace(view.lo_ns, view.hi_ns, num_bins + 1).round().astype(np.int64)
    centers = ns_to_ms((edges[:-1] + edges[1:]) // 2, view.index.t0_ns)
    rows, text = [], []
    for lane in view.index.lanes:
        frac = lane.occupancy(edges)
        offset = 2 * _GROUPS.index(lane.group)
        rows.append(frac + offset)
        pct = np.char.add(np.round(frac * 100).astype(int).astype(str), "%")
        if lane.group == "idle":
            blame = _dominant_blame(lane, edges).astype(str)
            text.append(
                np.where(
                    frac > 0, np.char.add(np.char.add(pct, " idle, mostly "), blame), "no bubble"
                ).tolist()
            )
        else:
            text.append(np.char.add(pct, " busy").tolist())
    heat = go.Heatmap(
        x=centers,
        y=view.index.labels,
        z=np.stack(rows).tolist() if rows else [],
        zmin=0,
        zmax=2 * len(_GROUPS) - 1,
        colorscale=_SCALE,
        showscale=False,
        ygap=3,
        customdata=text,
        name="density",
        hovertemplate="%{y}<br>%{x:,.2f} ms: %{customdata}<extra></extra>",
    )
    return [heat]


def _dominant_blame(idle: Lane, edges: np.ndarray) -> np.ndarray:
    """Per bin, the blame label with the most idle time in it ("" when no idle time)."""
    labels = np.unique(idle.names.astype(str))
    per_label = np.stack([idle.occupancy(edges, idle.names.astype(str) == lab) for lab in labels])
    best = per_label.argmax(axis=0)
    return np.where(per_label.max(axis=0) > 0, labels[best], "").astype(object)


def timeline_figure(
    index: LaneIndex,
    lo_ns: int | None = None,
    hi_ns: int | None = None,
    *,
    bar_budget: int = 4000,
    num_bins: int = DENSITY_BINS,
) -> go.Figure:
    """The timeline for the window ``[lo_ns, hi_ns)`` (``None``: the trace's edges)."""
    view = TimelineView(
        index,
        lo_ns if lo_ns is not None else index.t0_ns,
        hi_ns if hi_ns is not None else index.end_ns,
        bar_budget,
    )
    labels = index.labels
    idle = next((lane for lane in index.lanes if lane.label == IDLE_LANE), None)
    if view.mode == "detail":
        traces: list[Any] = _bar_traces(list(index.lanes), view)
        shapes = _bubble_shading(idle, view)
        note = f"{view.num_visible:,} slices: every slice drawn"
    else:
        traces = _density_traces(view, num_bins)
        shapes = []
        note = f"density view ({view.num_visible:,} slices in range): zoom in for single slices"
    fig = go.Figure(traces)
    fig.update_layout(
        base_layout(
            barmode="overlay",
            bargap=0.25,
            height=max(260, 34 * len(labels) + 90),
            shapes=shapes,
            showlegend=view.mode == "detail",
            uniformtext={"mode": "hide", "minsize": 8},
            margin={"l": 190, "r": 20, "t": 40, "b": 40},
            meta={"mode": view.mode, "num_visible": view.num_visible},
            title={
                "text": note,
                "font": {"size": 11, "color": MUTED},
                "x": 1,
                "xanchor": "right",
                "y": 0.01,
                "yanchor": "bottom",
            },
        )
    )
    fig.update_yaxes(
        categoryorder="array",
        categoryarray=labels,
        autorange="reversed",
        showgrid=False,
        tickfont={"size": 11},
        fixedrange=True,
    )
    fig.update_xaxes(
        range=[float(ns_to_ms(view.lo_ns, index.t0_ns)), float(ns_to_ms(view.hi_ns, index.t0_ns))],
        title={"text": "time since trace start (ms)", "font": {"size": 11}},
        showgrid=True,
        gridcolor="#eef0f3",
        zeroline=False,
        showspikes=True,
        spikemode="across",
        spikethickness=1,
        spikecolor="#9aa1ab",
    )
    return fig
