"""The dashboard's configuration: one frozen record, validated once, built by the CLI."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["DashboardConfig", "PERFETTO_UI_URL", "TRACE_SUFFIXES"]

PERFETTO_UI_URL = "https://ui.perfetto.dev"
# File names the picker lists (the loader decides the format from the content).
TRACE_SUFFIXES = (".pftrace", ".perfetto-trace", ".pb", ".trace", ".json", ".json.gz")


@dataclass(frozen=True)
class DashboardConfig:
    """How the dashboard is served.

    Args:
        traces_dir: the only directory whose files the app lists and serves.
        host: interface to bind; 127.0.0.1 keeps traces on this machine.
        port: TCP port (0 lets the OS pick one).
        max_upload_mb: largest trace accepted through the upload box.
        perfetto_url: origin of the Perfetto UI the "Open in Perfetto UI" button talks to.
        max_cached_traces: analysed traces kept in memory (least recently used are dropped).
        timeline_bar_budget: most slices drawn one by one; above it the timeline shows density.
    """

    traces_dir: Path
    host: str = "127.0.0.1"
    port: int = 8050
    max_upload_mb: float = 100.0
    perfetto_url: str = PERFETTO_UI_URL
    max_cached_traces: int = 4
    timeline_bar_budget: int = 4000

    def __post_init__(self) -> None:
        if not self.traces_dir.is_dir():
            raise ValueError(f"--traces {self.traces_dir}: not a directory")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_upload_mb <= 0:
            raise ValueError(f"--max-upload-mb must be > 0, got {self.max_upload_mb}")
        if not self.perfetto_url.startswith(("https://", "http://")):
            raise ValueError(f"perfetto_url must be an http(s) origin, got {self.perfetto_url!r}")
        if self.max_cached_traces < 1:
            raise ValueError(f"max_cached_traces must be >= 1, got {self.max_cached_traces}")
        if self.timeline_bar_budget < 100:
            raise ValueError(f"timeline_bar_budget must be >= 100, got {self.timeline_bar_budget}")

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 1024 * 1024)

    @property
    def perfetto_origin(self) -> str:
        """Scheme + host (+ port) of ``perfetto_url``: the postMessage target origin."""
        scheme, _, rest = self.perfetto_url.partition("://")
        return f"{scheme}://{rest.split('/', 1)[0]}"
