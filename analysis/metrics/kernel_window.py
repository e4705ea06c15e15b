"""Kernel data beats stage slices (docs/design.md §4): device busy from CUPTI kernels where a
trace has them.

A Perfetto trace written with ``--trace-kernels A:B`` holds, for engine steps A..B-1, one slice
per CUPTI kernel / memcpy / memset on a ``gpu:<i> kernels`` track (role ``kernel``, args
``stage``, ``step``, ``activity``). The *kernel window* is the device span of those steps: from
the first start to the last end of their stage and kernel slices, per run of consecutive kernel
steps. Inside it device busy B is the union of the compute activity (``activity`` ``kernel`` or
``memset``; ``memcpy`` is copy work, as the Kineto loader files it; a kernel slice without an
``activity`` counts as a kernel); outside it B is the union of compute stage slices (an upper
bound on busy time).
Kineto traces already load their kernels as compute slices, so they need nothing from here.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.frames import ROLE_COMPUTE, ROLE_KERNEL, require_columns
from analysis.intervals import Union, complement, intersect, intersect_measure, union
from analysis.metrics.runs import kept_runs
from instrument.schema import Arg, CaptureArg

ACTIVITY_MEMCPY = "memcpy"

__all__ = [
    "FILL_COLUMNS",
    "kernel_windows",
    "busy_with_kernels",
    "stage_fill",
    "has_kernels",
    "kernel_steps",
    "profiler_breaks",
    "runs_by_source",
    "source_verdict",
]
SOURCE_KERNELS = "kernels"
SOURCE_SLICES = "stage_slices"
SOURCE_MIXED = "kernels_and_stage_slices"

FILL_COLUMNS = {
    "step": "int64",
    "stage": "object",
    "ts_ns": "int64",
    "end_ns": "int64",
    "kernel_ns": "int64",
    "fill": "float64",
}


def _compute_kernels(slices: pd.DataFrame) -> np.ndarray:
    """Mask of kernel-lane slices that are compute work (not memcpy)."""
    kern = (slices["role"] == ROLE_KERNEL).to_numpy(bool)
    if Arg.ACTIVITY.value in slices.columns:
        activity = slices[Arg.ACTIVITY.value].astype(object).to_numpy(object)
        kern = kern & (activity != ACTIVITY_MEMCPY)
    return kern


def has_kernels(slices: pd.DataFrame) -> bool:
    """Whether the trace holds ``gpu:<i> kernels`` slices."""
    return bool((slices["role"] == ROLE_KERNEL).any())


def _spans(slices: pd.DataFrame) -> pd.DataFrame:
    """Per step with kernels: the span of its compute stage and kernel slices."""
    is_kernel = (slices["role"] == ROLE_KERNEL).to_numpy(bool)
    is_compute = (slices["role"] == ROLE_COMPUTE).to_numpy(bool)
    step = slices["step"].to_numpy(np.int64)
    kernel_steps = np.unique(step[is_kernel & (step >= 0)])
    sel = (is_kernel | is_compute) & np.isin(step, kernel_steps)
    df = pd.DataFrame(
        {
            "step": step[sel],
            "ts": slices["ts_ns"].to_numpy(np.int64)[sel],
            "end": slices["end_ns"].to_numpy(np.int64)[sel],
        }
    )
    return df.groupby("step").agg(start_ns=("ts", "min"), end_ns=("end", "max")).reset_index()


def kernel_windows(slices: pd.DataFrame) -> Union:
    """The kernel window(s): one span per run of consecutive steps that have kernel slices
    (empty without kernels)."""
    require_columns(slices, ["role", "step", "ts_ns", "end_ns"], "kernel_windows")
    spans = _spans(slices)
    if spans.empty:
        z = np.zeros(0, np.int64)
        return z, z
    runs = kept_runs(spans["step"].to_numpy())
    run_of = np.searchsorted(runs["first_step"].to_numpy(), spans["step"].to_numpy(), "right") - 1
    by_run = spans.groupby(run_of).agg(start_ns=("start_ns", "min"), end_ns=("end_ns", "max"))
    return union(by_run["start_ns"].to_numpy(np.int64), by_run["end_ns"].to_numpy(np.int64))


def busy_with_kernels(slices: pd.DataFrame) -> tuple[Union, Union]:
    """``(B, windows)``: B = kernel union inside the kernel windows, compute stage slices
    elsewhere; ``windows`` as :func:`kernel_windows`. Without kernels B is the stage union."""
    require_columns(slices, ["role", "step", "ts_ns", "end_ns"], "busy_with_kernels")
    ts, end = slices["ts_ns"].to_numpy(np.int64), slices["end_ns"].to_numpy(np.int64)
    comp = (slices["role"] == ROLE_COMPUTE).to_numpy(bool)
    stage_u = union(ts[comp], end[comp])
    windows = kernel_windows(slices)
    if windows[0].size == 0:
        return stage_u, windows
    kern = _compute_kernels(slices)
    lo = int(min(ts.min(), windows[0][0]))
    hi = int(max(end.max(), windows[1][-1]))
    outside = intersect(stage_u, complement(windows, lo, hi))
    inside = intersect(union(ts[kern], end[kern]), windows)
    return union(
        np.concatenate((outside[0], inside[0])), np.concatenate((outside[1], inside[1]))
    ), windows


def stage_fill(slices: pd.DataFrame) -> pd.DataFrame:
    """Per compute stage slice of a step with kernels: ``kernel_ns`` = |its slice ∩ kernel
    union| and ``fill`` = kernel_ns / slice duration (NaN for an empty slice).

    Columns: ``FILL_COLUMNS``; empty without kernels.
    """
    require_columns(slices, ["role", "name", "step", "ts_ns", "end_ns"], "stage_fill")
    step = slices["step"].to_numpy(np.int64)
    kern = _compute_kernels(slices)
    is_kernel = (slices["role"] == ROLE_KERNEL).to_numpy(bool)
    kernel_steps = np.unique(step[is_kernel & (step >= 0)])
    sel = (slices["role"] == ROLE_COMPUTE).to_numpy(bool) & np.isin(step, kernel_steps)
    if not sel.any():
        return pd.DataFrame({k: pd.Series(dtype=v) for k, v in FILL_COLUMNS.items()})
    ts, end = slices["ts_ns"].to_numpy(np.int64), slices["end_ns"].to_numpy(np.int64)
    k_u = union(ts[kern], end[kern])
    inside = intersect_measure(ts[sel], end[sel], k_u)
    dur = (end[sel] - ts[sel]).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        fill = np.where(dur > 0, inside / dur, np.nan)
    return pd.DataFrame(
        {
            "step": step[sel],
            "stage": slices["name"].to_numpy(object)[sel],
            "ts_ns": ts[sel],
            "end_ns": end[sel],
            "kernel_ns": inside.astype(np.int64),
            "fill": fill,
        }
    ).astype(FILL_COLUMNS)


def kernel_steps(slices: pd.DataFrame, metadata: dict[str, object]) -> tuple[int, int] | None:
    """The kernel window's engine steps ``(A, B)`` (steps A..B-1): ``capture_kernel_steps`` of the
    trace metadata (``CaptureArg.KERNEL_STEPS``, "A:B"), else the steps of the kernel slices;
    None without kernels."""
    text = str(metadata.get(CaptureArg.KERNEL_STEPS.value) or "")
    head, sep, tail = text.partition(":")
    if sep and head.strip().isdigit() and tail.strip().isdigit():
        return int(head), int(tail)
    step = slices["step"].to_numpy(np.int64)[(slices["role"] == ROLE_KERNEL).to_numpy(bool)]
    step = step[step >= 0]
    return (int(step.min()), int(step.max()) + 1) if step.size else None


def profiler_breaks(steps: tuple[int, int] | None) -> tuple[int, ...]:
    """Steps before which the profiler of a kernel window ``(A, B)`` started or stopped: it starts
    just before step A is scheduled and stops once step B-1 is retired, i.e. before step B is
    scheduled (synchronous loop) or step B+1 (batch queue of depth 2: B was already in flight).
    Measuring runs split there leaves the profiler's own pauses out (docs/design.md §5.14.3)."""
    if steps is None:
        return ()
    a, b = steps
    return (a, b, b + 1)


def runs_by_source(runs: pd.DataFrame, idle: Union, windows: Union) -> pd.DataFrame:
    """``runs`` (``analysis.metrics.runs.run_spans``) with ``busy_source`` (``kernels`` when the
    kernel windows cover its measured cycles, ``stage_slices`` when they miss them,
    ``kernels_and_stage_slices`` in between) and ``idle_ns`` (idle inside its cycles)."""
    lo = runs["cycle_start_ns"].to_numpy(np.int64)
    hi = runs["end_ns"].to_numpy(np.int64)
    span = np.maximum(hi - lo, 0)
    covered = intersect_measure(lo, hi, windows) if windows[0].size else np.zeros(len(runs))
    source = np.where(
        covered >= span, SOURCE_KERNELS, np.where(covered <= 0, SOURCE_SLICES, SOURCE_MIXED)
    )
    source = np.where(windows[0].size == 0, SOURCE_SLICES, source).astype(object)
    idle_ns = intersect_measure(lo, hi, idle) if idle[0].size else np.zeros(len(runs))
    return runs.assign(busy_source=source, idle_ns=np.asarray(idle_ns, dtype=np.int64))


def source_verdict(runs: pd.DataFrame, steps: tuple[int, int] | None) -> str:
    """Which steps' idle came from kernels and which from stage slices (with each part's
    bubble ratio), and where the profiler's start/stop split the window; "" without kernels."""
    if steps is None or "busy_source" not in runs.columns:
        return ""
    span = (runs["end_ns"] - runs["cycle_start_ns"]).clip(lower=0)
    parts = []
    for source, what in ((SOURCE_KERNELS, "CUPTI kernels (measured)"), (SOURCE_SLICES, None)):
        mine = runs[(runs["busy_source"] == source) & (span > 0)]
        if mine.empty:
            continue
        total = int(span[mine.index].sum())
        ratio = int(mine["idle_ns"].sum()) / total if total else 0.0
        ranges = ", ".join(
            f"{int(f)}..{int(la)}"
            for f, la in zip(mine["first_step"], mine["last_step"], strict=True)
        )
        what = what or "stage slices (a lower bound on idle)"
        parts.append(f"steps {ranges} from {what}: bubble_ratio {100 * ratio:.1f}%")
    a, b = steps
    text = "Device busy: " + ("; ".join(parts) if parts else "no measured step cycles")
    split = [int(s) for s in runs.loc[runs["split"] == "profiler", "first_step"]]
    events = [f"started before step {a}"] if a in split else []
    stops = [s for s in split if s != a]
    if stops:
        events.append(
            f"stopped after step {b - 1} retired (split before step(s) "
            + ", ".join(str(s) for s in stops)
            + ")"
        )
    if events:
        text += (
            f". The kernel window's profiler (steps {a}..{b - 1}) "
            + " and ".join(events)
            + ": those pauses are left out of the measured time, not counted as engine idle"
        )
    return text + "."
