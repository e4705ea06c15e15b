"""The raw events the tracer's hot path records, and the flat buffer that holds them.

The tracer's buffer is flat: each event is its kind followed by its fields, one after another
(``buffer.extend((EV_SPAN, track, name, ...))``), never a tuple that lives on. A tuple held in the
buffer until the next flush is a container the cyclic garbage collector counts: ~20 of them a
traced step made the engine thread run ~20% more gen-0 collections on the H200 (docs/design.md
§4.9, "Flat buffer").
:func:`unflatten` turns a flat batch back into tuples on the writer's side; ``ARITY`` gives each
kind's number of fields.

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
* ``(EV_STAGE, track, name, start_ns, end_ns, site_args, own_args | None, step, host_end_ns)``: a
  device stage's slice (``instrument.device_timeline``), without a dict of its own: the writer
  expands it into an ``EV_SLICE_AT`` with args ``site_args`` (shared, never changed), then
  ``own_args``, ``step`` and ``host_end_ns`` (:func:`expand_stage`).

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
    "EV_STAGE",
    "ARITY",
    "FLOW_IN",
    "FLOW_OUT",
    "RawEvent",
    "expand_request",
    "expand_counters",
    "expand_span",
    "expand_stage",
    "flatten",
    "unflatten",
]

EV_SLICE_AT = 2
EV_INSTANT = 3
EV_COUNTER = 4
EV_REQUEST = 5
EV_COUNTERS = 6
EV_SPAN = 7
EV_STAGE = 8

# Fields after the kind, per kind: a flat buffer is read back by these.
ARITY = {
    EV_SLICE_AT: 5,
    EV_INSTANT: 4,
    EV_COUNTER: 3,
    EV_REQUEST: 6,
    EV_COUNTERS: 3,
    EV_SPAN: 6,
    EV_STAGE: 8,
}

FLOW_IN = "flow_in"
FLOW_OUT = "flow_out"

RawEvent = tuple[Any, ...]


_STEP = Arg.STEP.value
_HOST_END_NS = Arg.HOST_END_NS.value
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


def expand_stage(event: RawEvent) -> RawEvent:
    """An ``EV_STAGE`` tuple as its ``EV_SLICE_AT``: args the site's, then the stage's own, then
    ``step`` and ``host_end_ns`` (the order ``DeviceTimeline`` wrote them in as a dict)."""
    _, track, name, start_ns, end_ns, site_args, own, step, host_end_ns = event
    args = {**site_args, **own} if own else dict(site_args)
    args[_STEP] = step
    args[_HOST_END_NS] = host_end_ns
    return (EV_SLICE_AT, track, name, start_ns, end_ns, args)


def flatten(events: list[RawEvent]) -> list[Any]:
    """Event tuples as a flat batch (what the tracer's buffer holds)."""
    return [field for event in events for field in event]


def unflatten(flat: list[Any]) -> list[RawEvent]:
    """A flat batch as event tuples. An unknown kind is an error; an event cut short at the end
    (a batch whose sender died mid-event) is left out."""
    out: list[RawEvent] = []
    i, n = 0, len(flat)
    while i < n:
        kind = flat[i]
        arity = ARITY.get(kind) if type(kind) is int else None
        if arity is None:
            raise ValueError(f"unknown raw event kind {kind!r} at item {i} of a flat batch")
        j = i + 1 + arity
        if j > n:
            break
        out.append(tuple(flat[i:j]))
        i = j
    return out
