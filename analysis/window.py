"""The measured window: which steps (and which span of device time) the metrics cover."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from analysis.frames import ROLE_COMPUTE, SLICE_COLUMNS, TraceError, require_columns
from analysis.intervals import Union, union

__all__ = ["Window", "select_window", "device_busy"]


@dataclass(frozen=True)
class Window:
    """Steps ``first_step..last_step`` (``-1`` when the trace has no steps) and the device span.

    ``start_ns``/``end_ns``: first device slice start / last device slice end in the window (the
    idle-time denominator); ``skipped_steps``: warm-up steps left out.
    """

    first_step: int
    last_step: int
    num_steps: int
    skipped_steps: int
    start_ns: int
    end_ns: int

    @property
    def duration_ns(self) -> int:
        return max(self.end_ns - self.start_ns, 0)

    def to_dict(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(asdict(self))
        out["duration_ms"] = self.duration_ns / 1e6
        return out


def device_busy(slices: pd.DataFrame) -> Union:
    """B: the union of slices on device compute tracks (whole trace)."""
    require_columns(slices, ["role", "ts_ns", "end_ns"], "device_busy")
    compute = slices["role"].to_numpy(object) == ROLE_COMPUTE
    return union(
        slices["ts_ns"].to_numpy(np.int64)[compute], slices["end_ns"].to_numpy(np.int64)[compute]
    )


def select_window(slices: pd.DataFrame, skip_steps: int = 1) -> tuple[pd.DataFrame, Window]:
    """Slices of the measured steps, and the window.

    Steps below ``min(step) + skip_steps`` are warm-up (kept only when the trace has no more than
    ``skip_steps`` steps). Slices without a step are kept when they lie inside the window's time
    span. With no steps at all the whole trace is the window. Returns a frame with the input's
    columns.
    """
    require_columns(slices, SLICE_COLUMNS, "select_window")
    if skip_steps < 0:
        raise TraceError(f"skip_steps must be >= 0, got {skip_steps}")
    step = slices["step"].to_numpy(np.int64)
    steps = np.unique(step[step >= 0])
    skip = skip_steps if steps.size > skip_steps else 0
    if steps.size:
        first, last = int(steps[skip]), int(steps[-1])
        stepped = step >= first
        lo = int(slices["ts_ns"].to_numpy(np.int64)[stepped].min())
        hi = int(slices["end_ns"].to_numpy(np.int64)[stepped].max())
        loose = (
            (step < 0)
            & (slices["ts_ns"].to_numpy(np.int64) >= lo)
            & (slices["end_ns"].to_numpy(np.int64) <= hi)
        )
        chosen = slices[stepped | loose]
    else:
        first = last = -1
        chosen = slices
    compute = chosen[chosen["role"] == ROLE_COMPUTE]
    start = int(compute["ts_ns"].min()) if len(compute) else 0
    end = int(compute["end_ns"].max()) if len(compute) else 0
    num = int(((steps >= first) & (steps <= last)).sum()) if steps.size else 0
    return chosen, Window(first, last, num, skip, start, end)
