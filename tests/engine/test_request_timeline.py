"""RequestTimeline: one update's outputs at once book the same as request by request."""

from __future__ import annotations

from engine.request_timeline import RequestTimeline
from engine.scheduler.request_output import RequestOutput
from instrument.tracer import Tracer, now_ns


def test_committed_books_tokens_then_finishes() -> None:
    timeline = RequestTimeline(Tracer(None, enabled=False))
    for req_id in ("a", "b", "c"):
        timeline.arrived(req_id, arrival_ns=0)
    timeline.committed(
        [
            RequestOutput("a", [5]),
            RequestOutput("b", [6, 7], finished=True, finish_reason="stop"),
            RequestOutput("c", []),  # nothing new: no first token yet
            RequestOutput("unknown", [1]),  # not tracked (e.g. its grammar failed): ignored
        ]
    )
    a, b, c = (timeline.timings[r] for r in "abc")
    assert a.num_output_tokens == 1 and a.finished_ns is None
    assert b.num_output_tokens == 2 and b.finished_ns is not None
    assert a.first_token_ns == b.first_token_ns == b.last_token_ns  # one update, one timestamp
    assert b.finished_ns >= b.last_token_ns
    assert c.first_token_ns is None and c.num_output_tokens == 0
    timeline.committed([RequestOutput("a", [8], finished=True, finish_reason="length")])
    assert a.num_output_tokens == 2 and a.last_token_ns >= a.first_token_ns
    assert a.finished_ns is not None and timeline.summary().e2e_ms


def test_run_summary_latency_is_the_analysis_latency(tmp_path) -> None:
    """The run summary's TTFT/TPOT and ``analysis.metrics.latency`` read the same requests the same way
    (one definition, ``instrument.schema.ttft_ms`` / ``tpot_ms``, docs/design.md §5.9): per
    request from the timeline, and as percentiles from the trace it wrote."""
    import numpy as np

    from analysis import load_trace
    from analysis.metrics.latency import request_latency

    path = tmp_path / "requests.pftrace"
    tracer = Tracer(path)
    timeline = RequestTimeline(tracer)
    t0 = now_ns() - 1_000_000_000  # every token in the past: finished() stamps now
    plan = {"a": (0, [(5, 1), (9, 1), (20, 2)]), "b": (3, [(8, 3)]), "c": (4, [(12, 1)])}
    for req_id, (arrival_ms, _) in plan.items():
        timeline.arrived(req_id, arrival_ns=t0 + arrival_ms * 1_000_000)
        timeline.timings[req_id].first_scheduled_ns = t0 + (arrival_ms + 1) * 1_000_000
    for req_id, (_, tokens) in plan.items():
        for t_ms, n in tokens:
            timeline.tokens(req_id, n, t0 + t_ms * 1_000_000)
        timeline.finished(req_id)
    tracer.close()
    got = request_latency(load_trace(path).slices).set_index("request_id")
    for req_id, timing in timeline.timings.items():
        assert got.loc[req_id, "ttft_ms"] == timing.ttft_ms
        expected_tpot = np.nan if timing.tpot_ms is None else timing.tpot_ms
        np.testing.assert_equal(got.loc[req_id, "tpot_ms"], expected_tpot)
    summary = timeline.summary()
    for q in (50, 95, 99):
        assert summary.ttft_ms[f"p{q}"] == np.percentile(got["ttft_ms"], q)
        assert summary.tpot_ms[f"p{q}"] == np.percentile(got["tpot_ms"].dropna(), q)
    assert got["tpot_ms"].isna().sum() == 1  # "c": one token, no TPOT
