"""Plain-words verdicts from the headline numbers, most important first."""

from __future__ import annotations

from typing import Any

from analysis.frames import TraceFrames

__all__ = ["verdicts"]


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _grammar(headline: dict[str, Any]) -> str:
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


def verdicts(headline: dict[str, Any], frames: TraceFrames, extra: dict[str, Any]) -> list[str]:
    """Sentences a person reads before any table."""
    out: list[str] = []
    if not headline["window"]["duration_ms"]:
        out.append(
            "The trace has no device compute slices: overlap and bubbles cannot be measured."
        )
    overlap, top = headline["overlap"], headline["top_blame"]
    blame = f"; {_pct(top['share'])} of device idle time is blamed on {top['label']}" if top else ""
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
        out.append(
            f"The device idles {_pct(headline['bubble_ratio'])} of the window ({b['count']} bubbles, {b['idle_ms']:.2f} ms)."
        )
    total = headline["wait_accepted_total_us"]
    if total:
        exposed = headline["wait_accepted_exposed_us"]
        out.append(
            f"Waiting for accepted counts took {total / 1e3:.2f} ms; {exposed / 1e3:.2f} ms of it "
            f"({_pct(exposed / total)}) left the device idle (recoverable)."
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
    interrupted = frames.metadata.get("interrupted")
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
