"""The one owner of analysed traces: resolves names safely, loads, caches, reports progress.

Traces come from two roots: the ``--traces`` directory (``traces/<relative name>``) and a private
upload directory the app creates (``uploads/<digest>-<name>``). Every open goes through
:class:`~dashboard.paths.TraceDirectory`, so a browser-supplied id never escapes either root.
"""

from __future__ import annotations

import hashlib
import re
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from analysis import Comparison, Report, TraceError, analyze_frames, compare_reports, load_trace
from dashboard.lanes import LaneIndex
from dashboard.paths import TraceDirectory, UnsafePathError

__all__ = ["TraceRef", "LoadedTrace", "TraceStore", "UploadError", "SOURCES"]

SOURCES = ("traces", "uploads")
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


class UploadError(ValueError):
    """An upload refused before analysis (too large, empty)."""


@dataclass(frozen=True)
class TraceRef:
    """A trace the browser may name: ``source`` (``traces``/``uploads``) and a relative name."""

    source: str
    name: str

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise UnsafePathError(f"unknown trace source {self.source!r}")

    @property
    def id(self) -> str:
        return f"{self.source}/{self.name}"

    @classmethod
    def parse(cls, ref_id: str) -> TraceRef:
        """Inverse of :attr:`id`; raises :class:`UnsafePathError` for anything else."""
        source, _, name = (ref_id or "").partition("/")
        return cls(source, name)


@dataclass(frozen=True)
class LoadedTrace:
    """An analysed trace: its report, what it cost to load, and (built on first use, so the
    overview does not wait for it) its timeline lanes."""

    ref: TraceRef
    path: Path
    size_bytes: int
    report: Report
    load_s: float

    @cached_property
    def lanes(self) -> LaneIndex:
        return LaneIndex.from_frames(self.report.frames.slices, self.report.tables["bubbles"])

    @property
    def title(self) -> str:
        return self.ref.name.split("/")[-1]


class TraceStore:
    """Analyses traces on demand and keeps the ``max_cached`` most recent in memory."""

    def __init__(self, traces_dir: Path, max_cached: int, max_upload_bytes: int) -> None:
        self._upload_root = Path(tempfile.mkdtemp(prefix="stepscope-uploads-"))
        self.roots = {
            "traces": TraceDirectory(traces_dir),
            "uploads": TraceDirectory(self._upload_root, suffixes=()),
        }
        self.max_cached = max_cached
        self.max_upload_bytes = max_upload_bytes
        self._cache: OrderedDict[tuple[str, int, int], LoadedTrace] = OrderedDict()
        self._lock = threading.Lock()
        self._load_locks: dict[str, threading.Lock] = {}
        self._progress: dict[str, tuple[str, float]] = {}

    # ---- names ---------------------------------------------------------------------------
    def list_traces(self) -> list[TraceRef]:
        """Traces in the ``--traces`` directory (newest first), then uploads."""
        return [TraceRef(src, n) for src in SOURCES for n in self.roots[src].list_names()]

    def resolve(self, ref: TraceRef) -> Path:
        """The real path of ``ref`` inside its root (:class:`UnsafePathError` otherwise)."""
        return self.roots[ref.source].resolve(ref.name)

    # ---- loading -------------------------------------------------------------------------
    def progress(self, ref_id: str) -> tuple[str, float] | None:
        """``(stage, seconds so far)`` while ``ref_id`` loads, else None."""
        entry = self._progress.get(ref_id)
        return None if entry is None else (entry[0], time.monotonic() - entry[1])

    def _stage(self, ref: TraceRef, stage: str, started: float) -> None:
        self._progress[ref.id] = (stage, started)

    def load(self, ref: TraceRef) -> LoadedTrace:
        """The analysed trace (cached by real path, mtime and size).

        Raises :class:`UnsafePathError` for names outside the roots and
        :class:`~analysis.TraceError` for files the analysis cannot read.
        """
        path = self.resolve(ref)
        stat = path.stat()
        key = (str(path), stat.st_mtime_ns, stat.st_size)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            load_lock = self._load_locks.setdefault(str(path), threading.Lock())
        with load_lock:
            with self._lock:
                if key in self._cache:
                    return self._cache[key]
            loaded = self._analyse(ref, path, stat.st_size)
            with self._lock:
                self._cache[key] = loaded
                while len(self._cache) > self.max_cached:
                    self._cache.popitem(last=False)
        return loaded

    def _analyse(self, ref: TraceRef, path: Path, size: int) -> LoadedTrace:
        started = time.monotonic()
        try:
            self._stage(ref, f"decoding {size / 1e6:.1f} MB", started)
            frames = load_trace(path)
            self._stage(ref, f"measuring {len(frames.slices):,} slices", started)
            report = analyze_frames(frames)
        except TraceError as exc:  # say which trace, without the server's directory layout
            raise TraceError(str(exc).replace(str(path), ref.name)) from None
        finally:
            self._progress.pop(ref.id, None)
        return LoadedTrace(ref, path, size, report, time.monotonic() - started)

    def compare(self, a: TraceRef, b: TraceRef) -> tuple[LoadedTrace, LoadedTrace, Comparison]:
        """Both traces analysed, and the analysis' A/B comparison of them."""
        la, lb = self.load(a), self.load(b)
        return la, lb, compare_reports(la.report, lb.report)

    # ---- uploads -------------------------------------------------------------------------
    def save_upload(self, filename: str, data: bytes) -> TraceRef:
        """Store uploaded bytes under a content-addressed name; returns its ref."""
        if not data:
            raise UploadError(f"{filename}: the file is empty")
        if len(data) > self.max_upload_bytes:
            raise UploadError(
                f"{filename}: {len(data) / 1e6:.1f} MB is over the upload limit of "
                f"{self.max_upload_bytes / 1e6:.1f} MB (start with --max-upload-mb to raise it)"
            )
        digest = hashlib.sha256(data).hexdigest()[:12]
        safe = _SAFE_NAME.sub("_", Path(filename or "trace").name).strip("._") or "trace"
        name = f"{digest}-{safe[:80]}"
        (self._upload_root / name).write_bytes(data)
        return TraceRef("uploads", name)


def is_trace_error(exc: BaseException) -> bool:
    """True for errors that mean "this file is not a usable trace" (shown as a banner)."""
    return isinstance(exc, (TraceError, UnsafePathError, UploadError))
