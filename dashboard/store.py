"""The one owner of analysed traces: resolves names safely, loads, caches, reports progress.

Traces come from two roots: the ``--traces`` directory (``traces/<relative name>``) and a private
upload directory the app creates (``uploads/<digest>-<name>``). Every open goes through
:class:`~dashboard.paths.TraceDirectory`, so a browser-supplied id never escapes either root.
The ``X.rank<i>.pftrace`` files of a tensor-parallel run in the ``--traces`` directory are also
offered as one rank set (``ranks/X``, :mod:`dashboard.rank_sets`), analysed by
:func:`analysis.rank_report.analyze_ranks` and cached like a single trace.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TypeVar

from analysis import Comparison, Report, TraceError, analyze_frames, compare_reports, load_trace
from analysis.rank_report import analyze_ranks
from dashboard.lanes import LaneIndex
from dashboard.paths import TraceDirectory, UnsafePathError
from dashboard.rank_sets import LoadedRankSet, RankSetRef, find_rank_sets

__all__ = ["TraceRef", "LoadedTrace", "TraceStore", "UploadError", "SOURCES"]

SOURCES = ("traces", "uploads")
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")
# (real path, mtime, size) of each file an entry was built from: a changed file is a new entry.
CacheKey = tuple[tuple[str, int, int], ...]
_Entry = TypeVar("_Entry", "LoadedTrace", LoadedRankSet)


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
    """Analyses traces and rank sets on demand and keeps the ``max_cached`` most recent in
    memory."""

    def __init__(self, traces_dir: Path, max_cached: int, max_upload_bytes: int) -> None:
        self._upload_root = Path(tempfile.mkdtemp(prefix="stepscope-uploads-"))
        # Uploads live as long as the store: removed by close(), when the store is collected,
        # or at interpreter exit (the dashboard turns SIGTERM into a normal exit for this).
        self._remove_uploads = weakref.finalize(
            self, shutil.rmtree, str(self._upload_root), ignore_errors=True
        )
        self.roots = {
            "traces": TraceDirectory(traces_dir),
            "uploads": TraceDirectory(self._upload_root, suffixes=()),
        }
        self.max_cached = max_cached
        self.max_upload_bytes = max_upload_bytes
        self._cache: OrderedDict[CacheKey, LoadedTrace | LoadedRankSet] = OrderedDict()
        self._lock = threading.Lock()
        self._load_locks: dict[CacheKey, threading.Lock] = {}
        self._progress: dict[str, tuple[str, float]] = {}

    # ---- names ---------------------------------------------------------------------------
    def list_traces(self) -> list[TraceRef]:
        """Traces in the ``--traces`` directory (newest first), then uploads."""
        return [TraceRef(src, n) for src in SOURCES for n in self.roots[src].list_names()]

    def list_rank_sets(self) -> dict[RankSetRef, list[TraceRef]]:
        """Rank sets of the ``--traces`` directory (two or more ``X.rank<i>`` files of one ``X``),
        each with its files in file-name rank order."""
        sets = find_rank_sets(self.roots["traces"].list_names())
        return {RankSetRef(s): [TraceRef("traces", n) for n in ns] for s, ns in sets.items()}

    def resolve(self, ref: TraceRef) -> Path:
        """The real path of ``ref`` inside its root (:class:`UnsafePathError` otherwise)."""
        return self.roots[ref.source].resolve(ref.name)

    def rank_set_members(self, ref: RankSetRef) -> list[TraceRef]:
        """The files of ``ref`` as listed now (:class:`UnsafePathError` when there is no such
        set of two or more files)."""
        members = self.list_rank_sets().get(ref)
        if not members:
            raise UnsafePathError(f"{ref.stem!r}: no rank set of two or more rank traces")
        return members

    # ---- loading -------------------------------------------------------------------------
    def progress(self, ref_id: str) -> tuple[str, float] | None:
        """``(stage, seconds so far)`` while ``ref_id`` loads, else None."""
        entry = self._progress.get(ref_id)
        return None if entry is None else (entry[0], time.monotonic() - entry[1])

    def _stage(self, ref_id: str, stage: str, started: float) -> None:
        self._progress[ref_id] = (stage, started)

    def load(self, ref: TraceRef) -> LoadedTrace:
        """The analysed trace (cached by real path, mtime and size; a rank's report already
        computed for a cached rank set is reused).

        Raises :class:`UnsafePathError` for names outside the roots and
        :class:`~analysis.TraceError` for files the analysis cannot read.
        """
        path = self.resolve(ref)
        key = _file_keys([path])

        def build() -> LoadedTrace:
            return self._from_rank_set(ref, path, key) or self._analyse(ref, path, key[0][2])

        return self._cached(key, build)

    def load_rank_set(self, ref: RankSetRef) -> LoadedRankSet:
        """The analysed rank set (cached by each file's real path, mtime and size).

        Raises :class:`UnsafePathError` when ``ref`` names no set and
        :class:`~analysis.TraceError` when the analysis refuses the files (one unreadable,
        ranks of different runs, a rank twice).
        """
        members = self.rank_set_members(ref)
        paths = [self.resolve(m) for m in members]
        key = _file_keys(paths)
        return self._cached(key, lambda: self._analyse_ranks(ref, members, paths, key))

    def _cached(self, key: CacheKey, build: Callable[[], _Entry]) -> _Entry:
        """``build()`` once per key (concurrent callers wait for the first), LRU-cached."""
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]  # type: ignore[return-value]
            load_lock = self._load_locks.setdefault(key, threading.Lock())
        with load_lock:
            with self._lock:
                if key in self._cache:
                    return self._cache[key]  # type: ignore[return-value]
            loaded = build()
            with self._lock:
                self._cache[key] = loaded
                while len(self._cache) > self.max_cached:
                    self._cache.popitem(last=False)
        return loaded

    def _analyse(self, ref: TraceRef, path: Path, size: int) -> LoadedTrace:
        started = time.monotonic()
        try:
            self._stage(ref.id, f"decoding {size / 1e6:.1f} MB", started)
            frames = load_trace(path)
            self._stage(ref.id, f"measuring {len(frames.slices):,} slices", started)
            report = analyze_frames(frames)
        except TraceError as exc:  # say which trace, without the server's directory layout
            raise TraceError(str(exc).replace(str(path), ref.name)) from None
        finally:
            self._progress.pop(ref.id, None)
        return LoadedTrace(ref, path, size, report, time.monotonic() - started)

    def _analyse_ranks(
        self, ref: RankSetRef, members: list[TraceRef], paths: list[Path], key: CacheKey
    ) -> LoadedRankSet:
        started = time.monotonic()
        size = sum(k[2] for k in key)
        try:
            self._stage(ref.id, f"analysing {len(paths)} rank traces, {size / 1e6:.1f} MB", started)
            report = analyze_ranks([str(p) for p in paths])
        except TraceError as exc:  # say which file, without the server's directory layout
            message = str(exc)
            for path, member in zip(paths, members, strict=True):
                message = message.replace(str(path), member.name)
            raise TraceError(message) from None
        finally:
            self._progress.pop(ref.id, None)
        by_path = {str(p): (m, p) for m, p in zip(members, paths, strict=True)}
        placed = {r: by_path[str(f.metadata["path"])] for r, f in report.ranks.frames.items()}
        return LoadedRankSet(
            ref,
            members={r: m for r, (m, _) in placed.items()},
            paths={r: p for r, (_, p) in placed.items()},
            size_bytes=size,
            report=report,
            load_s=time.monotonic() - started,
        )

    def _from_rank_set(self, ref: TraceRef, path: Path, key: CacheKey) -> LoadedTrace | None:
        """This file's own report from a cached rank set that read it unchanged and did not shift
        it onto another host's clock: the single-trace analysis, with the same defaults."""
        with self._lock:
            sets = [  # most recently used first
                e
                for k, e in reversed(self._cache.items())
                if key[0] in k and isinstance(e, LoadedRankSet)
            ]
        for loaded in sets:
            for rank, member_path in loaded.paths.items():
                if member_path == path and not loaded.report.ranks.clock_shift_ns.get(rank):
                    report = loaded.report.reports[rank]
                    return LoadedTrace(ref, path, key[0][2], report, loaded.load_s)
        return None

    def compare(self, a: TraceRef, b: TraceRef) -> tuple[LoadedTrace, LoadedTrace, Comparison]:
        """Both traces analysed, and the analysis' A/B comparison of them."""
        la, lb = self.load(a), self.load(b)
        return la, lb, compare_reports(la.report, lb.report)

    # ---- uploads -------------------------------------------------------------------------
    @property
    def upload_root(self) -> Path:
        """The temporary folder holding this store's uploads (removed by :meth:`close`)."""
        return self._upload_root

    def close(self) -> None:
        """Remove the uploads folder (idempotent); uploaded traces cannot be opened after."""
        self._remove_uploads()

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


def _file_keys(paths: list[Path]) -> CacheKey:
    keys = []
    for path in paths:
        stat = path.stat()
        keys.append((str(path), stat.st_mtime_ns, stat.st_size))
    return tuple(keys)


def is_trace_error(exc: BaseException) -> bool:
    """True for errors that mean "this file is not a usable trace" (shown as a banner)."""
    return isinstance(exc, (TraceError, UnsafePathError, UploadError))
