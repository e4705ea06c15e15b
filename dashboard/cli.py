"""``stepscope dashboard``: parse flags into a :class:`DashboardConfig` and serve the app."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from dashboard.config import DashboardConfig

__all__ = ["dashboard_main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepscope dashboard",
        description="Serve the stepscope web dashboard over a directory of traces.",
    )
    parser.add_argument(
        "--traces",
        type=Path,
        default=Path.cwd(),
        help="directory of trace files to list and serve (default: current directory)",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to bind (default 127.0.0.1: this machine only)",
    )
    parser.add_argument(
        "--port", type=int, default=8050, help="TCP port (default 8050; 0 = any free)"
    )
    parser.add_argument(
        "--max-upload-mb",
        type=float,
        default=100.0,
        help="largest trace accepted by the upload box, in MB (default 100)",
    )
    return parser


def dashboard_main(argv: list[str]) -> int:
    """Entry point used by ``stepscope dashboard``; returns an exit status."""
    args = build_parser().parse_args(argv)
    try:
        config = DashboardConfig(
            traces_dir=args.traces, host=args.host, port=args.port, max_upload_mb=args.max_upload_mb
        )
    except ValueError as exc:
        print(f"stepscope dashboard: {exc}", file=sys.stderr)
        return 2
    from dashboard.app import create_app  # imports dash/plotly only when serving

    app = create_app(config)
    if config.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"warning: serving traces on {config.host}: anyone who can reach it can read them",
            file=sys.stderr,
        )
    print(
        f"stepscope dashboard: http://{config.host}:{config.port}/  (traces: {config.traces_dir.resolve()})"
    )
    _exit_on_sigterm()
    try:
        app.run(host=config.host, port=config.port, debug=False)
    except KeyboardInterrupt:
        pass
    finally:
        app.server.extensions["stepscope_store"].close()  # the uploads' temporary folder
    return 0


def _exit_on_sigterm() -> None:
    """SIGTERM ends the server as Ctrl-C does (``finally`` blocks and atexit run), unless the
    parent set it to be ignored."""
    if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        return

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
