"""The analyzers ``build_report`` runs in order (docs/design.md §5, §5.11).

Each analyzer is a small function of one :class:`Pass`: it reads what earlier analyzers left on
it (the window, the busy union, the idle union, ...) and adds its own intermediate results,
headline pieces (``Pass.head``, keys of ``analysis.headline.Headline``), tables and extra
numbers. ``ANALYZERS`` is the order; ``TABLE_ORDER`` the order of ``Report.tables``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from analysis import forked
from analysis.forked import Forked
from analysis.frames import ROLE_COPY, TraceFrames
from analysis.intervals import Union, measure, union
from analysis.lead_report import lead_section
from analysis.loading.profiles import Profile
from analysis.metrics.bubbles import BUBBLE_COLUMNS, blame_bubbles, blame_table
from analysis.metrics.decisions import ineffective_features, silent_fallbacks
from analysis.metrics.grammar import grammar_by_step, grammar_headline
from analysis.metrics.kernel_window import (
    busy_with_kernels,
    kernel_steps,
    profiler_breaks,
    runs_by_source,
    source_verdict,
)
from analysis.metrics.kernels import kernel_breakdown, kernel_slices
from analysis.metrics.latency import percentiles, request_latency
from analysis.metrics.overlap import SCHEDULING_SLICES, overall_overlap, overlap_by_step
from analysis.metrics.phases import phase_table
from analysis.metrics.runs import clip_to_runs, idle_in_runs, measured_ns, run_spans
from analysis.metrics.steps import step_table
from analysis.metrics.syncs import hot_sync_count, sync_summary
from analysis.metrics.waits import (
    accepted_wait_by_step,
    exposed_wait_summary,
    output_wait_by_step,
)
from analysis.metrics.window import Window, device_busy, select_window
from analysis.records import clean, records
from instrument.schema import Arg, CaptureArg

__all__ = ["Pass", "ANALYZERS", "TABLE_ORDER", "MAX_HEADLINE_BUBBLES", "PARALLEL_MIN_SLICES"]

MAX_HEADLINE_BUBBLES = 20
# Window slices from which bubbles forks the blame when the report may run in parallel: below,
# the blame takes less time than a fork and the pickled result cost.
PARALLEL_MIN_SLICES = 50_000
TABLE_ORDER = (
    "steps",
    "phases",
    "overlap",
    "bubbles",
    "blame",
    "waits",
    "output_waits",
    "grammar",
    "syncs",
    "decisions",
    "silent_fallbacks",
    "ineffective",
    "latency",
    "runs",
    "stage_lead",
    "starved",
    "starvation",
    "fill",
    "kernel_types",
    "top_kernels",
)
_CAPTURE_PREFIXES = (
    "capture_",  # every CaptureArg setting
    "dropped_",  # CaptureArg.DROPPED_*_PREFIX and the tracer's own dropped_<what> counts
    CaptureArg.STEPS_SEEN.value,
    CaptureArg.STEPS_KEPT.value,
    "ring_",
    "engine_skipped_",  # CaptureArg.ENGINE_SKIPPED_*: steps the engine thread did not trace
)
_NO_IDLE: Union = (np.zeros(0, np.int64), np.zeros(0, np.int64))


@dataclass
class Pass:
    """One report in the making. Inputs first; then each analyzer's results, in run order."""

    frames: TraceFrames
    profile: Profile
    skip_steps: int
    window_rule: str
    head: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    verdicts: list[str] = field(default_factory=list)  # before the headline's own verdicts
    # measured_window
    all_steps: pd.DataFrame = field(default_factory=pd.DataFrame)
    slices: pd.DataFrame = field(default_factory=pd.DataFrame)  # the window's slices
    window: Window | None = None
    busy: Union = _NO_IDLE  # compute busy union B
    kernel_windows: Union = _NO_IDLE
    runs: pd.DataFrame = field(default_factory=pd.DataFrame)
    span_ns: int = 0  # the denominator: Σ run spans
    idle: Union = _NO_IDLE  # B's complement inside the runs
    # overlap
    paired: pd.DataFrame = field(default_factory=pd.DataFrame)
    overlap: float = float("nan")  # NaN without scheduling slices (§5.3)
    parallel: bool = False  # may fork a child for independent work (analysis.forked)
    # bubbles
    found_bubbles: pd.DataFrame = field(default_factory=pd.DataFrame)  # no blame columns
    idle_ns: int = 0
    blame_job: Forked[tuple[pd.DataFrame, pd.DataFrame]] | None = None
    # blame
    bubbles: pd.DataFrame = field(default_factory=pd.DataFrame)
    top_blame: dict[str, Any] | None = None
    # latency
    latency: pd.DataFrame = field(default_factory=pd.DataFrame)


def measured_window(p: Pass) -> None:
    """§5.2 and §5.14.3/5: the window, the busy union (kernels where the trace has them), the
    kept runs (sampled traces measured inside runs only) and the idle union inside them."""
    if int(p.frames.metadata.get(CaptureArg.WARMUP_STEPS.value, 0) or 0) > 0:
        p.skip_steps = 0  # the tracer already left the warm-up steps out
    p.all_steps = step_table(p.frames.slices)
    p.slices, p.window = select_window(p.frames.slices, p.skip_steps, p.window_rule, p.all_steps)
    p.busy, p.kernel_windows = busy_with_kernels(p.frames.slices)
    k_steps = kernel_steps(p.frames.slices, p.frames.metadata) if p.kernel_windows[0].size else None
    breaks = profiler_breaks(k_steps)
    p.runs = run_spans(p.slices, p.window.start_ns, p.window.end_ns, breaks)
    p.span_ns = measured_ns(p.runs)
    p.idle = idle_in_runs(p.busy, p.runs) if p.span_ns else _NO_IDLE
    p.runs = runs_by_source(p.runs, p.idle, p.kernel_windows)
    p.head["window"] = p.window.to_dict()
    p.tables["runs"] = p.runs
    p.verdicts += [v for v in [source_verdict(p.runs, k_steps)] if v]


def overlap(p: Pass) -> None:
    """§5.3: scheduling paired only with device work of its own run (none before its start)."""
    p.paired = clip_to_runs(p.slices[p.slices["name"].isin(SCHEDULING_SLICES)], p.runs)
    p.overlap, _, _ = overall_overlap(p.paired, p.busy)
    p.head["overlap"] = clean(p.overlap)
    p.tables["overlap"] = overlap_by_step(p.paired, p.busy)


def bubbles(p: Pass) -> None:
    """§5.4 and §5.14.4: bubbles, compute idle and device idle (no compute and no copy)
    measured in the same runs; their blame starts here (in a forked child for large traces
    when ``p.parallel``: it needs nothing the next analyzers compute) and ends in :func:`blame`."""
    s, e = p.idle
    p.found_bubbles = pd.DataFrame(
        {"bubble_id": np.arange(s.size), "start_ns": s, "end_ns": e, "dur_ns": e - s}
    ).astype(BUBBLE_COLUMNS)
    p.idle_ns = int(p.found_bubbles["dur_ns"].sum())
    fork = p.parallel and len(p.slices) >= PARALLEL_MIN_SLICES
    p.blame_job = forked.start(_blame, p.found_bubbles, p.slices, p.profile.envelopes, fork=fork)
    sl = p.frames.slices
    copies = device_busy(sl[sl["role"] == ROLE_COPY], True)
    device_busy_u = union(*(np.concatenate(x) for x in zip(p.busy, copies, strict=True)))
    device_idle_ns = int(measure(idle_in_runs(device_busy_u, p.runs))) if p.span_ns else 0
    p.head |= {
        "bubble_ratio": p.idle_ns / p.span_ns if p.span_ns else None,
        "device_idle_ratio": device_idle_ns / p.span_ns if p.span_ns else None,
    }


def _blame(
    found: pd.DataFrame, slices: pd.DataFrame, envelopes: tuple[str, ...]
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The bubbles with their blame columns, and the blame table."""
    with_blame, pieces = blame_bubbles(found, slices, envelopes)
    return with_blame, blame_table(pieces)


def blame(p: Pass) -> None:
    """§5.4: the blame started by :func:`bubbles`: bubbles and blame tables, the top blame."""
    assert p.blame_job is not None
    p.bubbles, table = p.blame_job.result()
    top = table.iloc[0] if len(table) else None
    p.top_blame = (
        {
            "label": str(top["label"]),
            "share": float(top["share"]),
            "idle_ms": int(top["idle_ns"]) / 1e6,
        }
        if top is not None
        else None
    )
    largest = p.bubbles.sort_values("dur_ns", ascending=False).head(MAX_HEADLINE_BUBBLES)
    p.head |= {
        "bubbles": {
            "count": len(p.bubbles),
            "idle_ms": p.idle_ns / 1e6,
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
        "top_blame": p.top_blame,
    }
    p.tables |= {"bubbles": p.bubbles, "blame": table}


def waits(p: Pass) -> None:
    """§5.5: accepted-count waits, exposed (on idle) and hidden (under busy); every output wait
    by kind and its exposed cost per step (``Report.extra["output_wait"]``)."""
    table = accepted_wait_by_step(p.slices, p.busy, p.idle)
    p.head |= {
        "wait_accepted_total_us": int(table["wait_ns"].sum()) / 1e3,
        "wait_accepted_exposed_us": int(table["exposed_ns"].sum()) / 1e3,
        "wait_accepted_hidden_us": int(table["hidden_ns"].sum()) / 1e3,
    }
    p.tables["waits"] = table
    assert p.window is not None
    outputs = output_wait_by_step(p.slices, p.busy, p.idle)
    p.tables["output_waits"] = outputs
    p.extra["output_wait"] = exposed_wait_summary(outputs, p.window.num_steps, p.span_ns)


def grammar(p: Pass) -> None:
    """§5.6: grammar masks and waits per step."""
    table = grammar_by_step(p.slices, p.busy, p.idle)
    p.head |= grammar_headline(table)
    p.tables["grammar"] = table


def decisions(p: Pass) -> None:
    """§5.7: silent fallbacks and async features that hide too little."""
    silent = silent_fallbacks(p.frames.decisions)
    ineffective = ineffective_features(
        p.frames.decisions,
        p.frames.config,
        p.overlap,
        str(p.top_blame["label"]) if p.top_blame else "",
        p.profile.ineffective_overlap,
        p.profile.async_features,
    )
    p.head |= {
        "silent_fallbacks": records(silent.drop(columns=["ts_ns"])),
        "ineffective": records(ineffective),
    }
    p.tables |= {
        "decisions": p.frames.decisions,
        "silent_fallbacks": silent,
        "ineffective": ineffective,
    }


def syncs(p: Pass) -> None:
    """§5.8: syncs after warm-up (the window's first slice)."""
    warmup_end = int(p.slices["ts_ns"].min()) if len(p.slices) else 0
    table = sync_summary(p.frames.syncs, warmup_end)
    p.head["hot_syncs"] = hot_sync_count(table)
    p.tables["syncs"] = table


def latency(p: Pass) -> None:
    """§5.9: request latency over the whole trace (not the window)."""
    p.latency = request_latency(p.frames.slices)
    p.head |= {
        "ttft_ms": percentiles(p.latency["ttft_ms"]),
        "tpot_ms": percentiles(p.latency["tpot_ms"]),
    }
    p.tables["latency"] = p.latency


def steps_and_lead(p: Pass) -> None:
    """§5.10 and §5.14.1-3: the window's steps and phases, with CPU lead and starvation."""
    assert p.window is not None
    win = p.window
    in_window = (p.all_steps["step"] >= win.first_step) & (p.all_steps["step"] <= win.last_step)
    steps = p.all_steps[in_window].reset_index(drop=True)
    span = (win.start_ns, win.end_ns)
    phases = phase_table(
        steps, p.tables["overlap"], p.tables["waits"], p.found_bubbles, p.slices, span
    )
    lead = lead_section(
        p.slices,
        steps,
        p.runs,
        p.busy,
        p.kernel_windows,
        p.idle_ns,
        p.span_ns,
        p.frames.metadata.get("format", ""),
        p.frames.decisions,
        str(p.frames.metadata.get(Arg.DEVICE_BEGINS.value, "")),
    )
    p.head |= lead.headline
    p.tables |= {
        "steps": steps.merge(lead.steps, on="step", how="left"),
        "phases": phases.merge(lead.phases, on="phase", how="left", suffixes=("", "_lead")),
        **lead.tables,
    }
    p.extra["lead"] = lead.extra
    p.verdicts += lead.verdicts


def kernels(p: Pass) -> None:
    """Kernel types and the top kernels over the window (Kineto and --trace-kernels traces)."""
    assert p.window is not None
    kernel_types, top = kernel_breakdown(
        kernel_slices(p.frames), p.window.start_ns, p.window.end_ns
    )
    p.tables |= {"kernel_types": kernel_types, "top_kernels": top}


def throughput(p: Pass) -> None:
    """``Report.extra``: step time, e2e, requests, tokens per second, runs, phases, capture."""
    steps, lat, window_ns = p.tables["steps"], p.latency, p.span_ns
    cadence = steps["step_ns"].dropna() / 1e6 if len(steps) else pd.Series(dtype=float)
    tokens = int(steps["num_tokens"].fillna(0).sum()) if "num_tokens" in steps.columns else None
    lead = p.extra.pop("lead")
    p.extra |= {
        "step_ms": percentiles(cadence),
        "e2e_ms": percentiles(lat["e2e_ms"]),
        # every request the trace holds; those whose prefill it left out have no TTFT/TPOT
        "requests": {"count": len(lat), "prefill_hidden": int(lat["prefill_hidden"].sum())},
        "batch_tokens": tokens,
        "tokens_per_s": tokens / (window_ns / 1e9) if tokens and window_ns else None,
        "output_tokens_per_s": (int(lat["num_output_tokens"].sum()) / (window_ns / 1e9))
        if len(lat) and window_ns
        else None,
        "lead": lead,
        "runs": records(p.runs),
        "phases": {
            r["phase"]: {k: v for k, v in r.items() if k != "phase"}
            for r in records(p.tables["phases"])
        },
        "capture": _capture(p.frames.metadata),
    }


def _capture(metadata: dict[str, Any]) -> dict[str, Any]:
    """What capture control left out of the trace (``trace_metadata``; absent counts are 0)."""
    out = {k: clean(v) for k, v in metadata.items() if str(k).startswith(_CAPTURE_PREFIXES)}
    out["sampled"] = int(metadata.get(CaptureArg.EVERY.value, 1) or 1) > 1
    return out


ANALYZERS: tuple[Callable[[Pass], None], ...] = (
    measured_window,
    overlap,
    bubbles,
    waits,
    grammar,
    syncs,
    latency,
    steps_and_lead,
    kernels,
    blame,  # joins the blame started by bubbles
    decisions,  # needs the top blame
    throughput,
)
