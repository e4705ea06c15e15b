"""bench/bench_spec.py's numbers: per pass from its trace window (acceptance, tokens per request
step, output waits), tokens against the run without speculation, and medians over rounds."""

from __future__ import annotations

import statistics
from typing import Any

from analysis import Report, analyze_frames, load_trace
from analysis.frames import TraceFrames
from bench._spec_engines import PassRecord
from instrument.schema import CpuSlice

__all__ = [
    "pass_report",
    "pass_trace_metrics",
    "analyse_passes",
    "divergence",
    "summarise_variant",
    "spread",
]


def pass_report(frames: TraceFrames, record: PassRecord) -> Report:
    """The analysis of the trace's steps ``first_step..end_step-1`` (the pass's window)."""
    return analyze_frames(frames, window=f"{record.first_step}:{record.end_step}")


def pass_trace_metrics(report: Report, record: PassRecord) -> dict[str, Any]:
    """A pass's numbers from :func:`pass_report`'s report of it:

    ``acceptance`` = Σ accepted / Σ drafted (``update_from_output`` args; None without drafts);
    ``tokens_per_request_step`` = the pass's output tokens / Σ ``num_reqs`` of its ``schedule``
    slices (how many tokens one request gains per target forward: 1 without speculation, less
    by the prefill chunks that emit none); ``exposed_wait_us_per_step`` / ``exposed_wait_share``
    (every ``wait_output`` kind, device idle while the host waited, per window step / of the
    window's device span) and ``wait_kinds`` (the same by kind); ``read_output_us_per_step``
    (the host reading each step's output after its wait, every kind: host work, not wait;
    0 in traces without ``read_output``); the headline's
    ``wait_accepted_exposed_us`` / ``wait_accepted_hidden_us``; ``num_steps``; ``step_ms_p50``."""
    sl = report.frames.slices
    in_pass = (sl["step"] >= record.first_step) & (sl["step"] < record.end_step)
    upd = sl[in_pass & (sl["name"] == CpuSlice.UPDATE_FROM_OUTPUT.value)]
    accepted = int(upd["num_accepted"].fillna(0).sum()) if "num_accepted" in upd else 0
    rejected = int(upd["num_rejected"].fillna(0).sum()) if "num_rejected" in upd else 0
    sched = sl[in_pass & (sl["name"] == CpuSlice.SCHEDULE.value)]
    request_steps = int(sched["num_reqs"].fillna(0).sum()) if "num_reqs" in sched else 0
    ow = report.extra["output_wait"]
    h = report.headline
    return {
        "acceptance": accepted / (accepted + rejected) if accepted + rejected else None,
        "num_accepted": accepted,
        "num_drafted": accepted + rejected,
        "tokens_per_request_step": record.output_tokens / request_steps if request_steps else None,
        "num_steps": int(h["window"]["num_steps"]),
        "step_ms_p50": report.extra["step_ms"].get("p50"),
        "exposed_wait_us_per_step": ow["exposed_us_per_step"],
        "exposed_wait_share": ow["exposed_share"],
        "read_output_us_per_step": sum(
            v.get("read_us_per_step") or 0.0 for v in ow["by_kind"].values()
        ),
        "wait_kinds": {
            k: {
                "exposed_us_per_step": v["exposed_us_per_step"],
                "exposed_share": v["exposed_share"],
            }
            for k, v in ow["by_kind"].items()
        },
        "wait_accepted_exposed_us": h["wait_accepted_exposed_us"],
        "wait_accepted_hidden_us": h["wait_accepted_hidden_us"],
    }


def analyse_passes(trace_path: str, passes: list[PassRecord]) -> list[dict[str, Any]]:
    """:func:`pass_trace_metrics` of each pass in the trace at ``trace_path`` (loaded once),
    each with its window's ``output_wait`` summary. Module-level: run in a worker process."""
    frames = load_trace(trace_path)
    out = []
    for p in passes:
        report = pass_report(frames, p)
        out.append(pass_trace_metrics(report, p) | {"output_wait": report.extra["output_wait"]})
    return out


def first_difference(a: list[int], b: list[int]) -> int:
    """The first output position where ``a`` and ``b`` differ (one ending early counts)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def divergence(ref: dict[str, list[int]], got: dict[str, list[int]]) -> dict[str, Any]:
    """``got``'s tokens against ``ref``'s, request by request (the same ids): ``num_sequences``,
    ``identical_share``, and over the differing ones the first-divergence output position,
    ``first_divergence_median`` / ``first_divergence_min`` (None when all are identical)."""
    if set(ref) != set(got):
        raise ValueError("the two passes ran different requests")
    firsts = [first_difference(ref[i], got[i]) for i in ref if ref[i] != got[i]]
    n = len(ref)
    return {
        "num_sequences": n,
        "identical_share": (n - len(firsts)) / n if n else None,
        "first_divergence_median": statistics.median(firsts) if firsts else None,
        "first_divergence_min": min(firsts) if firsts else None,
    }


def spread(values: list[float | None]) -> dict[str, float | None]:
    """``median``, ``min``, ``max`` of the values that exist (all None when none does)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarise_variant(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians and spread over a variant's measured rounds (each: ``tok_s``, ``ratio_to_none``,
    ``elapsed_s`` and, once the trace is analysed, :func:`pass_trace_metrics`' numbers)."""
    keys = (
        "tok_s",
        "ratio_to_none",
        "elapsed_s",
        "acceptance",
        "tokens_per_request_step",
        "exposed_wait_us_per_step",
        "exposed_wait_share",
        "read_output_us_per_step",
        "wait_accepted_exposed_us",
        "step_ms_p50",
    )
    return {key: spread([r.get(key) for r in rounds]) for key in keys}
