"""The diagnosis of one trace: headline numbers (docs/design.md §5.11 names), tables, plain-words verdicts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from analysis.bubbles import BUBBLE_COLUMNS, blame_bubbles, blame_table
from analysis.decisions import ineffective_features, silent_fallbacks
from analysis.frames import ROLE_COPY, TraceFrames
from analysis.grammar import GRAMMAR_HEADLINE_KEYS, grammar_by_step, grammar_headline
from analysis.intervals import measure, union
from analysis.kernel_window import busy_with_kernels
from analysis.kernels import kernel_breakdown, kernel_slices
from analysis.latency import percentiles, request_latency
from analysis.lead_report import LEAD_SECTION_KEYS, lead_section
from analysis.overlap import SCHEDULING_SLICES, overall_overlap, overlap_by_step
from analysis.phases import phase_table
from analysis.profiles import Profile, get_profile
from analysis.runs import clip_to_runs, idle_in_runs, measured_ns, run_spans, runs_verdict
from analysis.steps import step_table
from analysis.syncs import hot_sync_count, sync_summary
from analysis.verdicts import verdicts
from analysis.waits import accepted_wait_by_step
from analysis.window import WINDOW_STEADY, device_busy, select_window
from instrument.schema import CaptureArg

__all__ = ["Report", "build_report", "HEADLINE_KEYS"]

HEADLINE_KEYS = (
    "overlap",
    "bubble_ratio",
    "device_idle_ratio",
    "bubbles",
    "top_blame",
    "wait_accepted_total_us",
    "wait_accepted_exposed_us",
    "wait_accepted_hidden_us",
    *GRAMMAR_HEADLINE_KEYS,
    "silent_fallbacks",
    "ineffective",
    "hot_syncs",
    "ttft_ms",
    "tpot_ms",
    "window",
    *LEAD_SECTION_KEYS,
)
MAX_HEADLINE_BUBBLES = 20
_CAPTURE_PREFIXES = (
    "capture_",
    "dropped_",
    CaptureArg.STEPS_SEEN.value,
    CaptureArg.STEPS_KEPT.value,
    "ring_",
)


@dataclass
class Report:
    """Everything ``stepscope analyze`` says about one trace.

    ``headline``: the §4 numbers by their fixed names (JSON-ready); ``verdicts``: plain sentences,
    most important first; ``tables``: ``steps``, ``overlap``, ``bubbles``, ``blame``, ``waits``,
    ``grammar`` (``analysis.grammar.grammar_by_step``), ``syncs``, ``decisions``,
    ``silent_fallbacks``, ``ineffective``, ``latency``, ``runs`` (``analysis.runs``),
    ``stage_lead``, ``starved``, ``starvation`` and ``fill`` (``analysis.lead_report``),
    ``kernel_types`` and ``top_kernels`` (``analysis.kernels.kernel_breakdown`` over the window)
    frames;
    ``frames``: the loaded trace; ``extra``: secondary numbers (throughput, step time, e2e).
    """

    headline: dict[str, Any]
    verdicts: list[str]
    tables: dict[str, pd.DataFrame]
    frames: TraceFrames
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self, with_tables: bool = True) -> dict[str, Any]:
        """JSON-ready: headline, verdicts, extra, metadata and (optionally) every table."""
        out: dict[str, Any] = {
            **self.headline,
            "verdicts": self.verdicts,
            "extra": self.extra,
            "metadata": _clean(self.frames.metadata),
            "config": _clean(self.frames.config),
        }
        if with_tables:
            out["tables"] = {k: _records(v) for k, v in self.tables.items()}
        return out


def _clean(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is pd.NA:
        return None
    return value


def _column(s: pd.Series) -> list[Any]:
    """JSON-ready values of one column: numeric numpy columns vectorised, the rest per value."""
    if isinstance(s.dtype, np.dtype) and s.dtype.kind in "iub":
        return s.to_numpy().tolist()
    if isinstance(s.dtype, np.dtype) and s.dtype.kind == "f":
        v = s.to_numpy()
        out = v.astype(object)
        out[~np.isfinite(v)] = None
        return out.tolist()
    return [_clean(v) for v in s.astype(object).where(s.notna(), None).tolist()]


def _records(df: pd.DataFrame) -> list[dict[str, Any]]:
    cols = {str(c): _column(df[c]) for c in df.columns}
    return [dict(zip(cols, row, strict=True)) for row in zip(*cols.values(), strict=True)]


def build_report(
    frames: TraceFrames,
    profile: Profile | str | None = None,
    skip_steps: int = 1,
    window: str = WINDOW_STEADY,
) -> Report:
    """Compute every metric of docs/design.md §5 on loaded frames, over ``window`` (``steady``,
    ``all`` or ``A:B``; see ``analysis.win.select_window``)."""
    prof = get_profile(profile or frames.metadata.get("profile", "stepscope"))
    if int(frames.metadata.get(CaptureArg.WARMUP_STEPS.value, 0) or 0) > 0:
        skip_steps = 0  # the tracer already left the warm-up steps out
    all_steps = step_table(frames.slices)
    sl, win = select_window(frames.slices, skip_steps, window, all_steps)
    # Kernel union where the trace has kernels; sampled traces measured inside kept runs only.
    busy, kernel_windows = busy_with_kernels(frames.slices)
    runs = run_spans(sl, win.start_ns, win.end_ns)
    span_ns = measured_ns(runs)
    idle = idle_in_runs(busy, runs) if span_ns else (np.zeros(0, np.int64),) * 2
    # Scheduling is paired only with device work of its own run (none before a run's start).
    paired = clip_to_runs(sl[sl["name"].isin(SCHEDULING_SLICES)], runs)
    overlap, _, _ = overall_overlap(paired, busy)
    bubbles, pieces = blame_bubbles(_bubbles(idle), sl, prof.envelopes)
    kernel_types, top_kernels = kernel_breakdown(kernel_slices(frames), win.start_ns, win.end_ns)
    blame = blame_table(pieces)
    waits = accepted_wait_by_step(sl, busy, idle)
    grammar = grammar_by_step(sl, busy, idle)
    warmup_end = int(sl["ts_ns"].min()) if len(sl) else 0
    syncs = sync_summary(frames.syncs, warmup_end)
    top = blame.iloc[0] if len(blame) else None
    top_blame = (
        {
            "label": str(top["label"]),
            "share": float(top["share"]),
            "idle_ms": int(top["idle_ns"]) / 1e6,
        }
        if top is not None
        else None
    )
    silent = silent_fallbacks(frames.decisions)
    ineffective = ineffective_features(
        frames.decisions,
        frames.config,
        overlap,
        str(top_blame["label"]) if top_blame else "",
        prof.ineffective_overlap,
        prof.async_features,
    )
    latency = request_latency(frames.slices)
    idle_ns = int(bubbles["dur_ns"].sum())
    # Device idle: no compute and no copy, measured in the same runs as compute idle.
    copies = device_busy(frames.slices[frames.slices["role"] == ROLE_COPY], True)
    device_busy_u = union(*(np.concatenate(p) for p in zip(busy, copies, strict=True)))
    device_idle_ns = int(measure(idle_in_runs(device_busy_u, runs))) if span_ns else 0
    largest = bubbles.sort_values("dur_ns", ascending=False).head(MAX_HEADLINE_BUBBLES)
    headline: dict[str, Any] = {
        "overlap": _clean(overlap),
        "bubble_ratio": idle_ns / span_ns if span_ns else None,
        "device_idle_ratio": device_idle_ns / span_ns if span_ns else None,
        "bubbles": {
            "count": len(bubbles),
            "idle_ms": idle_ns / 1e6,
            "largest": [
                {
                    "start_ns": int(r.start_ns),
                    "dur_us": int(r.dur_ns) / 1e3,
                    "blame": r.blame,
                    "blame_share": float(r.blame_share),
                }
                for r in largest.itertuples()
            ],
        },
        "top_blame": top_blame,
        "wait_accepted_total_us": int(waits["wait_ns"].sum()) / 1e3,
        "wait_accepted_exposed_us": int(waits["exposed_ns"].sum()) / 1e3,
        "wait_accepted_hidden_us": int(waits["hidden_ns"].sum()) / 1e3,
        **grammar_headline(grammar),
        "silent_fallbacks": _records(silent.drop(columns=["ts_ns"])),
        "ineffective": _records(ineffective),
        "hot_syncs": hot_sync_count(syncs),
        "ttft_ms": percentiles(latency["ttft_ms"]),
        "tpot_ms": percentiles(latency["tpot_ms"]),
        "window": win.to_dict(),
    }
    in_window = (all_steps["step"] >= win.first_step) & (all_steps["step"] <= win.last_step)
    steps = all_steps[in_window].reset_index(drop=True)
    overlap_steps = overlap_by_step(paired, busy)
    phases = phase_table(steps, overlap_steps, waits, bubbles, sl, (win.start_ns, win.end_ns))
    lead = lead_section(
        sl, steps, runs, busy, kernel_windows, idle_ns, span_ns, frames.metadata.get("format", "")
    )
    headline |= lead.headline
    steps = steps.merge(lead.steps, on="step", how="left")
    phases = phases.merge(lead.phases, on="phase", how="left", suffixes=("", "_lead"))
    extra = _extra(steps, latency, span_ns)
    extra["lead"] = lead.extra
    extra["runs"] = _records(runs)
    extra["phases"] = {
        r["phase"]: {k: v for k, v in r.items() if k != "phase"} for r in _records(phases)
    }
    extra["capture"] = _capture(frames.metadata)
    tables = {
        "steps": steps,
        "phases": phases,
        "overlap": overlap_steps,
        "bubbles": bubbles,
        "blame": blame,
        "waits": waits,
        "grammar": grammar,
        "syncs": syncs,
        "decisions": frames.decisions,
        "silent_fallbacks": silent,
        "ineffective": ineffective,
        "latency": latency,
        "runs": runs,
        **lead.tables,
        "kernel_types": kernel_types,
        "top_kernels": top_kernels,
    }
    says = verdicts(headline, frames, extra)
    sampled = [runs_verdict(runs)] if len(runs) > 1 else []
    return Report(headline, says[:1] + lead.verdicts + sampled + says[1:], tables, frames, extra)


def _bubbles(idle: tuple[np.ndarray, np.ndarray]) -> pd.DataFrame:
    """The idle union as a ``find_bubbles`` frame (``bubble_id``, ``start_ns``, ``end_ns``,
    ``dur_ns``)."""
    s, e = idle
    return pd.DataFrame(
        {"bubble_id": np.arange(s.size), "start_ns": s, "end_ns": e, "dur_ns": e - s}
    ).astype(BUBBLE_COLUMNS)


def _capture(metadata: dict[str, Any]) -> dict[str, Any]:
    """What capture control left out of the trace (``trace_metadata``; absent counts are 0)."""
    out = {k: _clean(v) for k, v in metadata.items() if str(k).startswith(_CAPTURE_PREFIXES)}
    out["sampled"] = int(metadata.get(CaptureArg.EVERY.value, 1) or 1) > 1
    return out


def _extra(steps: pd.DataFrame, latency: pd.DataFrame, window_ns: int) -> dict[str, Any]:
    cadence = steps["step_ns"].dropna() / 1e6 if len(steps) else pd.Series(dtype=float)
    tokens = int(steps["num_tokens"].fillna(0).sum()) if "num_tokens" in steps.columns else None
    return {
        "step_ms": percentiles(cadence),
        "e2e_ms": percentiles(latency["e2e_ms"]),
        # every request the trace holds; those whose prefill it left out have no TTFT/TPOT
        "requests": {
            "count": len(latency),
            "prefill_hidden": int(latency["prefill_hidden"].sum()),
        },
        "batch_tokens": tokens,
        "tokens_per_s": tokens / (window_ns / 1e9) if tokens and window_ns else None,
        "output_tokens_per_s": (int(latency["num_output_tokens"].sum()) / (window_ns / 1e9))
        if len(latency) and window_ns
        else None,
    }
