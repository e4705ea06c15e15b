"""The one error type of the analysis, in a module that imports nothing heavy, so the CLI and the
trace prefetch (``analysis.loading.prefetch``) can raise and catch it before pandas is loaded."""

from __future__ import annotations

__all__ = ["TraceError"]


class TraceError(ValueError):
    """A trace file that cannot be read or analysed; the message says why in plain words."""
