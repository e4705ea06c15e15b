"""Schedule/forward overlap: how much CPU scheduling is hidden under device work (docs/design.md §5.3)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.frames import require_columns
from analysis.intervals import Union, cumulative_measure, intersect_measure, union, union_grouped
from instrument.schema import CpuSlice

__all__ = ["SCHEDULING_SLICES", "overlap_by_step", "overall_overlap"]

SCHEDULING_SLICES = (CpuSlice.SCHEDULE.value, CpuSlice.PREPARE_INPUTS.value)
OVERLAP_COLUMNS = {"step": "int64", "sched_ns": "int64", "hidden_ns": "int64", "overlap": "float64"}


def _scheduling(slices: pd.DataFrame) -> pd.DataFrame:
    require_columns(slices, ["name", "step", "ts_ns", "end_ns"], "overlap")
    return slices[slices["name"].isin(SCHEDULING_SLICES)]


def overlap_by_step(slices: pd.DataFrame, busy: Union) -> pd.DataFrame:
    """Per step: W_s = union of its ``schedule``/``prepare_inputs`` slices, and |W_s ∩ B| / |W_s|.

    Columns: ``step`` int64, ``sched_ns`` (|W_s|), ``hidden_ns`` (|W_s ∩ B|), ``overlap`` float64
    (NaN when |W_s| = 0).
    """
    w = _scheduling(slices)
    g, s, e = union_grouped(
        w["step"].to_numpy(np.int64), w["ts_ns"].to_numpy(), w["end_ns"].to_numpy()
    )
    hidden = intersect_measure(s, e, busy)
    df = pd.DataFrame({"step": g, "sched_ns": e - s, "hidden_ns": hidden})
    df = df.groupby("step", as_index=False, sort=True).sum()
    df = df.astype({"step": "int64", "sched_ns": "int64", "hidden_ns": "int64"})
    with np.errstate(invalid="ignore", divide="ignore"):
        df["overlap"] = df["hidden_ns"] / df["sched_ns"].replace(0, np.nan)
    return df.astype(OVERLAP_COLUMNS)


def overall_overlap(slices: pd.DataFrame, busy: Union) -> tuple[float, int, int]:
    """``(overlap, |W|, |W ∩ B|)`` over all scheduling slices given (NaN overlap when W is empty)."""
    w = _scheduling(slices)
    u = union(w["ts_ns"].to_numpy(), w["end_ns"].to_numpy())
    total = int((u[1] - u[0]).sum())
    hidden = int((cumulative_measure(busy, u[1]) - cumulative_measure(busy, u[0])).sum())
    return (hidden / total if total else float("nan")), total, hidden
