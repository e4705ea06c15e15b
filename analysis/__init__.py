"""stepscope analysis: trace files in, diagnosis out (docs/design.md §4–§5).

Public API (what the CLI and the dashboard call)::

    from analysis import analyze_trace, load_trace, compare_traces
    report = analyze_trace("run.pftrace")            # or a Kineto .json / .json.gz
    report.headline["overlap"], report.verdicts, report.tables["bubbles"]
    report.frames.slices                              # typed frames, see analysis.frames

Every metric function is DataFrame in, DataFrame out (see the modules' docstrings).
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from analysis.errors import TraceError
from analysis.loading.load import DEFAULT_MAX_DECOMPRESSED_MB, load_trace

if TYPE_CHECKING:
    from analysis.compare import Comparison
    from analysis.frames import TraceFrames
    from analysis.headline import Headline
    from analysis.loading.profiles import PROFILES, Profile, get_profile, load_profile_file
    from analysis.report import HEADLINE_KEYS, Report

# Imported on first use (PEP 562), so that `import analysis` (and `stepscope analyze` before it
# has started reading the trace, see analysis.loading.prefetch) does not pay for pandas.
_LAZY = {
    "Comparison": "analysis.compare",
    "compare_reports": "analysis.compare",
    "TraceFrames": "analysis.frames",
    "Headline": "analysis.headline",
    "PROFILES": "analysis.loading.profiles",
    "Profile": "analysis.loading.profiles",
    "get_profile": "analysis.loading.profiles",
    "load_profile_file": "analysis.loading.profiles",
    "HEADLINE_KEYS": "analysis.report",
    "Report": "analysis.report",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'analysis' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "analyze_trace",
    "analyze_frames",
    "compare_traces",
    "load_trace",
    "Report",
    "Comparison",
    "TraceFrames",
    "TraceError",
    "Profile",
    "PROFILES",
    "get_profile",
    "load_profile_file",
    "HEADLINE_KEYS",
    "Headline",
]


def analyze_frames(
    frames: TraceFrames,
    profile: Profile | str | None = None,
    skip_steps: int = 1,
    window: str = "steady",
    parallel: bool = False,
) -> Report:
    """The report of already-loaded frames over ``window``: ``steady`` (the steady-state rule of
    ``analysis.metrics.steady``, falling back to ``all``), ``all`` (``skip_steps`` warm-up steps left
    out) or ``A:B`` (steps A..B-1). ``parallel``: on a large trace, part of the work may run in
    a forked child process (same result; ``stepscope analyze`` sets it)."""
    from analysis.report import build_report

    return build_report(frames, profile, skip_steps, window, parallel)


def analyze_trace(
    path: str | os.PathLike[str],
    profile: Profile | str | None = None,
    skip_steps: int = 1,
    window: str = "steady",
    max_decompressed_mb: float = DEFAULT_MAX_DECOMPRESSED_MB,
) -> Report:
    """Load ``path`` (format detected from its bytes) and compute every §4 metric.

    ``profile``: a built-in name (``stepscope``, ``vllm``, ``sglang``), a ``.json``/``.toml``
    profile file, or a :class:`Profile`; default ``stepscope`` for Perfetto, ``vllm`` for Kineto.
    ``window``: see :func:`analyze_frames`. Raises :class:`TraceError` (plain message) for
    unreadable traces, and for a gzip file that decompresses to more than
    ``max_decompressed_mb``.
    """
    frames = load_trace(path, profile, max_decompressed_mb)
    return analyze_frames(frames, profile, skip_steps, window)


def compare_traces(
    path_a: str | os.PathLike[str],
    path_b: str | os.PathLike[str],
    profile: Profile | str | None = None,
    vary: tuple[str, ...] = (),
    skip_steps: int = 1,
    window: str = "steady",
) -> tuple[Report, Report, Comparison]:
    """Analyse both traces and compare them (contract check, deltas, output agreement)."""
    a = analyze_trace(path_a, profile, skip_steps, window)
    b = analyze_trace(path_b, profile, skip_steps, window)
    from analysis.compare import compare_reports

    return a, b, compare_reports(a, b, vary)
