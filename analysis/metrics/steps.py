"""The per-step table: CPU phase times, device busy time, batch sizes, cadence."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.frames import ROLE_COMPUTE, ROLE_CPU, require_columns
from analysis.intervals import union_grouped
from analysis.metrics.phases import step_phase
from instrument.schema import Arg, CpuSlice

__all__ = ["step_table", "STEP_BASE_COLUMNS"]

STEP_BASE_COLUMNS = {
    "step": "int64",
    "start_ns": "int64",
    "end_ns": "int64",
    "step_ns": "float64",
    "device_busy_ns": "int64",
}
_PHASES = [s.value for s in CpuSlice if s is not CpuSlice.STEP]
_SUMS = [
    Arg.NUM_TOKENS.value,
    Arg.NUM_REQS.value,
    Arg.NUM_ACCEPTED.value,
    Arg.NUM_SPEC_TOKENS.value,
    Arg.NUM_PREFILL.value,
    Arg.NUM_DECODE.value,
]


def step_table(slices: pd.DataFrame) -> pd.DataFrame:
    """One row per step.

    Columns: ``step``; ``start_ns``/``end_ns`` (first start / last end of the step's slices);
    ``step_ns`` (cadence: next step's start minus this one's, divided by the step-number gap
    so a sampled trace still gives per-step time; NaN for the last); one
    ``<phase>_ns`` column per CPU phase (summed ``schedule``, ``prepare_inputs``, ``launch``,
    ``wait_output``, ``update_from_output``, ``grammar_mask``); ``device_busy_ns`` (union of the
    step's compute slices); and ``num_tokens``, ``num_reqs``, ``num_accepted``,
    ``num_spec_tokens``, ``num_prefill``, ``num_decode`` when the trace carries them (summed
    over the step's slices); ``phase`` (``analysis.metrics.phases.step_phase``).
    """
    require_columns(slices, ["step", "name", "role", "ts_ns", "end_ns", "dur_ns"], "step_table")
    # Narrow first: one boolean take over the few columns used, not over every argument column.
    used = ["step", "name", "role", "ts_ns", "end_ns", "dur_ns"]
    used += [c for c in _SUMS if c in slices.columns]
    stepped = slices[used][slices["step"].to_numpy() >= 0]
    if stepped.empty:
        cols = {**STEP_BASE_COLUMNS, **{f"{p}_ns": "int64" for p in _PHASES}, "phase": "object"}
        return pd.DataFrame({k: pd.Series(dtype=v) for k, v in cols.items()})
    span = stepped.groupby("step").agg(start_ns=("ts_ns", "min"), end_ns=("end_ns", "max"))
    cpu_all = stepped[(stepped["role"] == ROLE_CPU).to_numpy()]
    cpu = cpu_all[cpu_all["name"].isin(_PHASES).to_numpy()]
    phases = cpu.pivot_table(
        index="step", columns="name", values="dur_ns", aggfunc="sum", fill_value=0
    )
    phases = phases.reindex(columns=_PHASES, fill_value=0).add_suffix("_ns")
    comp = stepped[(stepped["role"] == ROLE_COMPUTE).to_numpy()]
    g, s, e = union_grouped(
        comp["step"].to_numpy(np.int64), comp["ts_ns"].to_numpy(), comp["end_ns"].to_numpy()
    )
    busy = pd.Series(e - s, index=g).groupby(level=0).sum().rename("device_busy_ns")
    table = span.join(phases, how="left").join(busy, how="left")
    sums = [c for c in _SUMS if c in stepped.columns]
    if sums:
        by_step = cpu_all.groupby("step")[sums].sum(min_count=1)
        for col in sums:
            table[col] = by_step[col]
    table = table.reset_index().sort_values("step").reset_index(drop=True)
    gap = (table["step"].shift(-1) - table["step"]).astype("float64")
    table["step_ns"] = (table["start_ns"].shift(-1) - table["start_ns"]).astype("float64") / gap
    fill = {c: 0 for c in table.columns if c.endswith("_ns") and c != "step_ns"}
    table = table.fillna(fill)
    ordered = ["step", "start_ns", "end_ns", "step_ns", *phases.columns, "device_busy_ns"]
    ordered += [c for c in table.columns if c not in ordered]
    table["phase"] = step_phase(table)
    return table[[*ordered, "phase"]].astype(
        {k: v for k, v in STEP_BASE_COLUMNS.items()} | {c: "int64" for c in phases.columns}
    )
