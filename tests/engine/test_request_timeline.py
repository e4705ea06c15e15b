"""RequestTimeline: one update's outputs at once book the same as request by request."""

from __future__ import annotations

from engine.request_timeline import RequestTimeline
from engine.scheduler.request_output import RequestOutput
from instrument.tracer import Tracer


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
