"""A request is counted wherever the trace holds it, also when warm-up hid its prefill (issue 18).

Hand-built trace (times in µs): r1 whole; r2's prefill left out (queued + decode kept); r3 only
a decode slice; r4 only queued (aborted before any token: not a latency row).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from analysis import analyze_trace
from tests.analysis.tracegen import TraceSpec, write

S = 1000


def _trace() -> TraceSpec:
    t = TraceSpec()
    for step in range(1, 4):
        t.gpu("forward", step * 100 * S, (step + 1) * 100 * S, step=step)
        t.cpu("schedule", (step * 100 + 10) * S, (step * 100 + 40) * S, step=step)
    r = "request "
    t.slices += [
        (r + "r1", "queued", 0, 50 * S, {"request_id": "r1"}),
        (r + "r1", "prefill", 50 * S, 150 * S, {"request_id": "r1"}),
        (r + "r1", "decode", 150 * S, 450 * S, {"request_id": "r1", "num_output_tokens": 4}),
        (r + "r2", "queued", 10 * S, 30 * S, {"request_id": "r2"}),
        (r + "r2", "decode", 200 * S, 400 * S, {"request_id": "r2", "num_output_tokens": 3}),
        (r + "r3", "decode", 220 * S, 380 * S, {"request_id": "r3", "num_output_tokens": 2}),
        (r + "r4", "queued", 5 * S, 90 * S, {"request_id": "r4"}),
    ]
    return t


def test_hidden_prefill_counted_with_a_note(tmp_path: Path) -> None:
    report = analyze_trace(write(_trace(), tmp_path / "t.pftrace"), skip_steps=0)
    lat = report.tables["latency"].set_index("request_id")
    assert list(lat.index) == ["r1", "r2", "r3"]
    assert lat["prefill_hidden"].tolist() == [False, True, True]
    assert lat.loc["r1", "ttft_ms"] == pytest.approx(0.150)
    assert lat.loc["r1", "tpot_ms"] == pytest.approx(0.100)
    assert lat.loc["r1", "e2e_ms"] == pytest.approx(0.450)
    assert math.isnan(lat.loc["r2", "ttft_ms"]) and math.isnan(lat.loc["r2", "tpot_ms"])
    assert lat.loc["r2", "e2e_ms"] == pytest.approx(0.390)  # its arrival (queued) is in the trace
    assert math.isnan(lat.loc["r3", "e2e_ms"])  # neither arrival nor first token seen
    assert lat["num_output_tokens"].tolist() == [4, 3, 2]
    assert report.headline["ttft_ms"]["count"] == 1
    assert report.extra["requests"] == {"count": 3, "prefill_hidden": 2}
    assert "3 requests: TTFT p50 0.15 ms" in " ".join(report.verdicts)
    assert any(
        "2 request(s) prefilled in steps left out of the trace" in v for v in report.verdicts
    )
