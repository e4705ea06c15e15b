"""The diagnosis of a tensor-parallel run: one report per rank, merged into rank tables.

``analyze_ranks(paths)`` is what ``stepscope analyze`` runs when given several traces or a
directory of ``*.rank<i>.pftrace`` files (and what a dashboard would call for a rank set).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from analysis.intervals import intersect_measure, union
from analysis.loading.load import DEFAULT_MAX_DECOMPRESSED_MB
from analysis.metrics.latency import percentiles
from analysis.metrics_registry import RANK_METRICS
from analysis.ranks.rank_set import (
    RankSet,
    collective_table,
    forward_table,
    load_rank_set,
    straggler_table,
)
from analysis.report import Report, _clean, _records, build_report
from instrument.schema import Arg, DeviceSlice, ParallelSlice

__all__ = ["RankReport", "analyze_ranks", "rank_summary"]


@dataclass
class RankReport:
    """``reports``: each rank's own :class:`Report`; ``tables``: ``ranks`` (one row per rank, see
    :func:`rank_summary`), ``stragglers`` and ``collectives`` (``analysis.ranks.rank_set``) over rank 0's
    window; ``headline``: ``world_size``, ``overlap`` / ``bubble_ratio`` / ``all_reduce_wait_us``
    by rank, ``straggler_share`` by rank, ``end_spread_us`` percentiles, ``window``."""

    ranks: RankSet
    reports: dict[int, Report]
    tables: dict[str, pd.DataFrame]
    headline: dict[str, Any]
    verdicts: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: headline, verdicts, notes, rank tables, each rank's headline."""
        return {
            **_clean(self.headline),
            "verdicts": self.verdicts,
            "notes": self.ranks.notes,
            "tables": {k: _records(v) for k, v in self.tables.items()},
            "per_rank": {str(r): rep.to_dict(False) for r, rep in self.reports.items()},
        }


def analyze_ranks(
    paths: list[str],
    profile: str | None = None,
    skip_steps: int = 1,
    window: str = "steady",
    max_decompressed_mb: float = DEFAULT_MAX_DECOMPRESSED_MB,
) -> RankReport:
    """Load a rank set (files and/or directories) and merge the per-rank reports."""
    ranks = load_rank_set(paths, profile, max_decompressed_mb)
    reports = {r: build_report(f, profile, skip_steps, window) for r, f in ranks.frames.items()}
    lead = reports[min(reports)].headline["window"]
    first, last = int(lead["first_step"]), int(lead["last_step"])
    forwards = forward_table(ranks)
    forwards = forwards[(forwards["step"] >= first) & (forwards["step"] <= last)]
    stragglers = straggler_table(forwards)
    collectives = collective_table(ranks, forwards)
    summary = rank_summary(ranks, reports, stragglers, collectives, forwards)
    values = {
        "world_size": ranks.world_size,
        "same_host": ranks.same_host,
        "window": lead,
        "overlap": dict(zip(summary["rank"], summary["overlap"], strict=True)),
        "bubble_ratio": dict(zip(summary["rank"], summary["bubble_ratio"], strict=True)),
        "all_reduce_wait_us": dict(
            zip(summary["rank"], summary["all_reduce_wait_ms"] * 1e3, strict=True)
        ),
        "straggler_share": dict(zip(summary["rank"], summary["straggler_share"], strict=True)),
        "end_spread_us": percentiles(stragglers["end_spread_ns"] / 1e3),
    }
    # The registry owns the keys and their order (docs/design.md §5.13).
    headline = {m.key: values.pop(m.key) for m in RANK_METRICS}
    assert not values, f"rank headline keys missing from RANK_METRICS: {sorted(values)}"
    tables = {"ranks": summary, "stragglers": stragglers, "collectives": collectives}
    return RankReport(ranks, reports, tables, headline, _verdicts(summary, stragglers))


def rank_summary(
    ranks: RankSet,
    reports: dict[int, Report],
    stragglers: pd.DataFrame,
    collectives: pd.DataFrame,
    forwards: pd.DataFrame,
) -> pd.DataFrame:
    """One row per rank: ``rank``, ``host``, ``clock_offset_us``, ``overlap``, ``bubble_ratio``,
    ``top_blame``, ``forward_ms`` (summed forward time), ``collective_ms`` (host-timed collectives),
    ``arrival_wait_ms``, ``all_reduce_wait_ms`` (the two waits summed), ``straggler_steps`` and
    ``straggler_share``, ``broadcast_idle_ms`` (device idle while the engine thread waited in
    ``broadcast_step``: a worker waiting for rank 0's next step, or rank 0 sending it)."""
    rows = []
    num_steps = max(len(stragglers), 1)
    for rank, rep in sorted(reports.items()):
        meta = ranks.frames[rank].metadata
        coll = collectives[collectives["rank"] == rank]
        fw = forwards[forwards["rank"] == rank]
        top = rep.headline["top_blame"]
        n_straggler = int((stragglers["straggler_rank"] == rank).sum())
        rows.append(
            {
                "rank": rank,
                "host": str(meta.get("host", "")),
                "clock_offset_us": int(meta.get(Arg.CLOCK_OFFSET_NS.value, 0) or 0) / 1e3,
                "overlap": rep.headline["overlap"],
                "bubble_ratio": rep.headline["bubble_ratio"],
                "top_blame": top["label"] if top else "",
                "forward_ms": int((fw["end_ns"] - fw["start_ns"]).sum()) / 1e6,
                "collective_ms": int(coll["collective_ns"].sum()) / 1e6,
                "arrival_wait_ms": int(coll["arrival_wait_ns"].sum()) / 1e6,
                "straggler_steps": n_straggler,
                "straggler_share": n_straggler / num_steps if len(stragglers) else float("nan"),
                "broadcast_idle_ms": _broadcast_idle_ns(rep) / 1e6,
            }
        )
    df = pd.DataFrame(rows)
    df["all_reduce_wait_ms"] = df["collective_ms"] + df["arrival_wait_ms"]
    return df.astype({"rank": "int64", "overlap": "float64", "bubble_ratio": "float64"})


def _broadcast_idle_ns(report: Report) -> int:
    """|broadcast_step slices ∩ device idle| within the report's window."""
    s, bubbles = report.frames.slices, report.tables["bubbles"]
    b = s[s["name"] == ParallelSlice.BROADCAST_STEP.value]
    if b.empty or bubbles.empty:
        return 0
    idle = union(bubbles["start_ns"].to_numpy(np.int64), bubbles["end_ns"].to_numpy(np.int64))
    starts, ends = b["ts_ns"].to_numpy(np.int64), b["end_ns"].to_numpy(np.int64)
    return int(intersect_measure(starts, ends, idle).sum())


def _verdicts(summary: pd.DataFrame, stragglers: pd.DataFrame) -> list[str]:
    """Plain sentences: who holds the steps back, and what the ranks wait for."""
    out = []
    if len(stragglers):
        worst = summary.sort_values("straggler_steps", ascending=False).iloc[0]
        spread = stragglers["end_spread_ns"].median() / 1e3
        out.append(
            f"rank {int(worst['rank'])} is the straggler (its {DeviceSlice.FORWARD.value} ends "
            f"last) in {worst['straggler_share']:.0%} of {len(stragglers)} steps; forward ends "
            f"spread {spread:.0f} us (median)."
        )
    else:
        out.append("no step has a forward on every rank: no straggler table.")
    for row in summary.itertuples():
        wait = float(row.all_reduce_wait_ms)
        share = wait / row.forward_ms if row.forward_ms else float("nan")
        out.append(
            f"rank {row.rank}: overlap {row.overlap:.2f}, bubbles {row.bubble_ratio:.1%} of the "
            f"window, collective wait {wait:.2f} ms ({share:.0%} of its forward time), "
            f"{row.broadcast_idle_ms:.2f} ms idle in {ParallelSlice.BROADCAST_STEP.value}."
        )
    return out
