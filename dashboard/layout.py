"""The page shell: header (trace picker, upload, Perfetto/download), banner, progress, tabs.

The Overview tab shows a single trace's verdicts, or a rank set's (``dashboard.ranks.view``);
the single-trace tabs are disabled while a rank set is open.

Component ids are module constants so callbacks and tests name them once.
"""

from __future__ import annotations

from dash import dash_table, dcc, html

from dashboard.config import DashboardConfig
from dashboard.figures import empty_figure

__all__ = ["build_layout", "IDS", "TABLE_STYLE"]


class IDS:
    """Every component id the callbacks and the browser tests use."""

    PICKER = "trace-picker"
    REFRESH = "refresh-traces"
    UPLOAD = "upload"
    CURRENT = "current-trace"
    BANNER = "banner"
    PROGRESS = "progress"
    PROGRESS_TEXT = "progress-text"
    PROGRESS_POLL = "progress-poll"
    ACTIONS = "trace-actions"
    TITLE = "trace-title"
    TABS = "tabs"
    OVERVIEW = "overview"
    TIMELINE = "timeline"
    TIMELINE_INFO = "timeline-info"
    STEP_RANGE = "step-range"
    RESET = "timeline-reset"
    STEPS = "steps-graph"
    TIMELINE_DRAWN = "timeline-drawn"
    ZOOM = "timeline-zoom"
    STEPS_DRAWN = "steps-drawn"
    DECISIONS = "decisions-table"
    SYNCS = "syncs-table"
    COMPARE_A = "compare-a"
    COMPARE_B = "compare-b"
    COMPARE_BODY = "compare-body"
    RANK_TABLE = "rank-table"
    RANK_STRAGGLERS = "rank-stragglers"
    RANK_COLLECTIVES = "rank-collectives"
    OPEN_REF = "open-ref"  # pattern-matching type: {"type": OPEN_REF, "index": trace or set id}
    # tabs that show one trace; greyed out while a rank set is open
    SINGLE_TRACE_TABS = ("timeline", "steps", "tables")

    @staticmethod
    def tab(value: str) -> str:
        return f"tab-{value}"


TABLE_STYLE = {
    "style_table": {"overflowX": "auto"},
    "style_cell": {
        "fontFamily": "var(--mono)",
        "fontSize": "12px",
        "padding": "6px 10px",
        "textAlign": "left",
        "border": "none",
        "borderBottom": "1px solid #eceef2",
        "whiteSpace": "normal",
        "height": "auto",
        "maxWidth": "520px",
    },
    "style_header": {
        "fontFamily": "var(--sans)",
        "fontWeight": "600",
        "fontSize": "12px",
        "backgroundColor": "#f6f7f9",
        "borderBottom": "1px solid #d9dce2",
        "color": "#3b4250",
    },
}


def _header() -> html.Header:
    return html.Header(
        className="topbar",
        children=[
            html.Div(
                [
                    html.Span("stepscope", className="brand"),
                    html.Span("dashboard", className="brand-sub"),
                ],
                className="brand-box",
            ),
            dcc.Dropdown(
                id=IDS.PICKER,
                placeholder="pick a trace from the directory…",
                clearable=False,
                className="picker",
            ),
            html.Button(
                "↻", id=IDS.REFRESH, title="rescan the trace directory", className="icon-btn"
            ),
            dcc.Upload(
                id=IDS.UPLOAD,
                className="upload",
                multiple=False,
                children=html.Div(["drop a trace or ", html.A("upload")]),
            ),
            html.Div(id=IDS.ACTIONS, className="actions"),
        ],
    )


def _tab(label: str, value: str, children: list) -> dcc.Tab:
    return dcc.Tab(
        id=IDS.tab(value),
        label=label,
        value=value,
        className="tab",
        selected_className="tab--selected",
        disabled_className="tab tab--disabled",
        children=html.Div(children, className="tab-body"),
    )


def _timeline_tab() -> list:
    return [
        html.Div(
            className="toolbar",
            children=[
                html.Span("steps", className="toolbar-label"),
                html.Div(
                    dcc.RangeSlider(
                        id=IDS.STEP_RANGE,
                        min=0,
                        max=1,
                        value=[0, 1],
                        step=1,
                        tooltip={"placement": "bottom", "always_visible": False},
                        allowCross=False,
                    ),
                    className="range",
                ),
                html.Button("reset zoom", id=IDS.RESET, className="btn"),
                html.Span(id=IDS.TIMELINE_INFO, className="toolbar-info"),
            ],
        ),
        dcc.Graph(
            id=IDS.TIMELINE,
            figure=empty_figure("pick a trace"),
            config={
                "displaylogo": False,
                "scrollZoom": True,
                "modeBarButtonsToRemove": ["select2d", "lasso2d", "autoScale2d"],
            },
        ),
        html.P(
            "Drag to zoom, double-click to reset. Red shading: device idle (bubbles), coloured by the CPU "
            "slice the analysis blames. Zoomed out, each lane shows its busy fraction per pixel column.",
            className="hint",
        ),
    ]


def _tables_tab() -> list:
    return [
        html.H3("Feature decisions"),
        html.P(
            "requested → resolved, with the reason. Rows in red are silent fallbacks.",
            className="hint",
        ),
        dash_table.DataTable(
            id=IDS.DECISIONS,
            columns=[
                {"name": c, "id": c}
                for c in ("feature", "requested", "resolved", "reason", "silent")
            ],
            data=[],
            **TABLE_STYLE,
        ),
        html.H3("Host-device syncs"),
        html.P(
            "Counted by op and call site; 'hot after warm-up' syncs are defects on the hot path.",
            className="hint",
        ),
        dash_table.DataTable(
            id=IDS.SYNCS,
            columns=[
                {"name": c, "id": c} for c in ("op", "where", "count", "hot_after_warmup", "stack")
            ],
            data=[],
            page_size=50,
            **TABLE_STYLE,
        ),
    ]


def _compare_tab() -> list:
    return [
        html.Div(
            className="toolbar",
            children=[
                html.Span("A", className="ab-tag ab-a"),
                dcc.Dropdown(id=IDS.COMPARE_A, placeholder="trace A", className="picker"),
                html.Span("B", className="ab-tag ab-b"),
                dcc.Dropdown(id=IDS.COMPARE_B, placeholder="trace B", className="picker"),
            ],
        ),
        dcc.Loading(html.Div(id=IDS.COMPARE_BODY, className="compare-body"), type="dot"),
    ]


def build_layout(config: DashboardConfig) -> html.Div:
    """The whole page; dynamic parts are filled by :mod:`dashboard.callbacks`."""
    return html.Div(
        className="app",
        children=[
            dcc.Store(id=IDS.CURRENT),
            dcc.Store(id=IDS.TIMELINE_DRAWN),
            dcc.Store(id=IDS.ZOOM),
            dcc.Store(id=IDS.STEPS_DRAWN),
            dcc.Interval(id=IDS.PROGRESS_POLL, interval=250, disabled=True),
            _header(),
            html.Div(id=IDS.BANNER, className="banner-area"),
            html.Div(
                id=IDS.PROGRESS,
                className="progress",
                children=[
                    html.Div(className="progress-bar"),
                    html.Span(id=IDS.PROGRESS_TEXT, className="progress-text"),
                ],
            ),
            html.Div(id=IDS.TITLE, className="trace-title"),
            dcc.Tabs(
                id=IDS.TABS,
                value="overview",
                className="tabs",
                children=[
                    _tab(
                        "Overview",
                        "overview",
                        [
                            html.Div(
                                id=IDS.OVERVIEW,
                                children=html.P(
                                    f"Pick a trace from {config.traces_dir} or upload one.",
                                    className="hint",
                                ),
                            )
                        ],
                    ),
                    _tab("Timeline", "timeline", _timeline_tab()),
                    _tab(
                        "Per step",
                        "steps",
                        [
                            dcc.Graph(
                                id=IDS.STEPS,
                                figure=empty_figure("pick a trace"),
                                config={"displaylogo": False},
                            )
                        ],
                    ),
                    _tab("Decisions & syncs", "tables", _tables_tab()),
                    _tab("Compare", "compare", _compare_tab()),
                ],
            ),
        ],
    )
