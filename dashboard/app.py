"""The Dash application: layout, callbacks, and the one route that serves trace bytes."""

from __future__ import annotations

from pathlib import Path

from dash import Dash
from flask import Response, abort, request, send_file

from dashboard.callbacks import register_callbacks
from dashboard.config import DashboardConfig
from dashboard.layout import build_layout
from dashboard.paths import UnsafePathError
from dashboard.store import TraceRef, TraceStore

__all__ = ["create_app", "TRACE_ROUTE"]

TRACE_ROUTE = "/stepscope/trace/<path:ref_id>"
_ASSETS = Path(__file__).parent / "assets"
# Uploads arrive base64-encoded inside a JSON callback body: 4/3 of the file plus framing.
_UPLOAD_OVERHEAD = 4 / 3
_BODY_SLACK = 1 << 20


def _serve_trace(store: TraceStore, ref_id: str) -> Response:
    """The raw bytes of a trace inside its root; 404 for anything else (never says why)."""
    try:
        path = store.resolve(TraceRef.parse(ref_id))
    except UnsafePathError:
        abort(404)
    download = request.args.get("download") == "1"
    response = send_file(
        path,
        mimetype="application/octet-stream",
        as_attachment=download,
        download_name=path.name,
        conditional=False,
        etag=False,
        max_age=0,
    )
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Cache-Control"] = "no-store"
    return response


def create_app(config: DashboardConfig, store: TraceStore | None = None) -> Dash:
    """A ready-to-serve dashboard for ``config`` (serve ``app.server`` with any WSGI server)."""
    store = store or TraceStore(
        config.traces_dir, config.max_cached_traces, config.max_upload_bytes
    )
    app = Dash(
        __name__,
        title="stepscope",
        assets_folder=str(_ASSETS),
        suppress_callback_exceptions=True,
        update_title=None,
        # plotly.js loads with the page, not when the first figure of a picked trace mounts.
        eager_loading=True,
    )
    app.server.config["MAX_CONTENT_LENGTH"] = (
        int(config.max_upload_bytes * _UPLOAD_OVERHEAD) + _BODY_SLACK
    )
    app.layout = build_layout(config)
    register_callbacks(app, store, config)
    app.server.add_url_rule(
        TRACE_ROUTE, "stepscope_trace", lambda ref_id: _serve_trace(store, ref_id)
    )
    app.server.extensions["stepscope_store"] = store
    return app
