"""Rank sets: the ``X.rank<i>.pftrace`` files of one tensor-parallel run, opened as one entry.

A rank set is named by the browser as ``ranks/<stem>`` (``ranks/nested/tp`` for
``nested/tp.rank0.pftrace``, ``nested/tp.rank1.pftrace``, ...). The name is only a key: the
member files are found again by grouping the names the trace directory lists (themselves resolved
inside the root), so a set id never opens a path of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from analysis.ranks.report import RankReport
from dashboard.paths import UnsafePathError
from instrument.schema import parse_rank_trace_path

if TYPE_CHECKING:  # the store imports this module
    from dashboard.store import TraceRef

__all__ = [
    "RANKS_SOURCE",
    "RankSetRef",
    "LoadedRankSet",
    "find_rank_sets",
    "is_rank_set_id",
    "rank_set_label",
]

RANKS_SOURCE = "ranks"
MIN_RANKS = 2


@dataclass(frozen=True)
class RankSetRef:
    """The rank set whose member files are ``<stem>.rank<i>.<ext>`` in the trace directory."""

    stem: str

    def __post_init__(self) -> None:
        if not self.stem or "\x00" in self.stem:
            raise UnsafePathError("empty or malformed rank set name")

    @property
    def id(self) -> str:
        return f"{RANKS_SOURCE}/{self.stem}"

    @classmethod
    def parse(cls, ref_id: str) -> RankSetRef:
        """Inverse of :attr:`id`; raises :class:`UnsafePathError` for anything else."""
        source, _, stem = (ref_id or "").partition("/")
        if source != RANKS_SOURCE:
            raise UnsafePathError(f"{ref_id!r}: not a rank set")
        return cls(stem)


def is_rank_set_id(ref_id: str | None) -> bool:
    return bool(ref_id) and str(ref_id).startswith(RANKS_SOURCE + "/")


def rank_set_label(stem: str, num_files: int) -> str:
    """How the picker and the page title name a set: ``tp (2 ranks)``."""
    return f"{stem} ({num_files} ranks)"


def find_rank_sets(names: list[str]) -> dict[str, list[str]]:
    """Rank trace names grouped by run: ``{stem: [names in file-name rank order]}``, only runs
    with at least two files (one ``X.rank0.pftrace`` alone stays a single trace)."""
    runs: dict[str, list[tuple[int, str]]] = {}
    for name in names:
        parsed = parse_rank_trace_path(name)
        if parsed is not None:
            runs.setdefault(parsed[0], []).append((parsed[1], name))
    return {
        stem: [name for _, name in sorted(members)]
        for stem, members in sorted(runs.items())
        if len(members) >= MIN_RANKS
    }


@dataclass(frozen=True)
class LoadedRankSet:
    """An analysed rank set: the analysis' :class:`RankReport`, each rank's file (by the rank the
    analysis gave it), and what the set cost to load."""

    ref: RankSetRef
    members: dict[int, TraceRef]
    paths: dict[int, Path]
    size_bytes: int
    report: RankReport
    load_s: float

    @property
    def title(self) -> str:
        return rank_set_label(self.ref.stem, len(self.members))
