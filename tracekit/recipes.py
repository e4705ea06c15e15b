"""Shared trace recipes: hand-built traces whose answers the tests work out independently.

- ``lead_trace``: an async loop of ``PATTERN`` steps (decode-heavy and one starved ``mixed``
  step), with or without ``host_end_ns`` and CUPTI kernels in ``KERNEL_STEPS``; returns the
  spec and the truth (busy intervals, lead per step, kernel busy) in µs;
- ``blocked_trace``: async on, but scheduling and accepted-count waits leave the device idle;
- ``bitmap``: a 1 µs bitmap of intervals, the brute-force reference for unions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tracekit.perfetto import TraceSpec

S = 1000  # ns per µs in blocked_trace

US = 1_000
PERIOD = 4000  # µs per step
PATTERN = ("d8", "d16", "d24", "mixed")
REPEATS = 6
KERNEL_STEPS = range(8, 16)


def lead_step(kind: str) -> dict[str, Any]:
    """Times in µs from the step's base: launch end, forward [start, end), host end, tokens."""
    if kind == "mixed":  # the host launches slower than the device runs: starved
        return {"tokens": 16, "prefill": 1, "decode": 7, "launch_end": 3400, "fwd": (500, 3420)}
    tokens = int(kind[1:])
    return {
        "tokens": tokens,
        "prefill": 0,
        "decode": tokens,
        "launch_end": 400,
        "fwd": (500, 500 + 800 + 25 * tokens),
    }  # busy = 800 + 25 * tokens µs


def lead_kernels(kind: str, start: int, end: int) -> list[tuple[int, int]]:
    if kind == "mixed":  # five 100 µs kernels spread over the starved slice
        gap = (end - start) // 5
        return [(start + i * gap, start + i * gap + 100) for i in range(5)]
    return [(start, start + int(0.9 * (end - start)))]


def lead_trace(with_lead: bool = True, with_kernels: bool = False) -> tuple[TraceSpec, dict]:
    t = TraceSpec()
    truth: dict[str, list] = {"busy": [], "lead": [], "kind": [], "kernel_busy": []}
    for step in range(len(PATTERN) * REPEATS):
        kind = PATTERN[step % len(PATTERN)]
        s = lead_step(kind)
        base = (step + 1) * PERIOD
        args = {"num_reqs": s["prefill"] + s["decode"], "num_tokens": s["tokens"]}
        args |= {"num_prefill": s["prefill"], "num_decode": s["decode"], "num_spec_tokens": 0}
        # Async: step N's schedule runs under forward N-1 (base - PERIOD + 500 onwards).
        sched = base - PERIOD + 700
        t.cpu("schedule", sched * US, (sched + 300) * US, step=step, **args)
        t.cpu("launch", (base + 300) * US, (base + s["launch_end"]) * US, step=step)
        f0, f1 = base + s["fwd"][0], base + s["fwd"][1]
        host_end = base + s["launch_end"]
        extra = {"host_end_ns": host_end * US} if with_lead else {}
        t.gpu("forward", f0 * US, f1 * US, step=step, **extra)
        truth["busy"].append((f0, f1))
        truth["lead"].append(f1 - host_end)
        truth["kind"].append(kind)
        kern = lead_kernels(kind, f0, f1) if with_kernels and step in KERNEL_STEPS else [(f0, f1)]
        truth["kernel_busy"] += kern
        if with_kernels and step in KERNEL_STEPS:
            for k0, k1 in kern:
                t.slices.append(
                    (
                        "gpu:0 kernels",
                        "gemm",
                        k0 * US,
                        k1 * US,
                        {"step": step, "stage": "forward", "activity": "kernel"},
                    )
                )
            # A copy before the forward: copy work, never compute busy.
            t.slices.append(
                (
                    "gpu:0 kernels",
                    "Memcpy HtoD",
                    (f0 - 300) * US,
                    (f0 - 100) * US,
                    {"step": step, "stage": "h2d_inputs", "activity": "memcpy"},
                )
            )
    return t, truth


def bitmap(intervals: list[tuple[int, int]], lo: int, hi: int) -> np.ndarray:
    bits = np.zeros(hi - lo, dtype=bool)
    for a, b in intervals:
        bits[max(a, lo) - lo : min(b, hi) - lo] = True
    return bits


def blocked_trace() -> TraceSpec:
    """Async on, but scheduling and accepted-count waits leave the device idle.

    Device: [100,200) [300,400) [500,600). Idle in window [100,600): [200,300) + [400,500).
    """
    t = TraceSpec()
    for step, (a, b) in enumerate([(40, 205), (205, 330), (330, 600)], start=1):
        t.cpu("step", a * S, b * S, step=step)
    t.cpu("schedule", 50 * S, 150 * S, step=1, num_tokens=8)
    t.cpu("schedule", 210 * S, 260 * S, step=2, num_tokens=8)
    t.cpu("schedule", 380 * S, 420 * S, step=3, num_tokens=8)
    t.cpu("wait_output", 260 * S, 320 * S, step=2, kind="accepted_count")
    t.cpu("wait_output", 420 * S, 500 * S, step=3, kind="accepted_count")
    for step, a in enumerate([100, 300, 500], start=1):
        t.gpu("forward", a * S, (a + 100) * S, step=step)
    t.slices += [
        ("request r1", "queued", 0, 50 * S, {"request_id": "r1"}),
        ("request r1", "prefill", 50 * S, 150 * S, {"request_id": "r1"}),
        ("request r1", "decode", 150 * S, 450 * S, {"request_id": "r1", "num_output_tokens": 4}),
    ]
    t.instants += [
        (None, "engine_config", 0, {"model": "tiny", "async_scheduling": True}),
        (
            None,
            "feature_decision",
            1,
            {"feature": "async_scheduling", "requested": True, "resolved": True, "reason": "asked"},
        ),
        (
            None,
            "feature_decision",
            2,
            {
                "feature": "cuda_graphs",
                "requested": "None",
                "resolved": False,
                "reason": "cpu device",
            },
        ),
        (
            None,
            "feature_decision",
            3,
            {"feature": "triton", "requested": True, "resolved": False, "reason": ""},
        ),
        (
            "engine-core",
            "sync",
            250 * S,
            {"op": "item", "where": "a.py:3", "stack": "", "hot": True},
        ),
        (
            "engine-core",
            "sync",
            10 * S,
            {"op": "item", "where": "a.py:3", "stack": "", "hot": True},
        ),
        (
            "engine-core",
            "sync",
            260 * S,
            {"op": "tolist", "where": "b.py:9", "stack": "", "hot": False},
        ),
    ]
    return t
