"""When the host submitted a device stage's work: host-paced stages and CUDA-graph replays
(docs/design.md §5.14.2).

A device stage slice ``[b, e]`` (the stream reaching its begin and end events) was enqueued by
the host before ``host_end_ns`` = h. Nothing of the stage can run before the host submitted it:

* the stage is **host-paced** when the device reached its begin before the host had finished
  submitting it (``b < h``), or when it is starved at its end (lead ``e - h`` below
  ``analysis.metrics.lead.STARVED_LEAD_NS``). Only then can its slice hold launch gaps;
  a stage the device began after ``h`` had all its work queued, and its slice is busy
  (up to cross-stream waits).
* the **tail** ``e - max(b, h)`` is the part of the slice after the host finished submitting.
* a **CUDA-graph replay** submits the whole stage at once, when ``graph.replay()`` returns, just
  before the end event is recorded: its work starts at about h, so a host-paced replay is busy
  for its tail at most (on the H200, kernel_window.pftrace steps 18..43, decode forwards' first
  kernel ran 20 µs before to 31 µs after h; device idle from b to h was 66-535 µs per step).
  Inside a replay the device still leaves a gap between consecutive kernels (0.42 µs median on the
  H200, in that trace: ~108 µs of a 2.43 ms forward of 256 kernels, 4.4%; 2.1% on the longer
  5.5 ms forwards of e2e_long_kw.pftrace). The slices do not say how many kernels a graph holds,
  so the estimate takes ``GRAPH_GAP_SHARE`` of a replay's busy time as gaps: an estimate, not a
  bound.

Which stages are graph replays: the stage's ``graph_replay`` arg where the trace has it, else
the trace's feature decisions: ``forward`` replays a graph when ``cuda_graphs`` resolved True
(decode-only steps), ``mixed_cuda_graphs`` (mixed and prefill steps) or ``spec_cuda_graphs``
(speculative steps); ``verify`` and ``draft`` when ``spec_cuda_graphs`` resolved True. The rule
does not know the capture sizes: a step too large for any captured graph counts as a replay.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.frames import require_columns
from instrument.schema import Arg, DeviceSlice

__all__ = ["GRAPH_GAP_SHARE", "graph_replayed", "paced_mask", "submit_tail"]

GRAPH_GAP_SHARE = 0.03
# Phase -> the feature decision that says whether its forward replays a CUDA graph.
_FORWARD_GRAPHS = {
    "decode_only": "cuda_graphs",
    "spec_verify": "spec_cuda_graphs",
}
_FORWARD_GRAPHS_OTHER = "mixed_cuda_graphs"
_SPEC_STAGES = (DeviceSlice.VERIFY.value, DeviceSlice.DRAFT.value)


def _resolved(decisions: pd.DataFrame | None) -> dict[str, bool]:
    if decisions is None or decisions.empty or "feature" not in decisions.columns:
        return {}
    last = decisions.drop_duplicates("feature", keep="last")
    return {str(f): bool(r) for f, r in zip(last["feature"], last["resolved"], strict=True)}


def graph_replayed(
    stages: pd.DataFrame, steps: pd.DataFrame, decisions: pd.DataFrame | None
) -> np.ndarray:
    """Per row of ``stages`` (``stage``, ``step``; ``graph_replay`` when the trace has it): whether
    the stage's work was one CUDA-graph replay (the module docstring's rule)."""
    require_columns(stages, ["step", "stage"], "graph_replayed")
    key = Arg.GRAPH_REPLAY.value
    if key in stages.columns and stages[key].notna().any():
        return stages[key].fillna(False).astype(bool).to_numpy(bool)
    on = _resolved(decisions)
    if not on.get("cuda_graphs", False) and not on.get("spec_cuda_graphs", False):
        return np.zeros(len(stages), dtype=bool)
    phase_of = steps.set_index("step")["phase"] if "phase" in steps.columns else pd.Series()
    phase = stages["step"].map(phase_of).fillna("unknown").to_numpy(object)
    stage = stages["stage"].to_numpy(object)
    out = np.zeros(len(stages), dtype=bool)
    for ph in np.unique(phase):
        feature = _FORWARD_GRAPHS.get(str(ph), _FORWARD_GRAPHS_OTHER)
        ok = on.get(feature, False) and (feature != _FORWARD_GRAPHS_OTHER or on.get("cuda_graphs"))
        out |= (phase == ph) & (stage == DeviceSlice.FORWARD.value) & bool(ok)
    if on.get("spec_cuda_graphs", False):
        out |= np.isin(stage, _SPEC_STAGES)
    return out


def _host_end_device(stages: pd.DataFrame, correction_ns: int) -> np.ndarray:
    """``host_end_ns`` on the device clock of ``ts_ns`` (``stage_lead`` shifts only the end)."""
    return stages["host_end_ns"].to_numpy(np.int64) - int(correction_ns)


def paced_mask(stages: pd.DataFrame, correction_ns: int = 0) -> np.ndarray:
    """Host-paced rows of ``stage_lead`` rows: starved, or begun before ``host_end_ns``.

    ``correction_ns``: the clock correction ``stage_lead`` added to ``end_ns``
    (``stages.attrs["clock_correction_ns"]``); ``ts_ns`` is compared on the same clock."""
    require_columns(stages, ["ts_ns", "host_end_ns", "starved"], "paced_mask")
    begun_early = stages["ts_ns"].to_numpy(np.int64) < _host_end_device(stages, correction_ns)
    return stages["starved"].to_numpy(bool) | begun_early


def submit_tail(stages: pd.DataFrame, correction_ns: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(dur_ns, tail_ns)`` per row: the slice's length and its part after the host finished
    submitting it, ``e - max(b, h)`` clipped to ``[0, dur]`` (all on the uncorrected clock)."""
    require_columns(stages, ["ts_ns", "end_ns", "host_end_ns"], "submit_tail")
    ts = stages["ts_ns"].to_numpy(np.int64)
    end = stages["end_ns"].to_numpy(np.int64) - int(correction_ns)
    dur = np.maximum(end - ts, 0)
    tail = np.clip(end - np.maximum(ts, _host_end_device(stages, correction_ns)), 0, dur)
    return dur, tail
