"""The timeline's lanes: per-lane sorted interval arrays built once per trace, queried per zoom.

A lane is one row of the timeline: a CPU slice name on a thread (``schedule``,
``wait_output(accepted_count)``, ...), a device track (``gpu:0 compute``), or the device-idle row
(the analysis' bubbles, each labelled with its blame). Queries are numpy only (searchsorted,
cumulative measures), so a zoom on a 100k-step trace costs milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis.intervals import Union, cumulative_measure, union

__all__ = ["Lane", "LaneIndex", "IDLE_LANE", "lane_label"]

IDLE_LANE = "device idle"
_CPU_ORDER = (
    "schedule",
    "prepare_inputs",
    "launch",
    "wait_output",
    "update_from_output",
    "grammar_mask",
)
_ENVELOPES = ("step",)
_MAX_CPU_LANES = 12
_OTHER_CPU = "other cpu"


def lane_label(name: np.ndarray, kind: np.ndarray) -> np.ndarray:
    """``wait_output(accepted_count)`` for slices with a kind, the bare name otherwise."""
    name = name.astype(object)
    kind = kind.astype(object)
    out = name.copy()
    has_kind = kind != ""
    out[has_kind] = name[has_kind] + "(" + kind[has_kind] + ")"
    return out


@dataclass(frozen=True)
class Lane:
    """One timeline row: slices sorted by start, and their union (for density).

    ``names`` is the colour key of each slice (slice name, or the blame label on the idle lane).
    """

    label: str
    group: str  # "cpu", "device" or "idle"
    start_ns: np.ndarray
    end_ns: np.ndarray
    names: np.ndarray
    steps: np.ndarray
    busy: Union
    max_dur_ns: int

    @classmethod
    def build(
        cls,
        label: str,
        group: str,
        start: np.ndarray,
        end: np.ndarray,
        names: np.ndarray,
        steps: np.ndarray,
    ) -> Lane:
        order = np.argsort(start, kind="stable")
        s, e = start[order].astype(np.int64), end[order].astype(np.int64)
        max_dur = int((e - s).max()) if s.size else 0
        return cls(label, group, s, e, names[order], steps[order], union(s, e), max_dur)

    def visible(self, lo_ns: int, hi_ns: int) -> np.ndarray:
        """Indices of slices intersecting ``[lo_ns, hi_ns)``."""
        first = int(np.searchsorted(self.start_ns, lo_ns - self.max_dur_ns, side="left"))
        last = int(np.searchsorted(self.start_ns, hi_ns, side="left"))
        idx = np.arange(first, last)
        return idx[self.end_ns[first:last] > lo_ns]

    def count_upper_bound(self, lo_ns: int, hi_ns: int) -> int:
        """At least the number of visible slices (cheap: two binary searches)."""
        first = int(np.searchsorted(self.start_ns, lo_ns - self.max_dur_ns, side="left"))
        return int(np.searchsorted(self.start_ns, hi_ns, side="left")) - first

    def occupancy(self, edges_ns: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """Busy fraction of each bin ``[edges[i], edges[i+1])`` (of slices selected by ``mask``)."""
        u = self.busy if mask is None else union(self.start_ns[mask], self.end_ns[mask])
        covered = np.diff(cumulative_measure(u, edges_ns))
        width = np.diff(edges_ns).astype(np.float64)
        return np.divide(covered, width, out=np.zeros_like(width), where=width > 0)


def _split(df: pd.DataFrame, keys: list[str]) -> tuple[pd.DataFrame, list[np.ndarray]]:
    """Group rows by ``keys`` with integer codes only (no per-row strings or tuples):
    ``(one row of key values per group, row indices per group in input order)``."""
    if df.empty:
        return pd.DataFrame(columns=keys), []
    combined = np.zeros(len(df), dtype=np.int64)
    for key in keys:
        codes, uniques = pd.factorize(df[key], use_na_sentinel=False)
        combined = combined * max(len(uniques), 1) + codes
    _, first, inverse = np.unique(combined, return_index=True, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    bounds = np.searchsorted(inverse[order], np.arange(first.size + 1))
    groups = [order[bounds[i] : bounds[i + 1]] for i in range(first.size)]
    return df[keys].iloc[first].reset_index(drop=True), groups


def _build_lanes(
    df: pd.DataFrame, group: str, labels: list[str], rows: list[np.ndarray]
) -> list[Lane]:
    start, end = df["ts_ns"].to_numpy(np.int64), df["end_ns"].to_numpy(np.int64)
    names, steps = df["name"].to_numpy(object), df["step"].to_numpy(np.int64)
    return [
        Lane.build(label, group, start[r], end[r], names[r], steps[r])
        for label, r in zip(labels, rows, strict=True)
    ]


def _cpu_lanes(cpu: pd.DataFrame) -> list[Lane]:
    uniques, groups = _split(cpu, ["track", "name", "kind"])
    if not groups:
        return []
    base = lane_label(uniques["name"].to_numpy(object), uniques["kind"].to_numpy(object))
    labels = (
        uniques["track"].to_numpy(object) + " · " + base if uniques["track"].nunique() > 1 else base
    )
    dur = cpu["dur_ns"].to_numpy(np.int64)
    total = np.array([dur[r].sum() for r in groups])
    keep = set(np.argsort(-total, kind="stable")[:_MAX_CPU_LANES].tolist())
    lanes: dict[str, list[np.ndarray]] = {}
    for i, rows in enumerate(groups):
        lanes.setdefault(str(labels[i]) if i in keep else _OTHER_CPU, []).append(rows)

    def rank(label: str) -> tuple[int, str]:
        stem = label.split(" · ")[-1].split("(")[0]
        return (_CPU_ORDER.index(stem) if stem in _CPU_ORDER else len(_CPU_ORDER), label)

    ordered = sorted(lanes, key=rank)
    return _build_lanes(cpu, "cpu", ordered, [np.sort(np.concatenate(lanes[k])) for k in ordered])


def _device_lanes(dev: pd.DataFrame) -> list[Lane]:
    uniques, groups = _split(dev, ["track"])
    labels = uniques["track"].tolist() if groups else []
    order = sorted(range(len(labels)), key=lambda i: labels[i])
    return _build_lanes(dev, "device", [labels[i] for i in order], [groups[i] for i in order])


@dataclass(frozen=True)
class LaneIndex:
    """All lanes of one trace, top to bottom, and the trace's time origin ``t0_ns``."""

    lanes: tuple[Lane, ...]
    t0_ns: int
    end_ns: int

    @classmethod
    def from_frames(cls, slices: pd.DataFrame, bubbles: pd.DataFrame) -> LaneIndex:
        """Lanes from the ``slices`` frame (``role``, ``track``, ``name``, ``kind``, ``ts_ns``,
        ``end_ns``, ``dur_ns``, ``step``) and the analysis' ``bubbles`` table (``start_ns``,
        ``end_ns``, ``blame``)."""
        role = slices["role"].to_numpy(object)
        cpu = slices[(role == "cpu") & ~slices["name"].isin(_ENVELOPES).to_numpy(bool)]
        dev = slices[(role == "compute") | (role == "copy")]
        lanes = _cpu_lanes(cpu) + _device_lanes(dev)
        if len(bubbles):
            lanes.append(
                Lane.build(
                    IDLE_LANE,
                    "idle",
                    bubbles["start_ns"].to_numpy(np.int64),
                    bubbles["end_ns"].to_numpy(np.int64),
                    bubbles["blame"].to_numpy(object),
                    np.full(len(bubbles), -1, dtype=np.int64),
                )
            )
        drawn = pd.concat([cpu, dev])
        t0 = int(drawn["ts_ns"].min()) if len(drawn) else 0
        end = int(drawn["end_ns"].max()) if len(drawn) else 0
        return cls(tuple(lanes), t0, end)

    @property
    def labels(self) -> list[str]:
        return [lane.label for lane in self.lanes]

    def count_upper_bound(self, lo_ns: int, hi_ns: int) -> int:
        """An upper bound on the slices visible in ``[lo_ns, hi_ns)`` over all lanes."""
        return sum(lane.count_upper_bound(lo_ns, hi_ns) for lane in self.lanes)

    def clamp(self, lo_ns: int | None, hi_ns: int | None) -> tuple[int, int]:
        """A non-empty window inside the trace (``None`` = the trace's edge)."""
        lo = self.t0_ns if lo_ns is None else max(int(lo_ns), self.t0_ns)
        hi = self.end_ns if hi_ns is None else min(int(hi_ns), self.end_ns)
        return (lo, hi) if hi > lo else (self.t0_ns, max(self.end_ns, self.t0_ns + 1))
