"""CPU lead: how far the host runs ahead of the device, per device stage (docs/design.md §4).

Each device stage slice (``gpu:<i> compute`` / ``copy``) carries ``host_end_ns``: the host time at
which the CPU recorded the stage's end event. The slice ends when the stream reached that event,
on the same host clock. So

    lead = slice end - host_end_ns

is how long the device still had queued work once the host had finished enqueueing the stage.
A large lead: the CPU runs ahead. A lead near zero: the device reached the end event as soon as
it was recorded, i.e. it had run dry and was waiting for the host inside the stage (*starved*);
the slice then holds launch gaps, not only work.

A lead below zero is impossible (the stream cannot reach an event before the host records it),
so negative leads mean the device timeline's clock mapping is early: on the H200 the start-up
calibration put every stage ~35-45 µs early (the GPU wakes from idle more slowly than it runs
steady-state launches). :func:`clock_correction_ns` takes that offset from the trace itself: the
most negative lead (the 1st percentile when there are 100 stages or more, else the minimum),
and every lead is shifted by it; the report states the shift. A trace whose leads are all
non-negative is left as it is (the correction never makes a lead smaller).

A step's lead is the smallest lead among its compute stages (where the device came closest to
catching up with the host); a step is starved when that lead is below ``STARVED_LEAD_NS``
(50 µs: a few kernel launches' worth of queue, above the clock alignment error of the device
timeline, yet far below a decode forward on any GPU).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.frames import ROLE_COMPUTE, ROLE_COPY, require_columns
from instrument.schema import Arg, CopySlice, DeviceSlice

__all__ = [
    "STARVED_LEAD_NS",
    "STAGE_LEAD_COLUMNS",
    "STEP_LEAD_COLUMNS",
    "LEAD_HEADLINE_KEYS",
    "stage_lead",
    "clock_correction_ns",
    "step_lead",
    "lead_headline",
    "lead_by_phase",
    "no_lead_reason",
]

STARVED_LEAD_NS = 50_000
LEAD_HEADLINE_KEYS = ("cpu_lead_us_p50", "cpu_lead_us_p10", "starved_steps_frac")
_STAGES = {s.value for s in DeviceSlice} | {s.value for s in CopySlice}
STAGE_LEAD_COLUMNS = {
    "step": "int64",
    "stage": "object",
    "role": "object",
    "ts_ns": "int64",
    "end_ns": "int64",
    "host_end_ns": "int64",
    "lead_ns": "int64",
    "starved": "bool",
}
STEP_LEAD_COLUMNS = {"step": "int64", "cpu_lead_us": "float64", "starved": "bool"}


def _empty(columns: dict[str, str]) -> pd.DataFrame:
    return pd.DataFrame({k: pd.Series(dtype=v) for k, v in columns.items()})


def stage_lead(slices: pd.DataFrame, threshold_ns: int = STARVED_LEAD_NS) -> pd.DataFrame:
    """One row per device stage slice (compute or copy lane, a stepscope stage name, a step)
    that carries ``host_end_ns``.

    Columns: ``STAGE_LEAD_COLUMNS`` (``stage`` = the slice name, ``role`` = ``compute``/``copy``,
    ``lead_ns`` = end_ns - host_end_ns, ``starved`` = lead_ns < threshold_ns), in time order;
    ``end_ns`` includes the clock correction, stored in ``attrs["clock_correction_ns"]``.
    """
    require_columns(slices, ["step", "name", "role", "ts_ns", "end_ns"], "stage_lead")
    key = Arg.HOST_END_NS.value
    if key not in slices.columns:
        return _empty(STAGE_LEAD_COLUMNS)
    host_end = slices[key].astype("float64").to_numpy(np.float64, na_value=np.nan)
    role = slices["role"].to_numpy(object)
    keep = (
        np.isfinite(host_end)
        & ((role == ROLE_COMPUTE) | (role == ROLE_COPY))
        & slices["name"].isin(_STAGES).to_numpy(bool)
        & (slices["step"].to_numpy(np.int64) >= 0)
    )
    rows = slices[keep]
    host = host_end[keep].astype(np.int64)
    end = rows["end_ns"].to_numpy(np.int64)
    correction = clock_correction_ns(end - host)
    end = end + correction
    out = pd.DataFrame(
        {
            "step": rows["step"].to_numpy(np.int64),
            "stage": rows["name"].to_numpy(object),
            "role": role[keep],
            "ts_ns": rows["ts_ns"].to_numpy(np.int64),
            "end_ns": end,
            "host_end_ns": host,
            "lead_ns": end - host,
            "starved": (end - host) < threshold_ns,
        }
    )
    for key in (Arg.GRAPH_REPLAY.value, Arg.GRAPH_STAMPED.value):
        if key in rows.columns:  # optional: which stages replayed a CUDA graph, stamped
            out[key] = rows[key].to_numpy(object)
    out = out.sort_values("ts_ns", kind="stable").reset_index(drop=True).astype(STAGE_LEAD_COLUMNS)
    out.attrs["clock_correction_ns"] = correction
    return out


def clock_correction_ns(raw_lead_ns: np.ndarray) -> int:
    """How much later the device times must be for no lead to be negative (0 when none is):
    minus the 1st percentile of the raw leads with 100 or more stages, minus the minimum below."""
    if raw_lead_ns.size == 0:
        return 0
    low = np.quantile(raw_lead_ns, 0.01) if raw_lead_ns.size >= 100 else raw_lead_ns.min()
    return int(max(0, -int(low)))


def step_lead(stages: pd.DataFrame, threshold_ns: int = STARVED_LEAD_NS) -> pd.DataFrame:
    """Per step: ``cpu_lead_us`` (smallest lead of its compute stages), ``starved`` (below
    ``threshold_ns``), and one ``cpu_lead_<stage>_us`` column per compute stage present (its
    smallest lead in the step). Steps without a compute stage lead are absent."""
    comp = stages[stages["role"] == ROLE_COMPUTE]
    if comp.empty:
        return _empty(STEP_LEAD_COLUMNS)
    lead = comp.groupby("step")["lead_ns"].min()
    out = pd.DataFrame(
        {
            "step": lead.index.to_numpy(np.int64),
            "cpu_lead_us": lead.to_numpy(np.float64) / 1e3,
            "starved": lead.to_numpy(np.int64) < threshold_ns,
        }
    )
    per_stage = comp.pivot_table(index="step", columns="stage", values="lead_ns", aggfunc="min")
    per_stage = (per_stage / 1e3).add_prefix("cpu_lead_").add_suffix("_us")
    ordered = [
        f"cpu_lead_{s.value}_us" for s in DeviceSlice if f"cpu_lead_{s.value}_us" in per_stage
    ]
    out = out.merge(per_stage[ordered].reset_index(), on="step", how="left")
    return out.astype(STEP_LEAD_COLUMNS)


def _quantile(values: pd.Series, q: float) -> float | None:
    return float(values.quantile(q)) if len(values) else None


def lead_headline(steps: pd.DataFrame) -> dict[str, float | None]:
    """``cpu_lead_us_p50``/``cpu_lead_us_p10`` (over steps' leads) and ``starved_steps_frac``;
    all None without lead data. ``steps`` needs ``cpu_lead_us`` and ``starved``."""
    lead = steps["cpu_lead_us"].dropna() if "cpu_lead_us" in steps.columns else pd.Series()
    if lead.empty:
        return dict.fromkeys(LEAD_HEADLINE_KEYS)
    starved = steps.loc[lead.index, "starved"].astype(bool)
    return {
        "cpu_lead_us_p50": _quantile(lead, 0.5),
        "cpu_lead_us_p10": _quantile(lead, 0.1),
        "starved_steps_frac": float(starved.mean()),
    }


def lead_by_phase(steps: pd.DataFrame) -> pd.DataFrame:
    """Per phase: ``cpu_lead_us_p50``, ``cpu_lead_us_p10``, ``starved_steps_frac`` (NaN for a
    phase without lead data). ``steps``: a step table with ``phase``, ``cpu_lead_us``,
    ``starved``."""
    cols = {"phase": "object", **dict.fromkeys(LEAD_HEADLINE_KEYS, "float64")}
    if "cpu_lead_us" not in steps.columns or steps.empty:
        return _empty(cols)
    rows = []
    for phase, group in steps.groupby("phase", sort=False):
        head = lead_headline(group)
        rows.append({"phase": phase, **{k: np.nan if v is None else v for k, v in head.items()}})
    return pd.DataFrame(rows).astype(cols)


def no_lead_reason(slices: pd.DataFrame) -> str:
    """Why a trace has no CPU lead (the empty string when it has one)."""
    if Arg.HOST_END_NS.value not in slices.columns:
        if not (slices["role"] == ROLE_COMPUTE).any():
            return "the trace has no device stage slices"
        return (
            "the device stage slices carry no host_end_ns (a Kineto trace, or one written "
            "before the tracer recorded it), so the CPU lead cannot be measured"
        )
    return ""
