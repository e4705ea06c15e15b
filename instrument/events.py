"""The raw event tuples the tracer's hot path appends (plain tuples: cheap to build).

Kinds and layouts (``track`` is a thread ident (int), a track name (str), or None for the process
track):

* ``(EV_SLICE_AT, track, name, start_ns, end_ns, args)``: a complete slice. Spans append it when
  they end (one append per span); the writer emits its begin and end packets in time order.
* ``(EV_INSTANT, track, name, ts_ns, args | None)``
* ``(EV_COUNTER, name, ts_ns, value)``
* ``(EV_COUNTERS, names, ts_ns, values)``: one sample of several counters at one timestamp
  (tuples of equal length; the writer expands it into ``EV_COUNTER`` tuples in order:
  :func:`expand_counters`)
* ``(EV_SPAN, track, name, start_ns, end_ns, step | None, args | None)``: a hot-path span
  (:meth:`~instrument.tracer.Tracer.span_end`), its step apart so that the engine thread builds
  no dict for it; the writer expands it into an ``EV_SLICE_AT`` with args ``{step: step}`` then
  ``args`` (:func:`expand_span`).
* ``(EV_REQUEST, req_id, arrival_ns, scheduled_ns, first_token_ns | None, finished_ns,
  num_output_tokens)``: a finished request's ``queued`` / ``prefill`` / ``decode`` slices on its
  track, in one tuple (the writer expands it: :func:`expand_request`).

``args`` is the span's keyword dict; the reserved keys ``flow_in`` / ``flow_out`` (int flow ids)
become Perfetto flow ids rather than annotations.
"""

from __future__ import annotations

from typing import Any

from instrument.schema import Arg, RequestSlice, request_track_name

__all__ = [
    "EV_SLICE_AT",
    "EV_INSTANT",
    "EV_COUNTER",
    "EV_REQUEST",
    "EV_COUNTERS",
    "EV_SPAN",
    "FLOW_IN",
    "FLOW_OUT",
    "RawEvent",
    "expand_request",
    "expand_counters",
    "expand_span",
]

EV_SLICE_AT = 2
EV_INSTANT = 3
EV_COUNTER = 4
EV_REQUEST = 5
EV_COUNTERS = 6
EV_SPAN = 7

FLOW_IN = "flow_in"
FLOW_OUT = "flow_out"

RawEvent = tuple[Any, ...]


_STEP = Arg.STEP.value
_REQUEST_ID = Arg.REQUEST_ID.value
_NUM_OUTPUT_TOKENS = Arg.NUM_OUTPUT_TOKENS.value
_QUEUED, _PREFILL, _DECODE = (s.value for s in RequestSlice)


def expand_counters(event: RawEvent) -> list[RawEvent]:
    """An ``EV_COUNTERS`` tuple as one ``EV_COUNTER`` tuple per counter, in order."""
    _, names, ts, values = event
    if len(names) != len(values):
        raise ValueError(f"{len(names)} counter names for {len(values)} values")
    return [(EV_COUNTER, name, ts, value) for name, value in zip(names, values, strict=True)]


def expand_span(event: RawEvent) -> RawEvent:
    """An ``EV_SPAN`` tuple as its ``EV_SLICE_AT``: args ``{step: step}`` (none when the step is
    None), then the span's own args in their order (a new dict: the span's may be shared)."""
    _, track, name, start_ns, end_ns, step, args = event
    full: dict[str, object] = {} if step is None else {_STEP: step}
    if args:
        full.update(args)
    return (EV_SLICE_AT, track, name, start_ns, end_ns, full)


def expand_request(event: RawEvent) -> list[RawEvent]:
    """An ``EV_REQUEST`` tuple as its slices: ``queued`` (arrival -> first scheduled), then, once
    it has a first token, ``prefill`` (-> first token) and ``decode`` (-> finished)."""
    _, req_id, arrival, scheduled, first_token, finished, num_output_tokens = event
    track = request_track_name(req_id)
    out: list[RawEvent] = [(EV_SLICE_AT, track, _QUEUED, arrival, scheduled, {_REQUEST_ID: req_id})]
    if first_token is not None:
        out.append((EV_SLICE_AT, track, _PREFILL, scheduled, first_token, {_REQUEST_ID: req_id}))
        args = {_REQUEST_ID: req_id, _NUM_OUTPUT_TOKENS: num_output_tokens}
        out.append((EV_SLICE_AT, track, _DECODE, first_token, finished, args))
    return out
