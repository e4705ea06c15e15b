"""Kept runs of a sampled trace: metrics are computed inside runs of consecutive steps only.

A trace written with ``--trace-every N`` (``capture_every`` > 1) keeps runs of consecutive engine
steps and drops the steps between them. Time between two kept runs is not idle (the device ran
the dropped steps), and the first step of a run has no predecessor in the trace, so its
scheduling cannot be paired with the forward it overlapped (docs/design.md §4, "Sampled traces").

Runs are detected from the step numbers themselves (a new run starts wherever the next kept step
is not the previous one plus 1), so traces sampled by any producer, or with steps removed by the
user, are handled the same way; ``capture_run_length`` only documents what the tracer aimed for.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.frames import ROLE_COMPUTE, require_columns
from analysis.intervals import Union, complement, intersect, union

__all__ = [
    "RUN_COLUMNS",
    "kept_runs",
    "run_spans",
    "in_runs",
    "run_first_steps",
    "idle_in_runs",
    "measured_ns",
]

RUN_COLUMNS = {
    "run_id": "int64",
    "first_step": "int64",
    "last_step": "int64",
    "num_steps": "int64",
    "start_ns": "int64",
    "end_ns": "int64",
}


def kept_runs(steps: np.ndarray) -> pd.DataFrame:
    """Runs of consecutive step numbers among ``steps`` (any order, repeats allowed).

    Columns: ``run_id``, ``first_step``, ``last_step``, ``num_steps`` (int64), in step order.
    """
    s = np.unique(np.asarray(steps, dtype=np.int64))
    s = s[s >= 0]
    if s.size == 0:
        return pd.DataFrame({k: pd.Series(dtype="int64") for k in list(RUN_COLUMNS)[:4]})
    new = np.ones(s.size, dtype=bool)
    new[1:] = s[1:] != s[:-1] + 1
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, s.size - 1)
    return pd.DataFrame(
        {
            "run_id": np.arange(first.size, dtype=np.int64),
            "first_step": s[first],
            "last_step": s[last],
            "num_steps": (last - first + 1).astype(np.int64),
        }
    )


def run_spans(slices: pd.DataFrame, window_start_ns: int, window_end_ns: int) -> pd.DataFrame:
    """The kept runs of ``slices`` (one window's slices) and the device span of each.

    A run's span runs from the first start to the last end of the compute slices of its steps,
    clipped to the window; with a single run it is the whole window, so an unsampled trace
    measures exactly what it did before. Columns: ``RUN_COLUMNS``; a run whose steps have no
    compute slice has an empty span (start = end).
    """
    require_columns(slices, ["step", "role", "ts_ns", "end_ns"], "run_spans")
    step = slices["step"].to_numpy(np.int64)
    runs = kept_runs(step)
    if len(runs) <= 1:
        return runs.assign(start_ns=window_start_ns, end_ns=window_end_ns).astype(RUN_COLUMNS)
    compute = (slices["role"] == ROLE_COMPUTE).to_numpy(bool) & (step >= 0)
    c_step = step[compute]
    run_of = np.searchsorted(runs["first_step"].to_numpy(), c_step, side="right") - 1
    ts = pd.Series(slices["ts_ns"].to_numpy(np.int64)[compute]).groupby(run_of).min()
    end = pd.Series(slices["end_ns"].to_numpy(np.int64)[compute]).groupby(run_of).max()
    start_ns = ts.reindex(runs["run_id"]).fillna(window_start_ns).to_numpy(np.int64)
    end_ns = end.reindex(runs["run_id"]).fillna(window_start_ns).to_numpy(np.int64)
    start_ns = np.clip(start_ns, window_start_ns, window_end_ns)
    end_ns = np.clip(np.maximum(end_ns, start_ns), window_start_ns, window_end_ns)
    return runs.assign(start_ns=start_ns, end_ns=end_ns).astype(RUN_COLUMNS)


def in_runs(u: Union, runs: pd.DataFrame) -> Union:
    """The part of union ``u`` inside the runs' spans."""
    spans = union(runs["start_ns"].to_numpy(np.int64), runs["end_ns"].to_numpy(np.int64))
    return intersect(u, spans)


def run_first_steps(runs: pd.DataFrame) -> np.ndarray:
    """First step of every run after the first: steps whose predecessor was dropped."""
    return runs["first_step"].to_numpy(np.int64)[1:]


def idle_in_runs(busy: Union, runs: pd.DataFrame) -> Union:
    """Device idle: the gaps of ``busy`` inside the runs' spans (never between runs)."""
    spans = union(runs["start_ns"].to_numpy(np.int64), runs["end_ns"].to_numpy(np.int64))
    if spans[0].size == 0:
        return spans
    return intersect(complement(busy, int(spans[0][0]), int(spans[1][-1])), spans)


def measured_ns(runs: pd.DataFrame) -> int:
    """Σ run span lengths: the idle-time denominator."""
    return int((runs["end_ns"] - runs["start_ns"]).clip(lower=0).sum())
