"""Accepted-count wait exposure (docs/design.md §5.5): exposed = |A ∩ idle|, hidden = |A ∩ B|."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.frames import require_columns
from analysis.intervals import Union, intersect_measure, union_grouped
from instrument.schema import CpuSlice, WaitKind

__all__ = ["WAIT_COLUMNS", "accepted_wait_by_step"]

WAIT_COLUMNS = {"step": "int64", "wait_ns": "int64", "exposed_ns": "int64", "hidden_ns": "int64"}


def accepted_wait_by_step(slices: pd.DataFrame, busy: Union, idle: Union) -> pd.DataFrame:
    """Per step, A_s = union of ``wait_output`` slices with kind ``accepted_count``.

    Columns: ``step``, ``wait_ns`` (|A_s|), ``exposed_ns`` (|A_s ∩ idle|: the device idled while
    the CPU waited, recoverable), ``hidden_ns`` (|A_s ∩ B|: the device was busy, no loss). Time
    outside the device window counts in ``wait_ns`` only.
    """
    require_columns(slices, ["name", "kind", "step", "ts_ns", "end_ns"], "accepted_wait_by_step")
    a = slices[
        (slices["name"] == CpuSlice.WAIT_OUTPUT.value)
        & (slices["kind"] == WaitKind.ACCEPTED_COUNT.value)
    ]
    g, s, e = union_grouped(
        a["step"].to_numpy(np.int64), a["ts_ns"].to_numpy(), a["end_ns"].to_numpy()
    )
    df = pd.DataFrame(
        {
            "step": g,
            "wait_ns": e - s,
            "exposed_ns": intersect_measure(s, e, idle),
            "hidden_ns": intersect_measure(s, e, busy),
        }
    )
    return df.groupby("step", as_index=False, sort=True).sum().astype(WAIT_COLUMNS)
