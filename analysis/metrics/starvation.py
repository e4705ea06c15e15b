"""Starved time is not busy time (docs/design.md §4, §5.14.2): a starvation-aware idle estimate.

A stage slice runs from the device reaching its begin event to reaching its end event. Where the
host submitted the stage's work slower than the device ran it (a *host-paced* stage,
``analysis.metrics.submit``), the slice also covers the gaps where the device waited for the
host, so stage-slice idle is a lower bound on device idle.

The estimator (``starved_busy``), from stage slices and their ``host_end_ns`` alone (never from
the kernels of the span it estimates):

1. A stage that is not host-paced had its work queued when the device began it: its slice is
   busy (a CUDA-graph replay less its intra-graph kernel gaps, step 3).
2. A host-paced eager stage: per stage name, fit busy = a + b * num_tokens (the step's scheduled
   tokens) by least squares over the stage's slices that were not host-paced (b clipped at
   >= 0; with fewer than 3 distinct token counts, b = 0 and a = their median). Its busy estimate
   is max(that prediction, its tail after the host finished submitting), clipped to [0, slice];
   ``extrapolated`` when its token count lies outside the reference range. A stage name with no
   reference (every slice of it host-paced: a host-bound run) is busy for its tail
   (``eager_submit``): the device ran its kernels as they arrived, and only what was still
   queued when the host finished runs back to back; a lower bound on its busy time.
3. A host-paced CUDA-graph replay (submitted at once, at about ``host_end_ns``): busy = its tail
   ``e - max(b, host_end)`` (``method`` ``graph_submit``); every replay then loses
   ``GRAPH_GAP_SHARE`` of its busy time to gaps between its kernels (``graph_gap_ns``;
   ``graph_gaps`` for a replay that was not host-paced). A replay whose slice is graph stamps
   (``graph_stamped``: from its first kernel to its last, docs/design.md §4.3) holds no wait for
   the submission, so it is busy for its slice less those gaps, host-paced or not.
4. Where the trace also has a kernel window (``--trace-kernels``), kernel data calibrates the
   estimate: a host-paced stage outside the window whose (stage, phase) was also host-paced
   inside it gets busy = the median fill (kernel union / slice) of those measured stages x its
   slice (``method`` ``kernel_fill``).

Everything but step 1's slices is an estimate (the rest of each slice, ``hidden_idle_ns``, is
idle the stage slices hid). The hidden idle of host-paced stages is blamed on the CPU slice that
was launching: ``launch``, named by phase (``launch (mixed)``); graph gaps are device-side. A
phase is *launch-bound* when most of its steps are starved and launching one of its steps takes
at least ``BETWEEN_STEPS_FRAC`` of its device slices; starved with a launch far shorter than the
slices, the device waits *before* each launch, for host work between steps (a synchronous loop,
a wait for each step's output before the next is scheduled): *host-bound between steps*.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.frames import ROLE_COMPUTE, require_columns
from analysis.intervals import Union, intersect_measure
from analysis.metrics.submit import GRAPH_GAP_SHARE, paced_mask, submit_tail
from instrument.schema import Arg

__all__ = [
    "MIN_REFERENCE_POINTS",
    "LAUNCH_BOUND_FRAC",
    "BETWEEN_STEPS_FRAC",
    "STARVED_COLUMNS",
    "SPAN_COLUMNS",
    "starved_busy",
    "step_spans",
    "phase_starvation",
    "launch_label",
]

MIN_REFERENCE_POINTS = 3
LAUNCH_BOUND_FRAC = 0.5
# A starved phase whose host launch p50 is below this share of its device slices' p50 is
# host-bound between steps, not launch-bound (on the H200: the sync spec loop, 1.26 ms of launch
# against 7.26 ms of slices; the host-bound sample model, 1.02 ms against 0.72 ms).
BETWEEN_STEPS_FRAC = 0.5
STARVED_COLUMNS = {
    "step": "int64",
    "stage": "object",
    "ts_ns": "int64",
    "end_ns": "int64",
    "lead_ns": "int64",
    "num_tokens": "float64",
    "est_busy_ns": "int64",
    "hidden_idle_ns": "int64",
    "estimated": "bool",
    "extrapolated": "bool",
    "method": "object",
    "paced": "bool",
    "graph_replay": "bool",
    "graph_gap_ns": "int64",
}
SPAN_COLUMNS = {"step": "int64", "start_ns": "int64", "end_ns": "int64", "phase": "object"}


def launch_label(phase: str) -> str:
    """Blame label of starved time: the launching CPU slice, named by phase."""
    return f"launch ({phase})"


def _fit(tokens: np.ndarray, dur: np.ndarray) -> tuple[float, float, float, float] | None:
    """``(a, b, lo, hi)`` of busy = a + b * tokens over the reference points, or None."""
    ok = np.isfinite(tokens)
    tokens, dur = tokens[ok], dur[ok]
    if dur.size == 0:
        return None
    if dur.size < MIN_REFERENCE_POINTS or np.unique(tokens).size < MIN_REFERENCE_POINTS:
        return float(np.median(dur)), 0.0, float(tokens.min()), float(tokens.max())
    b, a = np.polyfit(tokens.astype(np.float64), dur.astype(np.float64), 1)
    if b < 0:
        a, b = float(np.median(dur)), 0.0
    return float(a), float(b), float(tokens.min()), float(tokens.max())


def starved_busy(
    stages: pd.DataFrame,
    steps: pd.DataFrame,
    fill_by: dict[tuple[str, str], float] | None = None,
    graph: np.ndarray | None = None,
    correction_ns: int = 0,
    stamped: np.ndarray | None = None,
) -> pd.DataFrame:
    """The estimator of the module docstring, for the compute stages of ``stages``
    (``analysis.metrics.lead.stage_lead`` rows; pass only those outside any kernel window).

    ``steps``: a step table (``step``, ``phase``, and ``num_tokens`` when the trace has it);
    ``fill_by``: measured fill of host-paced stages per (stage, phase) from a kernel window;
    ``graph``: per row of ``stages``, whether it was a CUDA-graph replay
    (``analysis.metrics.submit.graph_replayed``; default none); ``correction_ns``: the clock
    correction ``stage_lead`` added to ``end_ns``; ``stamped``: per row, its slice is graph
    stamps (default: the ``graph_stamped`` column where ``stages`` has it, else none). One row per host-paced or graph-replayed
    compute stage. Columns: ``STARVED_COLUMNS``; every row is estimated since the no-reference
    rule (``estimated`` and ``unestimated_stages`` stay in the tables' contract).
    """
    require_columns(
        stages, ["step", "stage", "role", "ts_ns", "end_ns", "host_end_ns", "starved"], "starved"
    )
    is_comp = (stages["role"] == ROLE_COMPUTE).to_numpy(bool)
    comp = stages[is_comp]
    key = Arg.NUM_TOKENS.value
    tok_by_step = (
        steps.set_index("step")[key].astype("float64") if key in steps.columns else pd.Series()
    )
    tokens = comp["step"].map(tok_by_step).astype("float64").fillna(0.0).to_numpy(np.float64)
    dur, tail = submit_tail(comp, correction_ns)
    paced = paced_mask(comp, correction_ns)
    is_graph = np.zeros(len(comp), bool) if graph is None else np.asarray(graph, bool)[is_comp]
    if stamped is None:
        key = Arg.GRAPH_STAMPED.value
        stamped = (
            stages[key].fillna(False).astype(bool).to_numpy(bool)
            if key in stages.columns
            else np.zeros(len(stages), bool)
        )
    is_stamped = np.asarray(stamped, bool)[is_comp] & is_graph
    stage = comp["stage"].to_numpy(object)
    # Step 3: graph replays, busy = tail (host-paced) or slice, less the intra-graph gaps; a
    # stamped replay's slice starts at its first kernel: the whole slice.
    graph_paced = paced & ~is_stamped
    base = np.where(graph_paced, tail, dur).astype(np.float64)
    est = np.where(is_graph, base * (1.0 - GRAPH_GAP_SHARE), dur.astype(np.float64))
    method = np.where(is_graph, np.where(graph_paced, "graph_submit", "graph_gaps"), "none").astype(
        object
    )
    extrapolated = np.zeros(len(comp), dtype=bool)
    eager = paced & ~is_graph
    for name in np.unique(stage[eager]):  # step 2: host-paced eager stages
        ref = ~paced & ~is_graph & (stage == name)
        fit = _fit(tokens[ref], dur[ref])
        sel = eager & (stage == name)
        if fit is None:
            est[sel] = tail[sel]
            method[sel] = "eager_submit"
            continue
        a, b, lo, hi = fit
        est[sel] = np.clip(np.maximum(a + b * tokens[sel], tail[sel]), 0.0, dur[sel])
        method[sel] = "reference_fit"
        extrapolated[sel] = (tokens[sel] < lo) | (tokens[sel] > hi)
    phase = comp["step"].map(steps.set_index("step")["phase"]).fillna("unknown").to_numpy(object)
    for (name, ph), fill in (fill_by or {}).items():  # step 4
        sel = paced & (stage == name) & (phase == ph)
        est[sel] = np.clip(fill, 0.0, 1.0) * dur[sel]
        extrapolated[sel], method[sel] = False, "kernel_fill"
    est_busy = np.rint(est).astype(np.int64)
    graph_gap = np.where(method == "kernel_fill", 0, np.rint(base * GRAPH_GAP_SHARE))
    out = pd.DataFrame(
        {
            "step": comp["step"].to_numpy(np.int64),
            "stage": stage,
            "ts_ns": comp["ts_ns"].to_numpy(np.int64),
            "end_ns": comp["end_ns"].to_numpy(np.int64),
            "lead_ns": comp["lead_ns"].to_numpy(np.int64),
            "num_tokens": tokens,
            "est_busy_ns": est_busy,
            "hidden_idle_ns": dur - est_busy,
            "estimated": method != "none",
            "extrapolated": extrapolated,
            "method": method,
            "paced": paced,
            "graph_replay": is_graph,
            "graph_gap_ns": np.where(is_graph, graph_gap, 0).astype(np.int64),
        }
    )
    return out[paced | is_graph].reset_index(drop=True).astype(STARVED_COLUMNS)


def step_spans(slices: pd.DataFrame, steps: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """Each step's device span: from the end of the previous step's device work in the same run
    (its own first compute start for a run's first step) to the end of its own; the spans of a run
    tile it without overlap, so idle inside them sums to at most their length.

    Columns: ``SPAN_COLUMNS`` (``phase`` from ``steps``); steps without compute slices absent.
    """
    require_columns(slices, ["step", "role", "ts_ns", "end_ns"], "step_spans")
    comp = slices[(slices["role"] == ROLE_COMPUTE).to_numpy(bool) & (slices["step"] >= 0)]
    if comp.empty:
        return pd.DataFrame({k: pd.Series(dtype=v) for k, v in SPAN_COLUMNS.items()})
    dev = comp.groupby("step").agg(first=("ts_ns", "min"), last=("end_ns", "max")).reset_index()
    step = dev["step"].to_numpy(np.int64)
    run_of = np.searchsorted(runs["first_step"].to_numpy(np.int64), step, side="right") - 1
    prev_end = np.roll(dev["last"].to_numpy(np.int64), 1)
    same_run = np.zeros(step.size, dtype=bool)
    same_run[1:] = (run_of[1:] == run_of[:-1]) & (step[1:] == step[:-1] + 1)
    start = np.where(same_run, prev_end, dev["first"].to_numpy(np.int64))
    end = np.maximum(dev["last"].to_numpy(np.int64), start)
    phase = dev["step"].map(steps.set_index("step")["phase"]).fillna("unknown")
    return pd.DataFrame(
        {"step": step, "start_ns": start, "end_ns": end, "phase": phase.to_numpy(object)}
    ).astype(SPAN_COLUMNS)


def _span_idle(spans: pd.DataFrame, busy: Union) -> np.ndarray:
    s, e = spans["start_ns"].to_numpy(np.int64), spans["end_ns"].to_numpy(np.int64)
    return (e - s) - intersect_measure(s, e, busy)


def phase_starvation(
    spans: pd.DataFrame,
    busy: Union,
    starved: pd.DataFrame,
    steps: pd.DataFrame,
) -> pd.DataFrame:
    """Per phase (only phases with device spans): ``num_steps``, ``span_ns`` (Σ step device
    spans), ``idle_ns`` (Σ|span \\ B|), ``bubble_ratio`` (idle / span: a lower bound where B came
    from stage slices), ``num_starved_stages`` (host-paced stages), ``hidden_idle_ns`` (the
    estimated idle stage slices hid: launch gaps and ``graph_gap_ns``, the intra-graph kernel gaps
    among them), ``unestimated_stages`` (host-paced stages left whole: none since the no-reference
    rule of step 2),
    ``bubble_ratio_starvation_aware`` ((idle + hidden) / span), ``launch_ms_p50`` (host ``launch``
    time per step) and ``stage_ms_p50`` (device compute slices per step), over the phase's
    host-paced steps when it has any, else all its steps; ``blame`` (``launch (<phase>)``). Where ``busy``
    is the kernel union (``analysis.metrics.kernel_window``) ``bubble_ratio`` is measured, not a bound.
    """
    cols: dict[str, str] = {
        "phase": "object",
        "num_steps": "int64",
        "span_ns": "int64",
        "idle_ns": "int64",
        "bubble_ratio": "float64",
        "num_starved_stages": "int64",
        "hidden_idle_ns": "int64",
        "graph_gap_ns": "int64",
        "unestimated_stages": "int64",
        "bubble_ratio_starvation_aware": "float64",
        "launch_ms_p50": "float64",
        "stage_ms_p50": "float64",
        "blame": "object",
    }
    if spans.empty:
        return pd.DataFrame({k: pd.Series(dtype=v) for k, v in cols.items()})
    spans = spans.assign(idle_ns=_span_idle(spans, busy))
    phase_of = steps.set_index("step")["phase"]
    hidden = starved.assign(phase=starved["step"].map(phase_of))
    starved_steps = set(starved.loc[starved["paced"], "step"].tolist())
    rows = []
    for phase, group in spans.groupby("phase", sort=False):
        span = int((group["end_ns"] - group["start_ns"]).sum())
        idle = int(group["idle_ns"].sum())
        mine = hidden[hidden["phase"] == phase]
        hid = int(mine["hidden_idle_ns"].sum())
        st = steps[steps["step"].isin(group["step"])]
        paced = mine[mine["paced"]]
        focus = st[st["step"].isin(starved_steps)] if not paced.empty else st
        launch = focus["launch_ns"] if "launch_ns" in focus.columns else pd.Series(dtype=float)
        stage = focus["device_busy_ns"] if "device_busy_ns" in focus.columns else launch[:0]
        rows.append(
            {
                "phase": phase,
                "num_steps": len(group),
                "span_ns": span,
                "idle_ns": idle,
                "bubble_ratio": idle / span if span else np.nan,
                "num_starved_stages": len(paced),
                "hidden_idle_ns": hid,
                "graph_gap_ns": int(mine["graph_gap_ns"].sum()),
                "unestimated_stages": int((~paced["estimated"]).sum()),
                "bubble_ratio_starvation_aware": min(idle + hid, span) / span if span else np.nan,
                "launch_ms_p50": float(launch.median()) / 1e6 if len(launch) else np.nan,
                "stage_ms_p50": float(stage.median()) / 1e6 if len(stage) else np.nan,
                "blame": launch_label(str(phase)),
            }
        )
    return pd.DataFrame(rows).astype(cols)
