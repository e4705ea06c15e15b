"""Per-request timing: the queued / prefill / decode slices of each request's track, and latency.

Owned by the engine loop: it is told when a request arrives, is first scheduled, gets tokens, and
finishes, and writes three slices on the track ``request <id>`` when the request ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.scheduler.request_output import RequestOutput
from engine.scheduler.step_outputs import StepOutputs
from instrument.schema import MIN_TPOT_TOKENS, tpot_ms, ttft_ms
from instrument.tracer import Tracer, now_ns

__all__ = ["RequestTiming", "RequestTimeline", "LatencySummary"]


@dataclass
class RequestTiming:
    arrival_ns: int
    first_scheduled_ns: int | None = None
    first_token_ns: int | None = None
    last_token_ns: int | None = None
    finished_ns: int | None = None
    num_output_tokens: int = 0

    @property
    def ttft_ms(self) -> float | None:
        """``instrument.schema.ttft_ms``: the analysis's definition (docs/design.md §5.9)."""
        if self.first_token_ns is None:
            return None
        return float(ttft_ms(self.arrival_ns, self.first_token_ns))

    @property
    def tpot_ms(self) -> float | None:
        """``instrument.schema.tpot_ms`` up to the finish (the end of the request's decode
        slice, as the analysis reads it); None before it finished or with fewer than two
        tokens."""
        first, finish = self.first_token_ns, self.finished_ns
        if self.num_output_tokens < MIN_TPOT_TOKENS or first is None or finish is None:
            return None
        return float(tpot_ms(first, finish, self.num_output_tokens))


@dataclass(frozen=True)
class LatencySummary:
    ttft_ms: dict[str, float] = field(default_factory=dict)  # p50 / p95 / p99
    tpot_ms: dict[str, float] = field(default_factory=dict)
    e2e_ms: dict[str, float] = field(default_factory=dict)


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values, dtype=np.float64)
    return {f"p{q}": float(np.percentile(arr, q)) for q in (50, 95, 99)}


class RequestTimeline:
    """Timestamps per request; writes the request's track slices when it finishes."""

    def __init__(self, tracer: Tracer, write_tracks: bool = True) -> None:
        self.tracer = tracer
        self.write_tracks = write_tracks
        self.timings: dict[str, RequestTiming] = {}

    def arrived(self, req_id: str, arrival_ns: int | None = None) -> None:
        self.timings[req_id] = RequestTiming(arrival_ns if arrival_ns is not None else now_ns())

    def scheduled(self, req_ids: list[str]) -> None:
        t = now_ns()
        for req_id in req_ids:
            timing = self.timings.get(req_id)
            if timing is not None and timing.first_scheduled_ns is None:
                timing.first_scheduled_ns = t

    def tokens(self, req_id: str, num_tokens: int, t_ns: int | None = None) -> None:
        """``num_tokens`` committed for the request at ``t_ns`` (default: now)."""
        timing = self.timings.get(req_id)
        if timing is None or num_tokens == 0:
            return
        t = t_ns if t_ns is not None else now_ns()
        if timing.first_token_ns is None:
            timing.first_token_ns = t
        timing.last_token_ns = t
        timing.num_output_tokens += num_tokens

    def committed(self, outputs: Sequence[RequestOutput]) -> None:
        """One update's outputs: ``tokens`` for each (one timestamp: they came back together),
        then ``finished`` for those that finished. A :class:`StepOutputs`' columns are read as
        columns (one token each, none finished)."""
        t = now_ns()
        timings = self.timings
        finished = []
        if isinstance(outputs, StepOutputs):
            for timing in map(timings.get, outputs.plain_req_ids):
                if timing is not None:
                    if timing.first_token_ns is None:
                        timing.first_token_ns = t
                    timing.last_token_ns = t
                    timing.num_output_tokens += 1
            outputs = outputs.explicit
        for o in outputs:  # ``tokens`` inlined: once per request per step
            timing = timings.get(o.req_id)
            num_tokens = len(o.new_token_ids)
            if timing is not None and num_tokens:
                if timing.first_token_ns is None:
                    timing.first_token_ns = t
                timing.last_token_ns = t
                timing.num_output_tokens += num_tokens
            if o.finished:
                finished.append(o.req_id)
        for req_id in finished:
            self.finished(req_id)

    def finished(self, req_id: str) -> None:
        timing = self.timings.get(req_id)
        if timing is None or timing.finished_ns is not None:
            return
        timing.finished_ns = now_ns()
        # Paused for a step the trace drops: a request spans many steps, its track is written.
        if self.write_tracks and (self.tracer.enabled or self.tracer.paused):
            self._write_track(req_id, timing)

    def _write_track(self, req_id: str, t: RequestTiming) -> None:
        """queued / prefill / decode on the request's track: one buffered tuple for the three."""
        assert t.finished_ns is not None
        scheduled = t.first_scheduled_ns if t.first_scheduled_ns is not None else t.finished_ns
        self.tracer.request_slices(
            req_id, t.arrival_ns, scheduled, t.first_token_ns, t.finished_ns, t.num_output_tokens
        )

    def summary(self) -> LatencySummary:
        done = [t for t in self.timings.values() if t.finished_ns is not None]
        ttft = [v for t in done if (v := t.ttft_ms) is not None]
        tpot = [v for t in done if (v := t.tpot_ms) is not None]
        e2e = [(t.finished_ns - t.arrival_ns) / 1e6 for t in done if t.finished_ns is not None]
        return LatencySummary(_percentiles(ttft), _percentiles(tpot), _percentiles(e2e))
