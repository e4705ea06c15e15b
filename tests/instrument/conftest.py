"""Helpers to read a written trace back into plain records for assertions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from instrument.readback import read_packets

TE = pb.TrackEvent


@dataclass
class Event:
    track: str
    type: int
    name: str
    ts: int
    args: dict[str, Any] = field(default_factory=dict)
    flow_ids: list[int] = field(default_factory=list)
    terminating_flow_ids: list[int] = field(default_factory=list)
    counter: float | None = None
    track_uuid: int = 0  # two tracks may share a name (one device lane's two streams)


@dataclass
class ReadTrace:
    tracks: dict[int, str]  # uuid -> display name
    events: list[Event]
    truncated_bytes: int

    def slices(self) -> list[tuple[str, str, int, int, dict[str, Any]]]:
        """(track, name, start, end, args), paired per track (by uuid, as Perfetto does) by a
        stack, in time order."""
        out = []
        stacks: dict[int, list[Event]] = {}
        for ev in sorted(self.events, key=lambda e: e.ts):
            if ev.type == TE.TYPE_SLICE_BEGIN:
                stacks.setdefault(ev.track_uuid, []).append(ev)
            elif ev.type == TE.TYPE_SLICE_END:
                begin = stacks[ev.track_uuid].pop()
                out.append((ev.track, begin.name, begin.ts, ev.ts, begin.args))
        return out


def _value(ann: Any) -> Any:
    kind = ann.WhichOneof("value")
    return getattr(ann, kind) if kind else None


def read_trace(path: str) -> ReadTrace:
    scan = read_packets(path)
    tracks: dict[int, str] = {}
    events: list[Event] = []
    for packet in scan.packets:
        if packet.HasField("track_descriptor"):
            d = packet.track_descriptor
            if d.HasField("thread"):
                tracks[d.uuid] = d.thread.thread_name
            elif d.HasField("process"):
                tracks[d.uuid] = "process:" + d.process.process_name
            else:
                tracks[d.uuid] = d.name
        if packet.HasField("track_event"):
            te = packet.track_event
            assert te.track_uuid in tracks, f"event on undeclared track {te.track_uuid}"
            events.append(
                Event(
                    track=tracks[te.track_uuid],
                    track_uuid=te.track_uuid,
                    type=te.type,
                    name=te.name,
                    ts=packet.timestamp,
                    args={a.name: _value(a) for a in te.debug_annotations},
                    flow_ids=list(te.flow_ids),
                    terminating_flow_ids=list(te.terminating_flow_ids),
                    counter=te.double_counter_value if te.type == TE.TYPE_COUNTER else None,
                )
            )
    return ReadTrace(tracks, events, scan.truncated_bytes)


@pytest.fixture
def reader():
    return read_trace
