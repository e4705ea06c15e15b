"""The raw event tuples the tracer's hot path appends (plain tuples: cheap to build).

Kinds and layouts (``track`` is a thread ident (int), a track name (str), or None for the process
track):

* ``(EV_SLICE_AT, track, name, start_ns, end_ns, args)``: a complete slice. Spans append it when
  they end (one append per span); the writer emits its begin and end packets in time order.
* ``(EV_INSTANT, track, name, ts_ns, args | None)``
* ``(EV_COUNTER, name, ts_ns, value)``

``args`` is the span's keyword dict; the reserved keys ``flow_in`` / ``flow_out`` (int flow ids)
become Perfetto flow ids rather than annotations.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EV_SLICE_AT", "EV_INSTANT", "EV_COUNTER", "FLOW_IN", "FLOW_OUT", "RawEvent"]

EV_SLICE_AT = 2
EV_INSTANT = 3
EV_COUNTER = 4

FLOW_IN = "flow_in"
FLOW_OUT = "flow_out"

RawEvent = tuple[Any, ...]
