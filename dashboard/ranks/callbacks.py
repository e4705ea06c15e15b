"""The rank-set part of the page wiring: picker entries, the rank set's page outputs, and the
navigation between a set and its ranks' own pages.

A set is picked like a trace (its id, ``ranks/<stem>``, becomes the current id); the "rank i"
buttons of its page and the "← set" button of a rank's page only set the picker's value, so every
page still loads through the one load callback of :mod:`dashboard.callbacks`.
"""

from __future__ import annotations

from typing import Any

from dash import ALL, Dash, Input, Output, State, ctx, no_update

from dashboard.config import DashboardConfig
from dashboard.layout import IDS
from dashboard.ranks.sets import RankSetRef, is_rank_set_id, rank_set_label
from dashboard.ranks.view import rank_overview, rank_set_link
from dashboard.store import LoadedTrace, TraceRef, TraceStore
from dashboard.views import silent_row_style, trace_actions

__all__ = [
    "trace_options",
    "picker_options",
    "rank_set_outputs",
    "trace_actions_in_set",
    "register_rank_callbacks",
]


def _option(ref: TraceRef) -> dict[str, str]:
    return {"label": ("⇪ " if ref.source == "uploads" else "") + ref.name, "value": ref.id}


def trace_options(store: TraceStore) -> list[dict[str, str]]:
    """Single traces only (what Compare takes)."""
    return [_option(r) for r in store.list_traces()]


def picker_options(store: TraceStore) -> list[dict[str, str]]:
    """Every trace, and each rank set as one entry ``X (N ranks)`` placed where its newest file
    is listed, followed by its files in rank order."""
    sets = store.list_rank_sets()
    set_of = {m: s for s, members in sets.items() for m in members}
    out, placed = [], set()
    for ref in store.list_traces():
        rank_set = set_of.get(ref)
        if rank_set is None:
            out.append(_option(ref))
        elif rank_set not in placed:
            placed.add(rank_set)
            label = rank_set_label(rank_set.stem, len(sets[rank_set]))
            out.append({"label": label, "value": rank_set.id})
            out.extend(_option(m) for m in sets[rank_set])
    return out


def rank_set_outputs(store: TraceStore, ref_id: str) -> tuple[Any, ...]:
    """The load callback's outputs for a rank set: its page as the Overview, the single-trace
    tables and actions emptied, the step slider left as it is."""
    loaded = store.load_rank_set(RankSetRef.parse(ref_id))
    slider = (no_update,) * 4
    return (rank_overview(loaded), *slider, [], silent_row_style(), [], [], loaded.title, None)


def trace_actions_in_set(
    store: TraceStore, loaded: LoadedTrace, config: DashboardConfig
) -> list[Any]:
    """Perfetto and download; for a rank of a set, first the way back to the set."""
    actions = trace_actions(loaded, config)
    for rank_set, members in store.list_rank_sets().items():
        if loaded.ref in members:
            return [rank_set_link(rank_set, members), *actions]
    return actions


def register_rank_callbacks(app: Dash) -> None:
    """Set <-> rank navigation, and the single-trace tabs greyed out while a set is open."""

    @app.callback(
        Output(IDS.PICKER, "value", allow_duplicate=True),
        Input({"type": IDS.OPEN_REF, "index": ALL}, "n_clicks"),
        prevent_initial_call=True,
    )
    def open_ref(_clicks: list[int | None]) -> Any:
        trigger = ctx.triggered_id
        if not isinstance(trigger, dict) or not ctx.triggered[0]["value"]:
            return no_update  # buttons just drawn, not clicked
        return trigger["index"]

    @app.callback(
        *[Output(IDS.tab(t), "disabled") for t in IDS.SINGLE_TRACE_TABS],
        Output(IDS.TABS, "value"),
        Input(IDS.CURRENT, "data"),
        State(IDS.TABS, "value"),
        prevent_initial_call=True,
    )
    def single_trace_tabs(ref_id: str | None, tab: str) -> tuple[Any, ...]:
        ranks = is_rank_set_id(ref_id)
        back = "overview" if ranks and tab in IDS.SINGLE_TRACE_TABS else no_update
        return (*[ranks] * len(IDS.SINGLE_TRACE_TABS), back)
