"""Step phases: every metric split by what the step did (a prefill burst and a pure decode step
have different overlap).

A step's phase comes from its ``schedule`` slice's args:

* ``spec_verify``: ``num_spec_tokens > 0`` (the step verifies drafts, whatever else it does);
* ``prefill_only``: ``num_prefill > 0`` and ``num_decode == 0``;
* ``mixed``: ``num_prefill > 0`` and ``num_decode > 0``;
* ``decode_only``: ``num_prefill == 0`` and ``num_decode > 0``;
* ``unknown``: no ``schedule`` args (Kineto traces, or a step cut off by the window).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.frames import ROLE_COMPUTE, require_columns
from instrument.schema import Arg

__all__ = ["PHASES", "step_phase", "phase_table", "PHASE_COLUMNS"]

PHASES = ("prefill_only", "mixed", "decode_only", "spec_verify", "unknown")
PHASE_COLUMNS = {
    "phase": "object",
    "num_steps": "int64",
    "step_ms_p50": "float64",
    "step_ms_mean": "float64",
    "sched_ns": "int64",
    "hidden_ns": "int64",
    "overlap": "float64",
    "idle_ns": "int64",
    "bubble_ratio": "float64",
    "wait_accepted_exposed_us": "float64",
    "wait_accepted_hidden_us": "float64",
    "num_tokens_mean": "float64",
}


def _arg(steps: pd.DataFrame, key: Arg) -> np.ndarray:
    if key.value not in steps.columns:
        return np.full(len(steps), np.nan)
    return steps[key.value].astype("float64").to_numpy(np.float64, na_value=np.nan)


def step_phase(steps: pd.DataFrame) -> pd.Series:
    """The phase of each row of a step table (needs ``num_prefill``/``num_decode``/
    ``num_spec_tokens`` columns when the trace has them; ``unknown`` otherwise)."""
    prefill = _arg(steps, Arg.NUM_PREFILL)
    decode = _arg(steps, Arg.NUM_DECODE)
    spec = np.nan_to_num(_arg(steps, Arg.NUM_SPEC_TOKENS))
    phase = np.select(
        [
            spec > 0,
            (prefill > 0) & (decode == 0),
            (prefill > 0) & (decode > 0),
            (prefill == 0) & (decode > 0),
        ],
        ["spec_verify", "prefill_only", "mixed", "decode_only"],
        default="unknown",
    )
    return pd.Series(phase.astype(object), index=steps.index, name="phase")


def _bubble_steps(slices: pd.DataFrame, bubbles: pd.DataFrame) -> np.ndarray:
    """The step each bubble waited for: that of the first compute slice starting at or after
    the bubble's end (-1 when none carries a step)."""
    compute = slices[(slices["role"] == ROLE_COMPUTE).to_numpy(bool) & (slices["step"] >= 0)]
    order = np.argsort(compute["ts_ns"].to_numpy(np.int64), kind="stable")
    ts = compute["ts_ns"].to_numpy(np.int64)[order]
    step = compute["step"].to_numpy(np.int64)[order]
    at = np.searchsorted(ts, bubbles["end_ns"].to_numpy(np.int64), side="left")
    return np.where(at < ts.shape[0], step[np.minimum(at, max(ts.shape[0] - 1, 0))], -1)


def phase_table(
    steps: pd.DataFrame,
    overlap: pd.DataFrame,
    waits: pd.DataFrame,
    bubbles: pd.DataFrame,
    slices: pd.DataFrame,
) -> pd.DataFrame:
    """Per phase (rows in ``PHASES`` order, only phases present): ``num_steps``, step time
    (``step_ms_p50``/``step_ms_mean``), schedule/forward overlap (``sched_ns``, ``hidden_ns``,
    ``overlap`` = hidden/sched), device idle (``idle_ns``: the bubbles that ended when one of the
    phase's steps started device work; ``bubble_ratio`` = idle / Σ step time), accepted-count
    wait (``wait_accepted_exposed_us``, ``wait_accepted_hidden_us``) and ``num_tokens_mean``.

    Inputs: a step table with ``phase`` (``analysis.steps.step_table``), ``overlap_by_step``,
    ``accepted_wait_by_step``, ``find_bubbles`` frames and the slices of the same window.
    """
    require_columns(steps, ["step", "start_ns", "step_ns", "phase"], "phase_table")
    if steps.empty:
        return pd.DataFrame({k: pd.Series(dtype=v) for k, v in PHASE_COLUMNS.items()})
    phase = steps.set_index("step")["phase"]
    ov = (
        overlap.assign(phase=overlap["step"].map(phase))
        .groupby("phase")[["sched_ns", "hidden_ns"]]
        .sum()
    )
    wt = (
        waits.assign(phase=waits["step"].map(phase))
        .groupby("phase")[["exposed_ns", "hidden_ns"]]
        .sum()
    )
    bubble_phase = pd.Series(_bubble_steps(slices, bubbles)).map(phase)
    idle = pd.Series(bubbles["dur_ns"].to_numpy(np.int64)).groupby(bubble_phase.to_numpy()).sum()
    tokens = steps[Arg.NUM_TOKENS.value] if Arg.NUM_TOKENS.value in steps.columns else None
    out = []
    for name, group in steps.groupby("phase", sort=False):
        step_ms = group["step_ns"].dropna() / 1e6
        sched = int(ov["sched_ns"].get(name, 0))
        hidden = int(ov["hidden_ns"].get(name, 0))
        span = float(group["step_ns"].fillna(0).sum())
        idle_ns = int(idle.get(name, 0))
        out.append(
            {
                "phase": name,
                "num_steps": len(group),
                "step_ms_p50": float(step_ms.median()) if len(step_ms) else np.nan,
                "step_ms_mean": float(step_ms.mean()) if len(step_ms) else np.nan,
                "sched_ns": sched,
                "hidden_ns": hidden,
                "overlap": hidden / sched if sched else np.nan,
                "idle_ns": idle_ns,
                "bubble_ratio": idle_ns / span if span else np.nan,
                "wait_accepted_exposed_us": float(wt["exposed_ns"].get(name, 0)) / 1e3,
                "wait_accepted_hidden_us": float(wt["hidden_ns"].get(name, 0)) / 1e3,
                "num_tokens_mean": float(tokens.loc[group.index].mean())
                if tokens is not None
                else np.nan,
            }
        )
    df = pd.DataFrame(out)
    df["order"] = df["phase"].map({p: i for i, p in enumerate(PHASES)})
    df = df.sort_values("order").drop(columns="order").reset_index(drop=True)
    return df.astype(PHASE_COLUMNS)
