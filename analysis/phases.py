"""Step phases: every metric split by what the step did (a prefill burst and a pure decode step
have different overlap).

A step's phase comes from its ``schedule`` slice's args:

* ``spec_verify``: ``num_spec_tokens > 0`` (the step verifies drafts, whatever else it does);
* ``prefill_only``: ``num_prefill > 0`` and ``num_decode == 0``;
* ``mixed``: ``num_prefill > 0`` and ``num_decode > 0``;
* ``decode_only``: ``num_prefill == 0`` and ``num_decode > 0``;
* ``unknown``: no ``schedule`` args (Kineto traces, or a step cut off by the window);
* ``no_step`` (table row only): device time of a window whose kernels no step claims.

The table partitions the window (``step_spans``): its ``span_ns`` add up to the window and its
``idle_ns`` to the headline idle, so each phase's ``bubble_ratio`` is a share of its own time.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.frames import ROLE_COMPUTE, require_columns
from analysis.intervals import intersect_measure
from instrument.schema import Arg

__all__ = ["PHASES", "step_phase", "step_spans", "phase_table", "PHASE_COLUMNS"]

PHASES = ("prefill_only", "mixed", "decode_only", "spec_verify", "unknown", "no_step")
PHASE_COLUMNS = {
    "phase": "object",
    "num_steps": "int64",
    "span_ns": "int64",
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


def step_spans(
    steps: pd.DataFrame, slices: pd.DataFrame, start_ns: int, end_ns: int
) -> pd.DataFrame:
    """Cut the window ``[start_ns, end_ns)`` into one device span per step, so the spans
    partition it and each bubble belongs to the step whose device work it waited for.

    A step with device compute owns ``[previous cut, cut)``, its cut being the end of its last
    compute slice (running maximum in step order, so cuts never go back); the first such step
    starts at ``start_ns``, the last ends at ``end_ns``. Steps without compute own nothing.
    When no step has compute, the whole window is one span with ``step`` -1 (device work that
    no step claims: kernels launched outside the window's steps).

    Columns: ``step`` int64, ``start_ns``, ``end_ns`` int64 (empty spans have start == end).
    """
    cols = {"step": "int64", "start_ns": "int64", "end_ns": "int64"}
    if end_ns <= start_ns:
        return pd.DataFrame({k: pd.Series(dtype=v) for k, v in cols.items()})
    comp = slices[(slices["role"] == ROLE_COMPUTE).to_numpy(bool) & (slices["step"] >= 0)]
    last_end = comp.groupby("step")["end_ns"].max()
    step = steps["step"].to_numpy(np.int64)
    dev_end = last_end.reindex(step).to_numpy(np.float64)
    has = ~np.isnan(dev_end)
    if not has.any():
        return pd.DataFrame({"step": [-1], "start_ns": [start_ns], "end_ns": [end_ns]}).astype(cols)
    cut = np.clip(np.maximum.accumulate(dev_end[has]), start_ns, end_ns).astype(np.int64)
    cut[-1] = end_ns
    begin = np.concatenate(([start_ns], cut[:-1]))
    span_s = np.full(step.size, start_ns, dtype=np.int64)
    span_e = span_s.copy()
    span_s[has], span_e[has] = begin, cut
    return pd.DataFrame({"step": step, "start_ns": span_s, "end_ns": span_e}).astype(cols)


def phase_table(
    steps: pd.DataFrame,
    overlap: pd.DataFrame,
    waits: pd.DataFrame,
    bubbles: pd.DataFrame,
    slices: pd.DataFrame,
    window_ns: tuple[int, int] | None = None,
) -> pd.DataFrame:
    """Per phase (rows in ``PHASES`` order, only phases present): ``num_steps``, ``span_ns``
    (the phase's steps' share of the window, ``step_spans``), step time (``step_ms_p50``/
    ``step_ms_mean``, cadence), schedule/forward overlap (``sched_ns``, ``hidden_ns``,
    ``overlap`` = hidden/sched), compute idle (``idle_ns`` = |bubbles ∩ spans|; ``bubble_ratio`` =
    idle / span), accepted-count wait (``wait_accepted_exposed_us``, ``wait_accepted_hidden_us``)
    and ``num_tokens_mean``. Σ ``span_ns`` is the window and Σ ``idle_ns`` the headline idle.

    Inputs: a step table with ``phase`` (``analysis.steps.step_table``), ``overlap_by_step``,
    ``accepted_wait_by_step``, ``find_bubbles`` frames and the slices of the same window;
    ``window_ns`` = the window's ``(start_ns, end_ns)`` (default: its compute slices' extent).
    """
    require_columns(steps, ["step", "start_ns", "step_ns", "phase"], "phase_table")
    if window_ns is None:
        comp = slices[(slices["role"] == ROLE_COMPUTE).to_numpy(bool)]
        window_ns = (int(comp["ts_ns"].min()), int(comp["end_ns"].max())) if len(comp) else (0, 0)
    spans = step_spans(steps, slices, *window_ns)
    idle_u = (bubbles["start_ns"].to_numpy(np.int64), bubbles["end_ns"].to_numpy(np.int64))
    spans["idle_ns"] = intersect_measure(
        spans["start_ns"].to_numpy(np.int64), spans["end_ns"].to_numpy(np.int64), idle_u
    )
    spans["span_ns"] = spans["end_ns"] - spans["start_ns"]
    phase = steps.set_index("step")["phase"]
    spans["phase"] = spans["step"].map(phase).astype(object).fillna("no_step")
    by_span = spans.groupby("phase")[["span_ns", "idle_ns"]].sum()
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
    tokens = steps[Arg.NUM_TOKENS.value] if Arg.NUM_TOKENS.value in steps.columns else None
    groups = list(steps.groupby("phase", sort=False))
    if "no_step" in by_span.index:
        groups.append(("no_step", steps.iloc[:0]))
    if not groups:
        return pd.DataFrame({k: pd.Series(dtype=v) for k, v in PHASE_COLUMNS.items()})
    out = []
    for name, group in groups:
        step_ms = group["step_ns"].dropna() / 1e6
        sched = int(ov["sched_ns"].get(name, 0))
        hidden = int(ov["hidden_ns"].get(name, 0))
        span = int(by_span["span_ns"].get(name, 0))
        idle_ns = int(by_span["idle_ns"].get(name, 0))
        out.append(
            {
                "phase": name,
                "num_steps": len(group),
                "span_ns": span,
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
                if tokens is not None and len(group)
                else np.nan,
            }
        )
    df = pd.DataFrame(out)
    df["order"] = df["phase"].map({p: i for i, p in enumerate(PHASES)})
    df = df.sort_values("order").drop(columns="order").reset_index(drop=True)
    return df.astype(PHASE_COLUMNS)
