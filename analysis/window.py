"""The measured window: which steps (and which span of device time) the metrics cover."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from analysis.frames import ROLE_COMPUTE, ROLE_COPY, SLICE_COLUMNS, TraceError, require_columns
from analysis.intervals import Union, union, unique_sorted
from analysis.steady import steady_range

__all__ = ["Window", "select_window", "device_busy", "parse_window", "WINDOW_ALL", "WINDOW_STEADY"]


WINDOW_ALL = "all"
WINDOW_STEADY = "steady"


@dataclass(frozen=True)
class Window:
    """Steps ``first_step..last_step`` (``-1`` when the trace has no steps) and the device span.

    ``start_ns``/``end_ns``: first device slice start / last device slice end in the window (the
    idle-time denominator); ``skipped_steps``: steps of the trace left out before the window;
    ``rule``: how it was chosen (``all``, ``steady``, ``steps``); ``note``: why a requested rule
    fell back (empty when it did not).
    """

    first_step: int
    last_step: int
    num_steps: int
    skipped_steps: int
    start_ns: int
    end_ns: int
    rule: str = WINDOW_ALL
    note: str = ""

    @property
    def duration_ns(self) -> int:
        return max(self.end_ns - self.start_ns, 0)

    def to_dict(self) -> dict[str, int | float | str]:
        out: dict[str, int | float | str] = dict(asdict(self))
        out["duration_ms"] = self.duration_ns / 1e6
        return out


def parse_window(text: str) -> tuple[str, int, int | None]:
    """``all`` / ``steady`` / ``A:B`` (steps A..B-1, like a Python slice; ``A:`` = to the end)
    -> ``(rule, first, end)``. Raises :class:`TraceError` for anything else."""
    if text in (WINDOW_ALL, WINDOW_STEADY):
        return text, 0, None
    head, sep, tail = text.partition(":")
    try:
        first = int(head) if head.strip() else 0
        end = int(tail) if tail.strip() else None
    except ValueError:
        first, end, sep = -1, None, ""
    if not sep or first < 0 or (end is not None and end <= first):
        raise TraceError(f"--window must be all, steady or A:B with 0 <= A < B, got {text!r}")
    return "steps", first, end


def device_busy(slices: pd.DataFrame, with_copies: bool = False) -> Union:
    """B: the union of slices on device compute tracks (whole trace); with ``with_copies``,
    copy tracks too (the complement is then *device idle*: no kernel and no copy)."""
    require_columns(slices, ["role", "ts_ns", "end_ns"], "device_busy")
    roles = [ROLE_COMPUTE, ROLE_COPY] if with_copies else [ROLE_COMPUTE]
    busy = slices["role"].isin(roles).to_numpy(bool)
    return union(
        slices["ts_ns"].to_numpy(np.int64)[busy], slices["end_ns"].to_numpy(np.int64)[busy]
    )


MIN_STEPS_AFTER_SKIP = 2


def _warmup_skip(steps: np.ndarray, skip_steps: int, compute_steps: np.ndarray) -> tuple[int, str]:
    """How many leading steps to leave out as warm-up, and a note when fewer than asked.

    Warm-up is skipped only when ``MIN_STEPS_AFTER_SKIP`` steps remain and, if the skipped steps
    hold device compute, the remaining ones do too (a two-step profile keeps its work)."""
    if skip_steps == 0:
        return 0, ""
    kept = steps[skip_steps:]
    if kept.size < MIN_STEPS_AFTER_SKIP:
        return 0, (
            f"only {steps.size} step(s): the {skip_steps} warm-up step(s) were not skipped "
            f"(skipped only when {MIN_STEPS_AFTER_SKIP} steps remain)"
        )
    if np.isin(steps[:skip_steps], compute_steps).any() and not np.isin(kept, compute_steps).any():
        return 0, (
            f"the warm-up step(s) {steps[0]}..{steps[skip_steps - 1]} hold the only device "
            "compute of the trace: not skipped"
        )
    return skip_steps, ""


def _step_bounds(
    steps: np.ndarray,
    window: str,
    skip_steps: int,
    step_table: pd.DataFrame | None,
    compute_steps: np.ndarray,
) -> tuple[int, int, str, str]:
    """(first, last, rule, note) for the trace's sorted distinct ``steps``."""
    rule, first, end = parse_window(window)
    if rule == "steps":
        last = steps[-1] if end is None else end - 1
        inside = steps[(steps >= first) & (steps <= last)]
        if inside.size:
            return int(inside[0]), int(inside[-1]), rule, ""
        note = f"no step in {window} (the trace has steps {steps[0]}..{steps[-1]})"
        raise TraceError(note)
    notes = []
    if rule == WINDOW_STEADY:
        found = steady_range(step_table) if step_table is not None and len(step_table) else None
        if found is not None:
            return found[0], found[1], rule, ""
        notes.append("no steady state found (too few or too unstable steps): all steps used")
    skip, note = _warmup_skip(steps, skip_steps, compute_steps)
    notes += [note] if note else []
    return int(steps[skip]), int(steps[-1]), WINDOW_ALL, "; ".join(notes)


def select_window(
    slices: pd.DataFrame,
    skip_steps: int = 1,
    window: str = WINDOW_ALL,
    step_table: pd.DataFrame | None = None,
) -> tuple[pd.DataFrame, Window]:
    """Slices of the measured steps, and the window.

    ``window``: ``all`` (steps below ``min(step) + skip_steps`` are warm-up, skipped only when
    ``MIN_STEPS_AFTER_SKIP`` steps remain and the device work is not all in them; the note
    says so), ``steady`` (the rule of ``analysis.steady``,
    on ``step_table`` = ``step_table(slices)``; falls back to ``all`` with a note) or ``A:B``.
    Slices without a step are kept when they lie inside the window's time span. With no steps at
    all the whole trace is the window. Returns a frame with the input's columns.
    """
    require_columns(slices, SLICE_COLUMNS, "select_window")
    if skip_steps < 0:
        raise TraceError(f"skip_steps must be >= 0, got {skip_steps}")
    step = slices["step"].to_numpy(np.int64)
    steps = unique_sorted(step[step >= 0])
    rule, note = WINDOW_ALL, ""
    if steps.size:
        compute_steps = unique_sorted(step[(slices["role"] == ROLE_COMPUTE).to_numpy(bool)])
        first, last, rule, note = _step_bounds(steps, window, skip_steps, step_table, compute_steps)
        stepped = (step >= first) & (step <= last)
        ts, ends = slices["ts_ns"].to_numpy(np.int64), slices["end_ns"].to_numpy(np.int64)
        lo, hi = int(ts[stepped].min()), int(ends[stepped].max())
        chosen = slices[stepped | ((step < 0) & (ts >= lo) & (ends <= hi))]
    else:
        first = last = -1
        chosen = slices
    compute = chosen[(chosen["role"] == ROLE_COMPUTE).to_numpy(bool)]
    start = int(compute["ts_ns"].min()) if len(compute) else 0
    end = int(compute["end_ns"].max()) if len(compute) else 0
    num = int(((steps >= first) & (steps <= last)).sum()) if steps.size else 0
    skipped = int((steps < first).sum()) if steps.size else 0
    return chosen, Window(first, last, num, skipped, start, end, rule, note)
