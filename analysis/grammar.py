"""Grammar work under device work: structured output with deferred sampling (docs/design.md §2.9, §5.6).

With deferred sampling the forward of step N+1 is enqueued before the host waits on output N;
its sampling waits for ``wait_output(kind=grammar)`` on output N, the grammar accepting t_N, and
``grammar_mask`` of step N+1 (the bitmask that step's sampling applies). So the ``grammar_mask``
slice of step s is the grammar work that consumes output s-1, and the device can run forward s
under it; without deferral the mask of s is built before any device work of s is enqueued.

Let G_s be the union of step s's ``grammar_mask`` slices, W_s that of its ``wait_output`` slices
with kind ``grammar`` (the wait on output s, which gates the sampling of s+1), B the union of
device compute slices, idle its complement inside the window. Only CPU-role slices count.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from analysis.frames import ROLE_COMPUTE, ROLE_CPU, require_columns
from analysis.intervals import Union, intersect_measure, union_grouped
from instrument.schema import CpuSlice, WaitKind

__all__ = ["GRAMMAR_COLUMNS", "GRAMMAR_HEADLINE_KEYS", "grammar_by_step", "grammar_headline"]

GRAMMAR_COLUMNS = {
    "step": "int64",
    "mask_ns": "int64",
    "mask_hidden_ns": "int64",
    "wait_ns": "int64",
    "wait_exposed_ns": "int64",
    "device_before_mask_end": "boolean",
}
GRAMMAR_HEADLINE_KEYS = (
    "grammar_mask_ms",
    "grammar_hidden_frac",
    "grammar_wait_total_us",
    "grammar_wait_exposed_us",
    "grammar_overlap_steps_frac",
)
_INTS = [c for c, t in GRAMMAR_COLUMNS.items() if t == "int64" and c != "step"]


def _per_step(sel: pd.DataFrame, u: Union, prefix: str, against: str) -> pd.DataFrame:
    """Per step: |X_s| as ``<prefix>_ns``, |X_s ∩ u| as ``<prefix>_<against>_ns``, last end."""
    g, s, e = union_grouped(
        sel["step"].to_numpy(np.int64), sel["ts_ns"].to_numpy(), sel["end_ns"].to_numpy()
    )
    df = pd.DataFrame(
        {
            "step": g,
            f"{prefix}_ns": e - s,
            f"{prefix}_{against}_ns": intersect_measure(s, e, u),
            f"{prefix}_end_ns": e,
        }
    )
    agg = {c: "sum" for c in df.columns if c not in ("step", f"{prefix}_end_ns")}
    # Int64 (nullable): the outer join below must not turn host-clock ns into floats.
    return df.groupby("step", sort=True).agg({**agg, f"{prefix}_end_ns": "max"}).astype("Int64")


def grammar_by_step(slices: pd.DataFrame, busy: Union, idle: Union) -> pd.DataFrame:
    """One row per step with grammar work or a grammar wait, sorted by step.

    Columns: ``step``; ``mask_ns`` (|G_s|), ``mask_hidden_ns`` (|G_s ∩ B|: grammar CPU time
    while the device was busy); ``wait_ns`` (|W_s|), ``wait_exposed_ns`` (|W_s ∩ idle|: the
    device idled while the host waited, recoverable); ``device_before_mask_end`` (boolean: the
    step's earliest compute slice -- its input prep / forward -- started before the end of G_s,
    i.e. forward s ran ahead of the grammar work consuming output s-1; <NA> when the step has no
    ``grammar_mask``, no compute slice, or no step number).
    """
    require_columns(slices, ["name", "kind", "role", "step", "ts_ns", "end_ns"], "grammar_by_step")
    cpu = slices[(slices["role"] == ROLE_CPU).to_numpy(bool)]
    masks = cpu[(cpu["name"] == CpuSlice.GRAMMAR_MASK.value).to_numpy(bool)]
    waits = cpu[
        (
            (cpu["name"] == CpuSlice.WAIT_OUTPUT.value) & (cpu["kind"] == WaitKind.GRAMMAR.value)
        ).to_numpy(bool)
    ]
    if masks.empty and waits.empty:
        return pd.DataFrame({c: pd.Series(dtype=t) for c, t in GRAMMAR_COLUMNS.items()})
    m = _per_step(masks, busy, "mask", "hidden")
    w = _per_step(waits, idle, "wait", "exposed")
    compute = slices[((slices["role"] == ROLE_COMPUTE) & (slices["step"] >= 0)).to_numpy(bool)]
    device_start = compute.groupby("step")["ts_ns"].min().rename("device_start_ns").astype("Int64")
    df = m.join(w, how="outer").join(device_start, how="left").reset_index()
    df[_INTS] = df[_INTS].fillna(0)
    known = df["mask_end_ns"].notna() & df["device_start_ns"].notna() & (df["step"] >= 0)
    first = pd.Series(pd.NA, index=df.index, dtype="boolean")
    first[known] = df.loc[known, "device_start_ns"] < df.loc[known, "mask_end_ns"]
    df["device_before_mask_end"] = first
    return df[list(GRAMMAR_COLUMNS)].astype(GRAMMAR_COLUMNS)


def grammar_headline(table: pd.DataFrame) -> dict[str, Any]:
    """The headline numbers of a :func:`grammar_by_step` table (keys ``GRAMMAR_HEADLINE_KEYS``).

    ``grammar_mask_ms`` = Σ|G_s|; ``grammar_hidden_frac`` = Σ|G_s ∩ B| / Σ|G_s| (None without
    grammar_mask); ``grammar_wait_total_us`` = Σ|W_s|; ``grammar_wait_exposed_us`` =
    Σ|W_s ∩ idle|; ``grammar_overlap_steps_frac`` = the share of steps with a known
    ``device_before_mask_end`` for which it is True (None when there is none).
    """
    mask_ns = int(table["mask_ns"].sum())
    flags = table["device_before_mask_end"].dropna()
    return {
        "grammar_mask_ms": mask_ns / 1e6,
        "grammar_hidden_frac": int(table["mask_hidden_ns"].sum()) / mask_ns if mask_ns else None,
        "grammar_wait_total_us": int(table["wait_ns"].sum()) / 1e3,
        "grammar_wait_exposed_us": int(table["wait_exposed_ns"].sum()) / 1e3,
        "grammar_overlap_steps_frac": float(flags.astype(bool).mean()) if len(flags) else None,
    }
