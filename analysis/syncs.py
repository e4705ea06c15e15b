"""Host-device synchronisation summary (docs/design.md §5.8): counts by op and site."""

from __future__ import annotations

import pandas as pd

from analysis.frames import SYNC_COLUMNS, require_columns

__all__ = ["sync_summary", "hot_sync_count"]

SUMMARY_COLUMNS = {"op": "object", "where": "object", "count": "int64", "hot_after_warmup": "int64"}


def sync_summary(syncs: pd.DataFrame, warmup_end_ns: int) -> pd.DataFrame:
    """Columns: ``op``, ``where``, ``count``, ``hot_after_warmup`` (``hot=True`` syncs at or after
    ``warmup_end_ns``: defects), most frequent first."""
    require_columns(syncs, SYNC_COLUMNS, "sync_summary")
    if syncs.empty:
        return pd.DataFrame({k: pd.Series(dtype=v) for k, v in SUMMARY_COLUMNS.items()})
    flagged = syncs.assign(hot_after_warmup=syncs["hot"] & (syncs["ts_ns"] >= warmup_end_ns))
    table = flagged.groupby(["op", "where"], as_index=False).agg(
        count=("ts_ns", "size"), hot_after_warmup=("hot_after_warmup", "sum")
    )
    table = table.sort_values(["hot_after_warmup", "count"], ascending=False, kind="stable")
    return table.reset_index(drop=True).astype(SUMMARY_COLUMNS)


def hot_sync_count(summary: pd.DataFrame) -> int:
    """Number of hot-path syncs after warm-up."""
    require_columns(summary, SUMMARY_COLUMNS, "hot_sync_count")
    return int(summary["hot_after_warmup"].sum())
