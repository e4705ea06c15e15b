"""Plain-words verdicts from the headline numbers, most important first."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from analysis.frames import ROLE_COMPUTE, TraceFrames
from instrument.schema import Arg

__all__ = ["verdicts", "pct"]


def pct(x: float) -> str:
    """A percentage with the precision that shows it: ``37%``, ``0.24%``, ``99.8%``; ``0%`` and
    ``100%`` only when exact."""
    p = 100 * float(x)
    if p in (0.0, 100.0) or 1 <= p <= 99:
        return f"{p:.0f}%"
    if p < 1:
        return np.format_float_positional(p, precision=2, fractional=False, trim="-") + "%"
    digits = 1
    while round(p, digits) >= 100 and digits < 6:
        digits += 1
    return f"{p:.{digits}f}%"


_pct = pct


def _duration(us: float) -> str:
    """``1.23 ms``, or ``4.5 µs`` below a millisecond (so a short wait does not print 0.00 ms)."""
    return f"{us / 1e3:.2f} ms" if us >= 1000 else f"{us:.1f} µs"


def _grammar(headline: Mapping[str, Any]) -> str:
    """The grammar-work sentence (structured output), or "" when the trace has no grammar work."""
    mask_ms, wait_us = headline["grammar_mask_ms"], headline["grammar_wait_total_us"]
    parts = []
    if mask_ms:
        parts.append(
            f"{_pct(headline['grammar_hidden_frac'])} of {mask_ms:.2f} ms hidden under device work"
        )
    if headline["grammar_overlap_steps_frac"] is not None:
        frac = _pct(headline["grammar_overlap_steps_frac"])
        parts.append(
            f"device work began before the step's mask was built in {frac} of masked steps"
        )
    if wait_us:
        exposed_ms = headline["grammar_wait_exposed_us"] / 1e3
        parts.append(f"{exposed_ms:.2f} ms of {wait_us / 1e3:.2f} ms grammar wait exposed")
    return "Grammar work: " + "; ".join(parts) + "." if parts else ""


def _empty_window(window: dict[str, Any], frames: TraceFrames) -> str:
    """Why nothing can be measured, and how to widen the window when the trace has device work."""
    num_compute = int((frames.slices["role"] == ROLE_COMPUTE).sum())
    if not num_compute:
        return "The trace has no device compute slices: overlap and bubbles cannot be measured."
    steps = (
        f"steps {window['first_step']}..{window['last_step']}"
        if window["num_steps"]
        else "the window"
    )
    return (
        f"The measured window ({steps}) holds none of the trace's {num_compute} device compute "
        "slices: overlap and bubbles cannot be measured; widen it with --window all "
        "--skip-steps 0 (or --window A:B)."
    )


def _device_part(extra: dict[str, Any], total_us: float) -> str:
    """How much of the accepted-count wait came before its step's output reached the host
    (``device_wait``, §5.5), ending the sentence; a plain ``.`` without copy slices."""
    kinds = (extra.get("output_wait") or {}).get("by_kind") or {}
    device = (kinds.get("accepted_count") or {}).get("device_wait_us")
    if device is None:
        return "."
    part = f"; {_duration(device)} of the wait came before the step's output reached the host"
    if device < 0.05 * total_us:
        return part + ": the rest is host work reading the output, not a wait for the device."
    return part + "."


def verdicts(headline: Mapping[str, Any], frames: TraceFrames, extra: dict[str, Any]) -> list[str]:
    """Sentences a person reads before any table."""
    out: list[str] = []
    if not headline["window"]["duration_ms"]:
        out.append(_empty_window(headline["window"], frames))
    overlap, top = headline["overlap"], headline["top_blame"]
    blame = (
        f"; {_pct(top['share'])} of compute idle time is blamed on {top['label']}" if top else ""
    )
    for row in headline["ineffective"]:
        out.append(
            f"{row['feature']} is on but hides only {_pct(row['overlap'])} of CPU scheduling{blame}."
        )
    if not headline["ineffective"] and overlap is not None:
        out.append(f"CPU scheduling is {_pct(overlap)} hidden under device work{blame}.")
    elif overlap is None:
        out.append(
            "No schedule/prepare_inputs slices: overlap cannot be measured"
            + (blame + "." if blame else ".")
        )
    if headline["bubble_ratio"] is not None:
        b = headline["bubbles"]
        device = headline.get("device_idle_ratio")
        both = (
            f"; device idle (no kernel and no copy): {_pct(device)}" if device is not None else ""
        )
        out.append(
            f"Compute idle (no compute kernel running): {_pct(headline['bubble_ratio'])} of the "
            f"window ({b['count']} bubbles, {b['idle_ms']:.2f} ms){both}."
        )
    total = headline["wait_accepted_total_us"]
    if total:
        exposed = headline["wait_accepted_exposed_us"]
        out.append(
            f"Waiting for accepted counts took {_duration(total)}; {_duration(exposed)} of it "
            f"({_pct(exposed / total)}) left the device idle (recoverable)"
            + _device_part(extra, total)
        )
    grammar = _grammar(headline)
    if grammar:
        out.append(grammar)
    for row in headline["silent_fallbacks"]:
        out.append(f"Silent fallback: {row['feature']} {row['why']}.")
    if headline["hot_syncs"]:
        out.append(
            f"{headline['hot_syncs']} host-device syncs on the hot path after warm-up (defects)."
        )
    requests = extra.get("requests", {})
    hidden = requests.get("prefill_hidden", 0)
    if headline["ttft_ms"]["count"]:
        t, p = headline["ttft_ms"], headline["tpot_ms"]
        tpot = f", TPOT p50 {p['p50']:.2f} ms" if p["count"] else ""
        total = requests.get("count", t["count"])
        out.append(
            f"{total} requests: TTFT p50 {t['p50']:.2f} ms / p99 {t['p99']:.2f} ms{tpot}"
            + (f" (TTFT of {t['count']})." if hidden else ".")
        )
    if hidden:
        out.append(
            f"{hidden} request(s) prefilled in steps left out of the trace (warm-up, step range "
            "or sampling): counted, but without TTFT/TPOT (use --trace-warmup to see them)."
        )
    interrupted = frames.metadata.get(Arg.INTERRUPTED.value)
    if interrupted:
        out.append(
            f"The run was interrupted by {interrupted}: requests in flight were aborted and "
            "later arrivals never ran."
        )
    dropped = frames.metadata.get("bytes_dropped", 0)
    if dropped:
        out.append(
            f"The trace was cut off: {dropped} bytes at the end were unreadable and skipped."
        )
    return out
