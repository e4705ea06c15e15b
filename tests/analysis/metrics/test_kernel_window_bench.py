"""bench/bench_kernel_window.py's analysis on a hand-built trace with a kernel window: per phase,
the stage-slice, starvation-aware and kernel-union bubble ratios against a 1 µs bitmap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from analysis import load_trace
from bench.bench_kernel_window import build_parser, compare_window, engine_command, main
from tracekit.perfetto import write
from tracekit.recipes import KERNEL_STEPS
from tracekit.recipes import bitmap as _bitmap
from tracekit.recipes import lead_kernels as _kernels
from tracekit.recipes import lead_trace as _trace

WINDOW = f"{KERNEL_STEPS[0]}:{KERNEL_STEPS[-1] + 1}"


def _expected(truth: dict, kernels: bool) -> dict[str, float]:
    """Per phase: Σ idle / Σ span over the window's step spans (previous step's device end to
    its own; the window's first step from its own start)."""
    idle: dict[str, int] = {}
    span: dict[str, int] = {}
    for step in KERNEL_STEPS:
        a, b = truth["busy"][step]
        lo = a if step == KERNEL_STEPS[0] else truth["busy"][step - 1][1]
        kind = truth["kind"][step]
        busy = _kernels(kind, a, b) if kernels else [(a, b)]
        phase = "mixed" if kind == "mixed" else "decode_only"
        idle[phase] = idle.get(phase, 0) + int((~_bitmap(busy, lo, b)).sum())
        span[phase] = span.get(phase, 0) + b - lo
    return {p: idle[p] / span[p] for p in idle}


def test_compare_window_has_the_known_answers(tmp_path: Path) -> None:
    spec, truth = _trace(with_kernels=True)
    path = write(spec, tmp_path / "kw.pftrace")
    rows = {r["phase"]: r for r in compare_window(load_trace(path), WINDOW)}
    assert set(rows) == {"mixed", "decode_only"}
    slices, kernels = _expected(truth, False), _expected(truth, True)
    for phase, row in rows.items():
        assert row["bubble_ratio_slices"] == pytest.approx(slices[phase])
        assert row["bubble_ratio_kernels"] == pytest.approx(kernels[phase])
        assert row["error"] == pytest.approx(
            row["bubble_ratio_starvation_aware"] - row["bubble_ratio_kernels"]
        )
    # Decode forwards are not starved: the estimate is the stage-slice ratio.
    dec = rows["decode_only"]
    assert dec["bubble_ratio_starvation_aware"] == pytest.approx(dec["bubble_ratio_slices"])
    # Mixed forwards are starved: 2920 µs slices, 1200 µs predicted busy (800 + 25 * 16).
    mixed = rows["mixed"]
    n_mixed = sum(truth["kind"][s] == "mixed" for s in KERNEL_STEPS)
    hidden = n_mixed * (2920 - 1200)
    lo_spans = sum(
        truth["busy"][s][1] - truth["busy"][s - 1][1]
        for s in KERNEL_STEPS
        if truth["kind"][s] == "mixed"
    )
    assert mixed["bubble_ratio_starvation_aware"] == pytest.approx(
        mixed["bubble_ratio_slices"] + hidden / lo_spans
    )
    assert mixed["starved_steps_frac"] == 1.0 and dec["starved_steps_frac"] == 0.0
    assert mixed["launch_ms_p50"] == pytest.approx(3.1)


def test_main_writes_json_and_fails_outside_the_tolerance(tmp_path: Path) -> None:
    spec, _ = _trace(with_kernels=True)
    path = write(spec, tmp_path / "kw.pftrace")
    out = tmp_path / "kw.json"
    # Synthetic kernels fill 17% of a mixed slice (5 x 100 of 2920 µs), the estimate 41%: FAIL.
    assert main(["--trace-path", str(path), "--kernel-steps", WINDOW, "--out", str(out)]) == 1
    data = json.loads(out.read_text())
    assert data["kernel_steps"] == WINDOW and data["pass"] is False
    assert {r["phase"] for r in data["phases"]} == {"mixed", "decode_only"}


def test_a_trace_without_kernels_is_refused(tmp_path: Path) -> None:
    spec, _ = _trace()
    with pytest.raises(SystemExit, match="no gpu:<i> kernels"):
        compare_window(load_trace(write(spec, tmp_path / "k.pftrace")), WINDOW)


def test_the_engine_command_is_a_valid_stepscope_run() -> None:
    from engine.cli import build_parser as run_parser
    from engine.cli import config_from_args

    command = engine_command(build_parser().parse_args([]), "kw.pftrace")
    assert command[1:4] == ["-m", "stepscope.cli", "run"]
    argv = command[4:]
    config = config_from_args(run_parser().parse_args(argv))
    assert config.tracing.trace_kernel_steps is not None
    assert config.scheduler.max_num_seqs == 256
