"""Every metric split by step phase, on a synthetic trace whose per-phase answers are known."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from analysis import analyze_trace
from analysis.metrics.phases import step_phase
from tracekit.perfetto import TraceSpec, write

US = 1_000

# phase: (num_prefill, num_decode, num_spec_tokens, forward start offset in µs); each step is
# 1000 µs, schedule runs at 100..300 µs, the forward from the offset to the step's end.
PLAN = {
    "decode_only": (0, 8, 0, 0),  # schedule fully hidden, no idle
    "prefill_only": (2, 0, 0, 300),  # schedule fully exposed, 300 µs idle
    "mixed": (1, 7, 0, 200),  # half hidden, 200 µs idle
    "spec_verify": (0, 8, 16, 0),  # drafts verified: spec wins whatever else the step does
}
EXPECTED = {  # phase: (overlap, idle µs per step)
    "decode_only": (1.0, 0),
    "prefill_only": (0.0, 300),
    "mixed": (0.5, 200),
    "spec_verify": (1.0, 0),
}
ORDER = ["decode_only", "prefill_only", "decode_only", "mixed", "spec_verify", "decode_only"]


def _trace(repeats: int) -> TraceSpec:
    t = TraceSpec()
    step = 0
    for _ in range(repeats):
        for phase in ORDER:
            prefill, decode, spec, fwd = PLAN[phase]
            base = step * 1000 * US
            args = {"num_reqs": prefill + decode, "num_tokens": prefill * 64 + decode}
            args |= {"num_prefill": prefill, "num_decode": decode, "num_spec_tokens": spec}
            t.cpu("schedule", base + 100 * US, base + 300 * US, step=step, **args)
            t.gpu("forward", base + fwd * US, base + 1000 * US, step=step)
            step += 1
    return t


def test_phase_table_has_the_known_answers(tmp_path: Path) -> None:
    repeats = 10
    path = write(_trace(repeats), tmp_path / "t.pftrace")
    report = analyze_trace(path, window="all", skip_steps=0)
    table = report.tables["phases"].set_index("phase")
    assert list(table.index) == ["prefill_only", "mixed", "decode_only", "spec_verify"]
    counts = pd.Series(ORDER).value_counts() * repeats
    for phase, (overlap, idle_us) in EXPECTED.items():
        row = table.loc[phase]
        assert row["num_steps"] == counts[phase]
        assert row["overlap"] == pytest.approx(overlap)
        assert row["idle_ns"] == idle_us * US * counts[phase]
        # Cadence runs from each step's first slice (schedule or forward): 1 ms ± 0.2 ms here.
        assert row["step_ms_mean"] == pytest.approx(1.0, abs=0.2)
        assert row["bubble_ratio"] == pytest.approx(idle_us / 1000, abs=0.1)
    assert report.extra["phases"]["mixed"]["overlap"] == pytest.approx(0.5)
    # The phases add up to the whole.
    assert table["idle_ns"].sum() == report.tables["bubbles"]["dur_ns"].sum()


@pytest.mark.parametrize(
    ("prefill", "decode", "spec", "phase"),
    [
        (2, 0, 0, "prefill_only"),
        (1, 3, 0, "mixed"),
        (0, 3, 0, "decode_only"),
        (1, 3, 4, "spec_verify"),
        (None, None, None, "unknown"),
    ],
)
def test_step_phase(prefill: int | None, decode: int | None, spec: int | None, phase: str) -> None:
    steps = pd.DataFrame(
        {
            "num_prefill": pd.array([prefill], dtype="Int64"),
            "num_decode": pd.array([decode], dtype="Int64"),
            "num_spec_tokens": pd.array([spec], dtype="Int64"),
        }
    )
    assert step_phase(steps).tolist() == [phase]
