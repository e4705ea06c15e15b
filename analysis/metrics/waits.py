"""Output waits (docs/design.md §5.5): exposed = |A ∩ idle|, hidden = |A ∩ B|.

``accepted_wait_by_step``: the accepted-count wait (``wait_output`` kind ``accepted_count``, the
headline numbers). ``output_wait_by_step``: every ``wait_output`` slice by kind, and
``exposed_wait_summary`` its per-step cost, so a run whose host waits for step N's output under
another kind (``sampled``: the async loop waits for tokens and accepted counts it needs only for
its books) can be set against one that waits for accepted counts before preparing N+1.

Only ``wait_output`` is a wait: in traces that write ``read_output`` (the host reading the
output after its event fired) that host work is its own slice, tabled beside the wait
(``read_ns``) and never counted as exposed wait. Older traces counted it inside ``wait_output``;
there ``device_wait_ns`` bounds the part spent waiting for the device.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from analysis.frames import require_columns
from analysis.intervals import Union, intersect_measure, union_grouped
from instrument.schema import CopySlice, CpuSlice, WaitKind

__all__ = [
    "WAIT_COLUMNS",
    "OUTPUT_WAIT_COLUMNS",
    "accepted_wait_by_step",
    "output_wait_by_step",
    "exposed_wait_summary",
]

WAIT_COLUMNS = {"step": "int64", "wait_ns": "int64", "exposed_ns": "int64", "hidden_ns": "int64"}
# device_wait_ns: the part of the wait before the step's d2h_output copy ended (NaN without one);
# read_ns / read_exposed_ns: the step's read_output host work of that kind, and its part on idle.
OUTPUT_WAIT_COLUMNS = {
    "kind": "object",
    **WAIT_COLUMNS,
    "device_wait_ns": "float64",
    "read_ns": "int64",
    "read_exposed_ns": "int64",
}


def _measure(a: pd.DataFrame, busy: Union, idle: Union) -> pd.DataFrame:
    """Per step of ``a``'s slices: |A_s|, |A_s ∩ idle|, |A_s ∩ busy| (A_s = their union)."""
    g, s, e = union_grouped(
        a["step"].to_numpy(np.int64), a["ts_ns"].to_numpy(), a["end_ns"].to_numpy()
    )
    df = pd.DataFrame(
        {
            "step": g,
            "wait_ns": e - s,
            "exposed_ns": intersect_measure(s, e, idle),
            "hidden_ns": intersect_measure(s, e, busy),
        }
    )
    return df.groupby("step", as_index=False, sort=True).sum().astype(WAIT_COLUMNS)


def accepted_wait_by_step(slices: pd.DataFrame, busy: Union, idle: Union) -> pd.DataFrame:
    """Per step, A_s = union of ``wait_output`` slices with kind ``accepted_count``.

    Columns: ``step``, ``wait_ns`` (|A_s|), ``exposed_ns`` (|A_s ∩ idle|: the device idled while
    the CPU waited, recoverable), ``hidden_ns`` (|A_s ∩ B|: the device was busy, no loss). Time
    outside the device window counts in ``wait_ns`` only.
    """
    require_columns(slices, ["name", "kind", "step", "ts_ns", "end_ns"], "accepted_wait_by_step")
    a = slices[
        (slices["name"] == CpuSlice.WAIT_OUTPUT.value)
        & (slices["kind"] == WaitKind.ACCEPTED_COUNT.value)
    ]
    return _measure(a, busy, idle)


def output_wait_by_step(slices: pd.DataFrame, busy: Union, idle: Union) -> pd.DataFrame:
    """Per (kind, step), A_s = union of step s's ``wait_output`` slices of that kind.

    Columns: ``kind`` (the slice's ``kind`` arg; ``""`` when it has none), ``step``, ``wait_ns``,
    ``exposed_ns``, ``hidden_ns`` as in :func:`accepted_wait_by_step`, and ``device_wait_ns`` =
    |A_s ∩ (−∞, c_s)| with c_s the end of step s's ``d2h_output`` copy slice: the time the host
    waited for the device to deliver the output. The rest of the wait came after the output was
    on the host (in traces without ``read_output``, host work inside the wait: reading and
    converting it). NaN where step s has no copy slice (Kineto traces, steps without output).
    ``read_ns`` = |R_s|, R_s = union of step s's ``read_output`` slices of that kind (the host
    reading the output once its event fired: host work, not a wait; 0 in traces without them),
    ``read_exposed_ns`` = |R_s ∩ idle|. Sorted by kind, step.
    """
    require_columns(slices, ["name", "kind", "step", "ts_ns", "end_ns"], "output_wait_by_step")
    w = slices[slices["name"] == CpuSlice.WAIT_OUTPUT.value]
    reads = slices[slices["name"] == CpuSlice.READ_OUTPUT.value]
    copies = slices[slices["name"] == CopySlice.D2H_OUTPUT.value]
    copy_end = copies.groupby("step")["end_ns"].max()
    parts = []
    for kind, g in w.groupby("kind", sort=True):
        table = _measure(g, busy, idle).assign(kind=str(kind))
        ends = g["step"].map(copy_end).to_numpy(np.float64)
        ts = g["ts_ns"].to_numpy(np.float64)
        before = np.clip(np.minimum(g["end_ns"].to_numpy(np.float64), ends) - ts, 0, None)
        by_step = pd.Series(before, index=g["step"].to_numpy()).groupby(level=0).sum(min_count=1)
        table = table.assign(device_wait_ns=table["step"].map(by_step).astype("float64"))
        r = _measure(reads[reads["kind"] == kind], busy, idle).set_index("step")
        table["read_ns"] = table["step"].map(r["wait_ns"]).fillna(0).astype("int64")
        table["read_exposed_ns"] = table["step"].map(r["exposed_ns"]).fillna(0).astype("int64")
        parts.append(table)
    if not parts:
        return pd.DataFrame({c: pd.Series(dtype=t) for c, t in OUTPUT_WAIT_COLUMNS.items()})
    return pd.concat(parts, ignore_index=True)[list(OUTPUT_WAIT_COLUMNS)].astype(
        OUTPUT_WAIT_COLUMNS
    )


def exposed_wait_summary(table: pd.DataFrame, num_steps: int, span_ns: int) -> dict[str, Any]:
    """The cost of the output waits per measured step, from :func:`output_wait_by_step`.

    ``num_steps``: the window's steps (the per-step denominator, steps without a wait count as
    0); ``span_ns``: the measured device span (the share's denominator, Σ step time). Returns
    ``{"num_steps", "exposed_us_per_step", "exposed_share", "by_kind": {kind: {"wait_us",
    "exposed_us", "hidden_us", "exposed_us_per_step", "exposed_share", "device_wait_us",
    "device_wait_us_per_step", "read_us", "read_us_per_step", "read_exposed_us_per_step"}},
    "top_kind", "read_split"}``: ``device_wait_us`` = Σ ``device_wait_ns`` (None without copy
    slices); ``read_*``: the ``read_output`` host work after each wait (None per step without
    steps), never part of ``exposed_*``; ``read_split``: the trace writes ``read_output``, so its
    ``wait_output`` is the wait for the device's output event only (False: older traces, whose
    waits include reading the output);
    ``exposed_share`` = Σ exposed / span (the fraction of step time the device idled while the
    host waited; the top level sums every kind, whose unions are disjoint in practice: one wait
    per step); ``top_kind`` = the kind with the most exposed time (None without waits).
    """
    by_kind: dict[str, dict[str, float | None]] = {}
    for kind, g in table.groupby("kind", sort=True):
        exposed = int(g["exposed_ns"].sum())
        device = float(g["device_wait_ns"].sum()) if g["device_wait_ns"].notna().any() else None
        by_kind[str(kind)] = {
            "wait_us": int(g["wait_ns"].sum()) / 1e3,
            "exposed_us": exposed / 1e3,
            "hidden_us": int(g["hidden_ns"].sum()) / 1e3,
            "exposed_us_per_step": exposed / 1e3 / num_steps if num_steps else None,
            "exposed_share": exposed / span_ns if span_ns else None,
            "device_wait_us": device / 1e3 if device is not None else None,
            "device_wait_us_per_step": device / 1e3 / num_steps
            if device is not None and num_steps
            else None,
            "read_us": int(g["read_ns"].sum()) / 1e3,
            "read_us_per_step": int(g["read_ns"].sum()) / 1e3 / num_steps if num_steps else None,
            "read_exposed_us_per_step": int(g["read_exposed_ns"].sum()) / 1e3 / num_steps
            if num_steps
            else None,
        }
    top = max(by_kind, key=lambda k: by_kind[k]["exposed_us"] or 0.0) if by_kind else None
    exposed_ns = int(table["exposed_ns"].sum())
    return {
        "num_steps": num_steps,
        "exposed_us_per_step": exposed_ns / 1e3 / num_steps if num_steps else None,
        "exposed_share": exposed_ns / span_ns if span_ns else None,
        "by_kind": by_kind,
        "top_kind": top,
        "read_split": bool((table["read_ns"] > 0).any()),
    }
