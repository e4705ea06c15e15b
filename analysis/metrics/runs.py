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
    "SPLIT_FIRST",
    "SPLIT_GAP",
    "SPLIT_PROFILER",
    "kept_runs",
    "run_spans",
    "in_runs",
    "clip_to_runs",
    "idle_in_runs",
    "measured_ns",
    "runs_verdict",
]

RUN_COLUMNS = {
    "run_id": "int64",
    "first_step": "int64",
    "last_step": "int64",
    "num_steps": "int64",
    "start_ns": "int64",
    "end_ns": "int64",
    "cycle_start_ns": "int64",
    "split": "object",
}
# Why a run starts where it does (``split``): the first run, a step missing before it (a sampled
# trace), or a profiler start/stop (a kernel window's edge, ``breaks``).
SPLIT_FIRST = "first"
SPLIT_GAP = "gap"
SPLIT_PROFILER = "profiler"


def kept_runs(steps: np.ndarray, breaks: tuple[int, ...] = ()) -> pd.DataFrame:
    """Runs of consecutive step numbers among ``steps`` (any order, repeats allowed); a step in
    ``breaks`` also starts a new run (a profiler start or stop just before it).

    Columns: ``run_id``, ``first_step``, ``last_step``, ``num_steps`` (int64), ``split``
    (``first``, ``gap`` or ``profiler``: why the run starts there), in step order.
    """
    s = np.unique(np.asarray(steps, dtype=np.int64))
    s = s[s >= 0]
    if s.size == 0:
        cols = ["run_id", "first_step", "last_step", "num_steps"]
        return pd.DataFrame({k: pd.Series(dtype=RUN_COLUMNS[k]) for k in [*cols, "split"]})
    gap = np.zeros(s.size, dtype=bool)
    gap[1:] = s[1:] != s[:-1] + 1
    profiler = np.isin(s, np.asarray(breaks, dtype=np.int64)) & ~gap
    new = gap | profiler
    new[0] = True
    split = np.where(gap, SPLIT_GAP, SPLIT_PROFILER).astype(object)
    split[0] = SPLIT_FIRST
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, s.size - 1)
    return pd.DataFrame(
        {
            "run_id": np.arange(first.size, dtype=np.int64),
            "first_step": s[first],
            "last_step": s[last],
            "num_steps": (last - first + 1).astype(np.int64),
            "split": split[first],
        }
    )


def run_spans(
    slices: pd.DataFrame, window_start_ns: int, window_end_ns: int, breaks: tuple[int, ...] = ()
) -> pd.DataFrame:
    """The kept runs of ``slices`` (one window's slices) and the device span of each; a step in
    ``breaks`` starts a new run (``analysis.metrics.kernel_window.profiler_breaks``).

    A run's span (``start_ns``..``end_ns``) runs from the first start to the last end of the
    compute slices of its steps, clipped to the window; scheduling is paired with device work
    inside it. Idle is measured over its *cycles* (``cycle_start_ns``..``end_ns``): from the end
    of the run's first step's device work, so each measured step brings its own device work and
    the gap before it, as every step but the first does in a full trace; a run of L steps then
    measures L - 1 step cycles whatever L is (no bias towards longer or shorter runs), and a
    one-step run measures nothing. With a single run both spans are the whole window, so an
    unsampled trace measures exactly what it did before. Columns: ``RUN_COLUMNS``; a run whose
    steps have no compute slice has empty spans.
    """
    require_columns(slices, ["step", "role", "ts_ns", "end_ns"], "run_spans")
    step = slices["step"].to_numpy(np.int64)
    runs = kept_runs(step, breaks)
    if len(runs) == 0:  # no step numbers (a stepless Kineto window): one run, the window
        runs = pd.DataFrame(
            {
                "run_id": [0],
                "first_step": [-1],
                "last_step": [-1],
                "num_steps": [0],
                "split": [SPLIT_FIRST],
            }
        )
    if len(runs) <= 1:
        return runs.assign(
            start_ns=window_start_ns, end_ns=window_end_ns, cycle_start_ns=window_start_ns
        ).astype(RUN_COLUMNS)
    compute = (slices["role"] == ROLE_COMPUTE).to_numpy(bool) & (step >= 0)
    c_step = step[compute]
    run_of = np.searchsorted(runs["first_step"].to_numpy(), c_step, side="right") - 1
    ts = pd.Series(slices["ts_ns"].to_numpy(np.int64)[compute]).groupby(run_of).min()
    end = pd.Series(slices["end_ns"].to_numpy(np.int64)[compute]).groupby(run_of).max()
    start_ns = ts.reindex(runs["run_id"]).fillna(window_start_ns).to_numpy(np.int64)
    end_ns = end.reindex(runs["run_id"]).fillna(window_start_ns).to_numpy(np.int64)
    start_ns = np.clip(start_ns, window_start_ns, window_end_ns)
    end_ns = np.clip(np.maximum(end_ns, start_ns), window_start_ns, window_end_ns)
    is_first = c_step == runs["first_step"].to_numpy(np.int64)[np.maximum(run_of, 0)]
    first_end = pd.Series(slices["end_ns"].to_numpy(np.int64)[compute][is_first])
    first_end = first_end.groupby(run_of[is_first]).max().reindex(runs["run_id"])
    cycle = np.clip(first_end.fillna(window_start_ns).to_numpy(np.int64), start_ns, end_ns)
    return runs.assign(start_ns=start_ns, end_ns=end_ns, cycle_start_ns=cycle).astype(RUN_COLUMNS)


def in_runs(u: Union, runs: pd.DataFrame) -> Union:
    """The part of union ``u`` inside the runs' spans."""
    spans = union(runs["start_ns"].to_numpy(np.int64), runs["end_ns"].to_numpy(np.int64))
    return intersect(u, spans)


def clip_to_runs(slices: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """Slices of a sampled trace (more than one run) cut to their own run's device span.

    A run's first step was scheduled while a dropped step's forward ran: that scheduling time
    lies before the run's span and is left out, never paired with another run's work. Slices
    without a step, and every slice of a single-run trace, are returned unchanged; slices left
    empty are dropped.
    """
    if len(runs) <= 1:
        return slices
    step = slices["step"].to_numpy(np.int64)
    first = runs["first_step"].to_numpy(np.int64)
    run_of = np.searchsorted(first, step, side="right") - 1
    in_run = (step >= 0) & (run_of >= 0)
    in_run &= step <= runs["last_step"].to_numpy(np.int64)[np.maximum(run_of, 0)]
    lo = runs["start_ns"].to_numpy(np.int64)[np.maximum(run_of, 0)]
    hi = runs["end_ns"].to_numpy(np.int64)[np.maximum(run_of, 0)]
    ts = slices["ts_ns"].to_numpy(np.int64)
    end = slices["end_ns"].to_numpy(np.int64)
    new_ts = np.where(in_run, np.clip(ts, lo, hi), ts)
    new_end = np.where(in_run, np.clip(end, lo, hi), end)
    out = slices.assign(ts_ns=new_ts, end_ns=new_end, dur_ns=new_end - new_ts)
    return out[(new_end > new_ts) | ~in_run]


def idle_in_runs(busy: Union, runs: pd.DataFrame) -> Union:
    """Device idle: the gaps of ``busy`` inside the runs' cycles (never between runs)."""
    spans = union(runs["cycle_start_ns"].to_numpy(np.int64), runs["end_ns"].to_numpy(np.int64))
    if spans[0].size == 0:
        return spans
    return intersect(complement(busy, int(spans[0][0]), int(spans[1][-1])), spans)


def measured_ns(runs: pd.DataFrame) -> int:
    """Σ run cycle lengths: the idle-time denominator."""
    return int((runs["end_ns"] - runs["cycle_start_ns"]).clip(lower=0).sum())


def runs_verdict(runs: pd.DataFrame) -> str:
    """A sentence for a sampled trace (a run that starts after missing steps); "" otherwise."""
    if len(runs) <= 1 or not (runs["split"] == SPLIT_GAP).any():
        return ""
    lengths = runs["num_steps"].to_numpy(np.int64)
    text = (
        f"Sampled trace: measured inside {len(runs)} runs of consecutive kept steps "
        f"({int(lengths.min())}-{int(lengths.max())} steps each); the time between runs is not "
        "counted as idle and no step is paired with another run's work"
    )
    if lengths.max() < 2:
        text += "; runs of one step measure neither overlap nor idle (keep runs of >= 2 steps)"
    return text + "."
