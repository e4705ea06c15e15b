"""The report's CPU-lead / starvation / kernel-window section: headline numbers, tables, verdicts.

``analysis.report.build_report`` calls :func:`lead_section` once per trace and merges what it
returns; everything about "is the CPU ahead?" is computed here (docs/design.md §4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from analysis.intervals import Union, assign
from analysis.metrics.kernel_window import stage_fill
from analysis.metrics.lead import (
    LEAD_HEADLINE_KEYS,
    STARVED_LEAD_NS,
    lead_by_phase,
    lead_headline,
    no_lead_reason,
    stage_lead,
    step_lead,
)
from analysis.metrics.starvation import (
    BETWEEN_STEPS_FRAC,
    LAUNCH_BOUND_FRAC,
    phase_starvation,
    starved_busy,
    step_spans,
)
from analysis.metrics.submit import graph_replayed, paced_mask
from instrument.schema import DeviceBegins

__all__ = ["LeadSection", "lead_section", "LEAD_SECTION_KEYS", "BUSY_KERNELS", "BUSY_SLICES"]

BUSY_KERNELS = "kernels"
BUSY_SLICES = "stage_slices"
BUSY_MIXED = "kernels_and_stage_slices"
LEAD_SECTION_KEYS = (
    *LEAD_HEADLINE_KEYS,
    "busy_source",
    "bubble_ratio_bound",
    "bubble_ratio_starvation_aware",
)


@dataclass
class LeadSection:
    """``headline``: ``LEAD_SECTION_KEYS``; ``steps``: per-step lead columns (merge on ``step``);
    ``phases``: per-phase lead and starvation columns (merge on ``phase``); ``tables``:
    ``stage_lead``, ``starved``, ``starvation``, ``fill``; ``verdicts``; ``extra``: notes."""

    headline: dict[str, Any]
    steps: pd.DataFrame
    phases: pd.DataFrame
    tables: dict[str, pd.DataFrame]
    verdicts: list[str]
    extra: dict[str, Any] = field(default_factory=dict)


def _ms_or_us(us: float) -> str:
    return f"{us / 1e3:.1f} ms" if abs(us) >= 1000 else f"{us:.0f} µs"


def _busy_source(format_: str, windows: Union, start: int, end: int) -> str:
    if format_ == "kineto":
        return BUSY_KERNELS
    if windows[0].size == 0:
        return BUSY_SLICES
    covered = int((np.minimum(windows[1], end) - np.maximum(windows[0], start)).clip(0).sum())
    return BUSY_KERNELS if covered >= end - start else BUSY_MIXED


def lead_section(
    slices: pd.DataFrame,
    steps: pd.DataFrame,
    runs: pd.DataFrame,
    busy: Union,
    windows: Union,
    idle_ns: int,
    measured_ns: int,
    format_: str = "perfetto",
    decisions: pd.DataFrame | None = None,
    device_begins: str = "",
) -> LeadSection:
    """Lead, starvation and kernel fill over one window's ``slices`` (``steps``: its step table;
    ``runs``: ``analysis.metrics.runs.run_spans``; ``busy``/``windows``: ``busy_with_kernels``;
    ``idle_ns``/``measured_ns``: the report's idle and denominator; ``decisions``: the trace's
    feature decisions, which say which stages replay CUDA graphs; ``device_begins``: the trace's
    ``trace_metadata`` value (``schema.DeviceBegins``; "" when absent: recorded))."""
    stages = stage_lead(slices)
    per_step = step_lead(stages)
    steps = steps.merge(per_step, on="step", how="left")
    head: dict[str, Any] = lead_headline(steps)
    start = int(runs["start_ns"].min()) if len(runs) else 0
    end = int(runs["end_ns"].max()) if len(runs) else 0
    source = _busy_source(format_, windows, start, end)
    correction = int(stages.attrs.get("clock_correction_ns", 0))
    graph = graph_replayed(stages, steps, decisions)
    outside = np.ones(len(stages), dtype=bool)
    if windows[0].size:
        outside = assign(stages["ts_ns"].to_numpy(), *windows) < 0
    fill = stage_fill(slices)
    starved = starved_busy(
        stages[outside],
        steps,
        _starved_fill(fill, stages, steps, correction),
        graph[outside],
        correction,
    )
    hidden = int(starved["hidden_idle_ns"].sum())
    spans = step_spans(slices, steps, runs)
    starvation = phase_starvation(spans, busy, starved, steps)
    phases = lead_by_phase(steps).merge(
        starvation[["phase", "hidden_idle_ns"]],
        on="phase",
        how="outer",
    )
    aware = min(idle_ns + hidden, measured_ns) / measured_ns if measured_ns else None
    head |= {
        "busy_source": source,
        "bubble_ratio_bound": "measured" if source == BUSY_KERNELS else "lower_bound",
        "bubble_ratio_starvation_aware": aware,
    }
    lead_cols = [c for c in per_step.columns if c != "step"] if len(per_step) else []
    reason = no_lead_reason(slices) if head["cpu_lead_us_p50"] is None else ""
    return LeadSection(
        head,
        steps[["step", *lead_cols]] if lead_cols else steps[["step"]],
        phases,
        {
            "stage_lead": stages,
            "starved": starved,
            "starvation": starvation,
            "fill": fill,
        },
        _verdicts(
            head,
            steps,
            starvation,
            idle_ns,
            measured_ns,
            reason,
            stages.attrs.get("clock_correction_ns", 0),
            device_begins == DeviceBegins.DERIVED.value,
        ),  # fmt: skip
        {
            "lead_note": reason,
            "starved_lead_us": STARVED_LEAD_NS / 1e3,
            "clock_correction_us": stages.attrs.get("clock_correction_ns", 0) / 1e3,
        },
    )


def _starved_fill(
    fill: pd.DataFrame, stages: pd.DataFrame, steps: pd.DataFrame, correction_ns: int = 0
) -> dict[tuple[str, str], float]:
    """Median measured fill of the host-paced stages inside kernel windows, per (stage, phase)."""
    if fill.empty or stages.empty:
        return {}
    paced = stages[paced_mask(stages, correction_ns)]
    measured = fill.merge(paced[["step", "stage", "ts_ns"]], on=["step", "stage", "ts_ns"])
    measured = measured.assign(phase=measured["step"].map(steps.set_index("step")["phase"]))
    medians = measured.dropna(subset=["fill"]).groupby(["stage", "phase"])["fill"].median()
    return {(str(k[0]), str(k[1])): float(v) for k, v in medians.items()}


def _verdicts(
    head: dict[str, Any],
    steps: pd.DataFrame,
    starvation: pd.DataFrame,
    idle_ns: int,
    measured_ns: int,
    reason: str,
    correction_ns: int = 0,
    derived_begins: bool = False,
) -> list[str]:
    out: list[str] = []
    # Said once, with the bubble numbers (docs/design.md §5.4): derived begins are early, if
    # anything, so the stage slices are long and the idle between them short.
    derived = (
        "device stage begins in this trace were derived, not recorded (lower bounds: at or "
        "before a recorded begin, by a few µs for compute stages and up to tens of µs for "
        "input copies), so device-slice idle is, if anything, under-counted"
        if derived_begins
        else ""
    )
    if reason:
        out.append(f"CPU lead not measured: {reason}.")
    else:
        p50, p10 = head["cpu_lead_us_p50"], head["cpu_lead_us_p10"]
        frac = head["starved_steps_frac"]
        lead = (
            f"{_ms_or_us(p50)} ahead of the device"
            if p50 >= STARVED_LEAD_NS / 1e3
            else f"only {_ms_or_us(p50)} ahead of the device (below the "
            f"{STARVED_LEAD_NS / 1e3:.0f} µs starvation threshold)"
        )
        out.append(
            f"The CPU runs {lead} at p50 (p10 {_ms_or_us(p10)}); "
            f"the device waited for the host in {100 * frac:.0f}% of steps."
            + (
                f" (Device times shifted {correction_ns / 1e3:.0f} µs later: some leads were "
                "negative, which is impossible, so the trace's clock mapping was early.)"
                if correction_ns
                else ""
            )
        )
        out += _launch_bound(steps, starvation)
    if measured_ns and head["busy_source"] != BUSY_KERNELS:
        aware = head["bubble_ratio_starvation_aware"]
        where = (
            "from stage slices outside the kernel window"
            if head["busy_source"] == BUSY_MIXED
            else "from stage slices, no kernel data"
        )
        text = (
            f"bubble_ratio {100 * idle_ns / measured_ns:.0f}% is a lower bound on device idle "
            f"({where})"
        )
        if aware is not None and not reason and aware > idle_ns / measured_ns + 0.005:
            text += (
                f"; counting host-paced stages' launch gaps and CUDA-graph kernel gaps it is "
                f"about {100 * aware:.0f}% (an estimate)"
            )
        if derived:
            text += f"; {derived}"
        out.append(text + ".")
    elif derived:
        out.append(derived[0].upper() + derived[1:] + ".")
    return out


def _launch_bound(steps: pd.DataFrame, starvation: pd.DataFrame) -> list[str]:
    out = []
    by_phase = starvation.set_index("phase") if len(starvation) else None
    for phase, group in steps.dropna(subset=["cpu_lead_us"]).groupby("phase", sort=False):
        frac = float(group["starved"].astype(bool).mean())
        if frac < LAUNCH_BOUND_FRAC or by_phase is None or phase not in by_phase.index:
            continue
        row = by_phase.loc[phase]
        name = str(phase).replace("_", "-").capitalize()
        launch_ms, stage_ms = row["launch_ms_p50"], row["stage_ms_p50"]
        if launch_ms < BETWEEN_STEPS_FRAC * stage_ms:
            out.append(
                f"{name} steps are host-bound between steps, not launch-bound: the device waited "
                f"for the host in {100 * frac:.0f}% of them, yet launching one took "
                f"{launch_ms:.2f} ms against {stage_ms:.2f} ms of device slices (p50), so the "
                "device idled before each launch, through the host's work between steps (a "
                "synchronous loop, or a wait for each step's output before the next is "
                "scheduled; the blame table names the phases)."
            )
            continue
        text = (
            f"{name} steps are launch-bound: the device waited for the "
            f"host in {100 * frac:.0f}% of them (host launch {launch_ms:.2f} ms vs "
            f"device slices {stage_ms:.2f} ms per step, p50)"
        )
        launch_gaps = row["hidden_idle_ns"] - row["graph_gap_ns"]
        if launch_gaps > 0:
            per_step = launch_gaps / 1e6 / max(int(group["starved"].sum()), 1)
            text += (
                f"; about {per_step:.2f} ms of each starved step's slices is launch gaps, "
                f"blamed on {row['blame']}"
            )
        out.append(text + ".")
    return out
