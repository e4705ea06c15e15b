"""Dash callbacks: choosing a trace or a rank set, loading it (with progress), zooming the
timeline, comparing.

Every callback catches trace errors at its edge and turns them into a banner, so a bad file never
takes the app down; unexpected errors are logged with their traceback and shown the same way.
"""

from __future__ import annotations

import base64
import binascii
import logging
from typing import Any

from dash import Dash, Input, Output, State, ctx, html, no_update

from dashboard.config import DashboardConfig
from dashboard.figures import empty_figure, steps_figure
from dashboard.layout import IDS
from dashboard.rank_callbacks import (
    picker_options,
    rank_set_outputs,
    register_rank_callbacks,
    trace_actions_in_set,
    trace_options,
)
from dashboard.rank_sets import is_rank_set_id
from dashboard.store import LoadedTrace, TraceRef, TraceStore, is_trace_error
from dashboard.timeline import timeline_figure
from dashboard.views import (
    banner,
    compare_body,
    decision_rows,
    overview,
    silent_row_style,
    steps_bounds,
    sync_rows,
)

__all__ = ["register_callbacks"]

log = logging.getLogger("stepscope.dashboard")
_RANK_SET_TAB = "a rank set is open: its ranks' own pages (Overview) show their timelines"


def _error_text(exc: BaseException) -> str:
    if is_trace_error(exc):  # e.g. the loader's decompressed-size limit: its own words
        return str(exc)
    if isinstance(exc, MemoryError):
        return "the trace needs more memory than this server has (a very large or compressed file)"
    if isinstance(exc, RecursionError):
        return "the trace is nested too deeply to read"
    log.exception("dashboard callback failed")
    return f"internal error while analysing: {type(exc).__name__}: {exc}"


def _marks(lo: int, hi: int) -> dict[int, str]:
    if hi <= lo:
        return {lo: str(lo)}
    stride = max((hi - lo) // 6, 1)
    return {s: f"{s:,}" for s in range(lo, hi + 1, stride)}


def _register_selection(app: Dash, store: TraceStore) -> None:
    @app.callback(
        Output(IDS.CURRENT, "data"),
        Output(IDS.PICKER, "value"),
        Output(IDS.PICKER, "options"),
        Output(IDS.COMPARE_A, "options"),
        Output(IDS.COMPARE_B, "options"),
        Output(IDS.BANNER, "children"),
        Input(IDS.REFRESH, "n_clicks"),
        Input(IDS.PICKER, "value"),
        Input(IDS.UPLOAD, "contents"),
        State(IDS.UPLOAD, "filename"),
    )
    def select(
        _clicks: int | None, value: str | None, contents: str | None, filename: str | None
    ) -> tuple[Any, ...]:
        """Rescan, pick, or upload; the options always include what was just uploaded."""
        current, message = no_update, None
        if ctx.triggered_id == IDS.UPLOAD and contents:
            try:
                _, _, payload = contents.partition(",")
                ref = store.save_upload(
                    filename or "upload", base64.b64decode(payload, validate=True)
                )
                current = value = ref.id
            except (binascii.Error, ValueError) as exc:
                message = banner(f"{filename}: {exc}")
        elif ctx.triggered_id == IDS.PICKER and value:
            current = value
        singles = trace_options(store)  # compare takes single traces
        return current, value or no_update, picker_options(store), singles, singles, message


def _load(store: TraceStore, ref_id: str | None) -> LoadedTrace | None:
    """The single trace ``ref_id`` names; None for nothing or a rank set."""
    if not ref_id or is_rank_set_id(ref_id):
        return None
    return store.load(TraceRef.parse(ref_id))


def _register_load(app: Dash, store: TraceStore, config: DashboardConfig) -> None:
    @app.callback(
        Output(IDS.OVERVIEW, "children"),
        Output(IDS.STEP_RANGE, "min"),
        Output(IDS.STEP_RANGE, "max"),
        Output(IDS.STEP_RANGE, "value"),
        Output(IDS.STEP_RANGE, "marks"),
        Output(IDS.DECISIONS, "data"),
        Output(IDS.DECISIONS, "style_data_conditional"),
        Output(IDS.SYNCS, "data"),
        Output(IDS.ACTIONS, "children"),
        Output(IDS.TITLE, "children"),
        Output(IDS.BANNER, "children", allow_duplicate=True),
        Input(IDS.CURRENT, "data"),
        running=[
            (Output(IDS.PROGRESS, "className"), "progress progress--on", "progress"),
            (Output(IDS.PROGRESS_POLL, "disabled"), False, True),
        ],
        prevent_initial_call=True,
    )
    def load(ref_id: str | None) -> tuple[Any, ...]:
        try:
            if is_rank_set_id(ref_id):
                return rank_set_outputs(store, str(ref_id))
            loaded = _load(store, ref_id)
        except Exception as exc:  # the edge: any failure becomes a banner, the app stays up
            name = (ref_id or "").partition("/")[2]
            title = f"{name} · could not be loaded"
            # nothing of the previous trace stays under this title; the slider is left alone
            nothing = html.P(f"{name} could not be loaded: nothing to show.", className="hint")
            slider = (no_update,) * 4
            return (nothing, *slider, [], no_update, [], [], title, banner(_error_text(exc)))
        if loaded is None:
            return (no_update,) * 11
        lo, hi = steps_bounds(loaded.report)
        return (
            overview(loaded),
            lo,
            hi,
            [lo, hi],
            _marks(lo, hi),
            decision_rows(loaded.report),
            silent_row_style(),
            sync_rows(loaded.report),
            trace_actions_in_set(store, loaded, config),
            loaded.ref.name,
            None,
        )

    @app.callback(
        Output(IDS.PROGRESS_TEXT, "children"),
        Input(IDS.PROGRESS_POLL, "n_intervals"),
        State(IDS.CURRENT, "data"),
    )
    def progress(_n: int | None, ref_id: str | None) -> str:
        state = store.progress(ref_id) if ref_id else None
        return "loading…" if state is None else f"{state[0]}… {state[1]:.1f} s"


def _window_from_inputs(
    loaded: LoadedTrace, zoom: dict | None, step_range: list[int] | None
) -> tuple[int | None, int | None]:
    """The timeline window asked for by whatever fired: a drag-zoom, the step slider, or
    (``None, None``) the whole trace."""
    t0 = loaded.lanes.t0_ns
    fired = set(ctx.triggered_prop_ids.values())
    if IDS.CURRENT in fired or IDS.RESET in fired:
        return None, None
    if IDS.ZOOM in fired and zoom:
        if zoom.get("range") is None:
            return None, None  # autorange (double-click)
        lo, hi = zoom["range"]
        return t0 + int(float(lo) * 1e6), t0 + int(float(hi) * 1e6)
    if IDS.STEP_RANGE in fired and step_range:
        steps = loaded.report.tables["steps"]
        sel = steps[(steps["step"] >= step_range[0]) & (steps["step"] <= step_range[1])]
        if len(sel):
            return int(sel["start_ns"].min()), int(sel["end_ns"].max())
    return None, None


def _stale(tab: str, wanted_tab: str, drawn: dict | None, ref_id: str | None) -> bool:
    """Draw only on the visible tab, and on a tab switch only when another trace is drawn."""
    if tab != wanted_tab:
        return False
    if ctx.triggered_id == IDS.TABS:
        return not drawn or drawn.get("ref") != ref_id
    return True


def _register_views(app: Dash, store: TraceStore, config: DashboardConfig) -> None:
    @app.callback(
        Output(IDS.TIMELINE, "figure"),
        Output(IDS.TIMELINE_INFO, "children"),
        Output(IDS.TIMELINE_DRAWN, "data"),
        Input(IDS.CURRENT, "data"),
        Input(IDS.ZOOM, "data"),
        Input(IDS.STEP_RANGE, "value"),
        Input(IDS.RESET, "n_clicks"),
        Input(IDS.TABS, "value"),
        State(IDS.TIMELINE_DRAWN, "data"),
        prevent_initial_call=True,
    )
    def timeline(
        ref_id: str | None,
        zoom: dict | None,
        step_range: list[int] | None,
        _reset: int | None,
        tab: str,
        drawn: dict | None,
    ) -> tuple[Any, ...]:
        if not ref_id or not _stale(tab, "timeline", drawn, ref_id):
            return no_update, no_update, no_update
        try:
            loaded = _load(store, ref_id)
        except Exception:
            return empty_figure("this trace could not be loaded"), "", None
        if loaded is None:
            return empty_figure(_RANK_SET_TAB), "", None
        lo, hi = _window_from_inputs(loaded, zoom, step_range)
        fig = timeline_figure(loaded.lanes, lo, hi, bar_budget=config.timeline_bar_budget)
        meta = fig.layout.meta
        return fig, f"{meta['mode']} · {meta['num_visible']:,} slices in view", {"ref": ref_id}

    @app.callback(
        Output(IDS.STEPS, "figure"),
        Output(IDS.STEPS_DRAWN, "data"),
        Input(IDS.CURRENT, "data"),
        Input(IDS.STEP_RANGE, "value"),
        Input(IDS.TABS, "value"),
        State(IDS.STEPS_DRAWN, "data"),
        prevent_initial_call=True,
    )
    def steps(
        ref_id: str | None, step_range: list[int] | None, tab: str, drawn: dict | None
    ) -> tuple[Any, ...]:
        if not ref_id or not _stale(tab, "steps", drawn, ref_id):
            return no_update, no_update
        try:
            loaded = _load(store, ref_id)
        except Exception:
            return empty_figure("this trace could not be loaded"), None
        if loaded is None:
            return empty_figure(_RANK_SET_TAB), None
        return steps_figure(loaded.report, tuple(step_range) if step_range else None), {
            "ref": ref_id
        }

    @app.callback(
        Output(IDS.COMPARE_BODY, "children"),
        Input(IDS.COMPARE_A, "value"),
        Input(IDS.COMPARE_B, "value"),
        prevent_initial_call=True,
    )
    def compare(a_id: str | None, b_id: str | None) -> Any:
        if not a_id or not b_id:
            return no_update
        try:
            a, b, cmp = store.compare(TraceRef.parse(a_id), TraceRef.parse(b_id))
        except Exception as exc:
            return banner(_error_text(exc))
        return compare_body(a, b, cmp)


# Only x-axis changes of the timeline reach the server: other relayout events (autosize when the
# tab mounts, legend clicks) would otherwise supersede an in-flight draw with "no update".
_ZOOM_JS = """function (r) {
    const nu = window.dash_clientside.no_update;
    if (!r) return nu;
    if ('xaxis.range[0]' in r) return {range: [r['xaxis.range[0]'], r['xaxis.range[1]']], t: Date.now()};
    if ('xaxis.range' in r) return {range: r['xaxis.range'], t: Date.now()};
    if ('xaxis.autorange' in r) return {range: null, t: Date.now()};
    return nu;
}"""


def register_callbacks(app: Dash, store: TraceStore, config: DashboardConfig) -> None:
    """Wire every callback of the page to ``store``."""
    app.clientside_callback(
        _ZOOM_JS,
        Output(IDS.ZOOM, "data"),
        Input(IDS.TIMELINE, "relayoutData"),
        prevent_initial_call=True,
    )
    _register_selection(app, store)
    register_rank_callbacks(app)
    _register_load(app, store, config)
    _register_views(app, store, config)
