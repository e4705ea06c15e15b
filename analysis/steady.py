"""The steady-state window: the steps where batch size and step time have settled.

The rule (documented in the README; the defaults are :class:`SteadyRule`'s):

1. Per step take the batch size ``b`` (``num_reqs`` of its ``schedule`` slice) and the step time
   ``t`` (cadence: start of the next step minus this one's, per step when steps were sampled).
2. Smooth both with a centred rolling median over ``smooth`` steps, so one normal-looking step
   inside warm-up does not start the window.
3. The references are the medians over all steps: ``B`` of ``b`` and ``T`` of ``t``.
4. A step is *stable* when ``|b~ - B| <= max(1, batch_tol * B)`` and
   ``T / time_tol <= t~ <= T * time_tol`` (``~`` = smoothed), and its own ``b`` and ``t`` pass the
   same tests (so an edge outlier, which the centred median would smooth away, stays outside;
   the last step has no cadence and is judged on ``t~`` alone).
5. The window runs from the first stable step to the last stable step (steps in between are kept
   even when unstable: a window is contiguous). Warm-up (ramping batch, slow first steps) falls
   before it and cool-down (a draining batch) after it.

A trace without batch sizes (Kineto) uses the step-time test alone. With fewer than
``min_steps`` steps, or fewer than ``min_steps`` stable ones, there is no steady window
(:func:`steady_range` returns None and the caller falls back to all steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis.frames import require_columns
from instrument.schema import Arg

__all__ = ["SteadyRule", "steady_range", "stable_steps"]


@dataclass(frozen=True)
class SteadyRule:
    """Tolerances of the steady-state rule (see the module docstring)."""

    batch_tol: float = 0.25
    time_tol: float = 1.5
    smooth: int = 5
    min_steps: int = 8

    def __post_init__(self) -> None:
        if not 0 <= self.batch_tol < 1:
            raise ValueError(f"batch_tol must be in [0, 1), got {self.batch_tol}")
        if self.time_tol <= 1:
            raise ValueError(f"time_tol must be > 1, got {self.time_tol}")
        if self.smooth < 1 or self.min_steps < 1:
            raise ValueError("smooth and min_steps must be >= 1")


def _smoothed(values: pd.Series, width: int) -> np.ndarray:
    return values.rolling(width, center=True, min_periods=1).median().to_numpy(np.float64)


def stable_steps(steps: pd.DataFrame, rule: SteadyRule = SteadyRule()) -> pd.Series:
    """Boolean per row of a step table (``analysis.steps.step_table``): rule step 4.

    Requires ``step`` and ``step_ns``; uses ``num_reqs`` when present.
    """
    require_columns(steps, ["step", "step_ns"], "stable_steps")
    t = steps["step_ns"].astype("float64")
    t = t.where(t > 0)
    t_ref = float(t.median()) if t.notna().any() else float("nan")
    t_own = t.to_numpy(np.float64)
    ok = _within(_smoothed(t, rule.smooth), t_ref / rule.time_tol, t_ref * rule.time_tol)
    # Own value too, so an edge outlier (a 5x slower first step) is not smoothed into the window;
    # the last step has no cadence and is judged by its neighbours' (the smoothed value) alone.
    ok &= np.isnan(t_own) | _within(t_own, t_ref / rule.time_tol, t_ref * rule.time_tol)
    key = Arg.NUM_REQS.value
    if key in steps.columns and steps[key].notna().any():
        b = steps[key].astype("float64")
        b_ref = float(b.median())
        tol = max(1.0, rule.batch_tol * b_ref)
        ok &= _within(_smoothed(b, rule.smooth), b_ref - tol, b_ref + tol)
        ok &= _within(b.to_numpy(np.float64), b_ref - tol, b_ref + tol)
    return pd.Series(ok, index=steps.index)


def _within(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    return np.isfinite(x) & (x >= lo) & (x <= hi)


def steady_range(steps: pd.DataFrame, rule: SteadyRule = SteadyRule()) -> tuple[int, int] | None:
    """``(first_step, last_step)`` (inclusive) of the steady window, or None (rule step 5)."""
    if len(steps) < rule.min_steps:
        return None
    ok = stable_steps(steps, rule).to_numpy(bool)
    if int(ok.sum()) < rule.min_steps:
        return None
    idx = np.flatnonzero(ok)
    step = steps["step"].to_numpy(np.int64)
    return int(step[idx[0]]), int(step[idx[-1]])
