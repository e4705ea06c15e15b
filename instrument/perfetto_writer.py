"""Turns the tracer's raw event tuples into streamed Perfetto protobuf packets.

Runs off the hot path (the tracer's flush thread, or at close). Each flush appends whole
``TracePacket`` records to the file and flushes it, so a killed process leaves a trace that loads up
to the last flush (at worst with one truncated packet at the tail, which readers skip).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import IO, Any

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
from perfetto.trace_builder.proto_builder import StreamingTraceProtoBuilder

from instrument.events import EV_COUNTER, EV_INSTANT, EV_SLICE_AT, FLOW_IN, FLOW_OUT, RawEvent
from instrument.schema import PROCESS_NAME

__all__ = ["PerfettoWriter", "set_annotation"]

_TRACK_EVENT = pb.TrackEvent
_SEQ_ID = 0x5753  # one writer per file: a fixed trusted sequence id


def set_annotation(ann: Any, key: str, value: object) -> None:
    """Fill one ``DebugAnnotation`` with a typed value (bool before int: bool is an int)."""
    ann.name = key
    if isinstance(value, bool):
        ann.bool_value = value
    elif isinstance(value, int):
        ann.int_value = value
    elif isinstance(value, float):
        ann.double_value = value
    elif value is None:
        ann.string_value = "None"
    else:
        ann.string_value = str(value)


class PerfettoWriter:
    """Owns the output file and the uuid of every track it has described.

    Tracks are described lazily the first time an event names them: thread tracks by thread
    ident, named tracks (device lanes, requests) by name, counter tracks by counter name.
    """

    def __init__(self, path: str | os.PathLike[str], process_name: str = PROCESS_NAME) -> None:
        self.path = os.fspath(path)
        self._file: IO[bytes] | None = open(self.path, "wb")
        self._builder = StreamingTraceProtoBuilder(self._file)
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._next_uuid = (self._pid << 20) + 1
        self._process_uuid = self._take_uuid()
        self._thread_uuids: dict[int, int] = {}
        self._named_uuids: dict[str, int] = {}
        self._counter_uuids: dict[str, int] = {}
        self._first_packet = True
        self.num_packets = 0
        self._describe_process(process_name)

    def _take_uuid(self) -> int:
        uuid = self._next_uuid
        self._next_uuid += 1
        return uuid

    def _packet(self) -> Any:
        packet = self._builder.create_packet()
        packet.trusted_packet_sequence_id = _SEQ_ID
        if self._first_packet:
            packet.sequence_flags = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
            self._first_packet = False
        return packet

    def _emit(self, packet: Any) -> None:
        self._builder.write_packet(packet)
        self.num_packets += 1

    def _describe_process(self, name: str) -> None:
        packet = self._packet()
        desc = packet.track_descriptor
        desc.uuid = self._process_uuid
        desc.process.pid = self._pid
        desc.process.process_name = name
        self._emit(packet)

    def _thread_track(self, ident: int, name: str, native_id: int) -> int:
        uuid = self._thread_uuids.get(ident)
        if uuid is None:
            uuid = self._take_uuid()
            self._thread_uuids[ident] = uuid
            packet = self._packet()
            desc = packet.track_descriptor
            desc.uuid = uuid
            desc.parent_uuid = self._process_uuid
            desc.thread.pid = self._pid
            desc.thread.tid = native_id
            desc.thread.thread_name = name
            self._emit(packet)
        return uuid

    def _named_track(self, name: str) -> int:
        uuid = self._named_uuids.get(name)
        if uuid is None:
            uuid = self._take_uuid()
            self._named_uuids[name] = uuid
            packet = self._packet()
            desc = packet.track_descriptor
            desc.uuid = uuid
            desc.parent_uuid = self._process_uuid
            desc.name = name
            self._emit(packet)
        return uuid

    def _counter_track(self, name: str) -> int:
        uuid = self._counter_uuids.get(name)
        if uuid is None:
            uuid = self._take_uuid()
            self._counter_uuids[name] = uuid
            packet = self._packet()
            desc = packet.track_descriptor
            desc.uuid = uuid
            desc.parent_uuid = self._process_uuid
            desc.name = name
            desc.counter.SetInParent()
            self._emit(packet)
        return uuid

    def track_uuid(self, track: int | str | None, thread_names: dict[int, tuple[str, int]]) -> int:
        """Resolve a raw event's track key: a thread ident, a track name, or None (process)."""
        if track is None:
            return self._process_uuid
        if isinstance(track, str):
            return self._named_track(track)
        name, native_id = thread_names.get(track, (f"thread-{track}", track))
        return self._thread_track(track, name, native_id)

    def write(self, events: Iterable[RawEvent], thread_names: dict[int, tuple[str, int]]) -> None:
        """Convert and append a batch of raw events in time order; flushes the file afterwards.

        Complete slices become a begin and an end packet. Within a batch, packets are ordered by
        time; at equal times ends come before begins and longer slices begin first, so nesting
        survives coarse clocks. Readers sort across batches by timestamp.
        """
        keyed: list[tuple[int, int, int, int, RawEvent]] = []
        for seq, event in enumerate(events):
            kind = event[0]
            if kind == EV_SLICE_AT:
                start_ns, end_ns = event[3], event[4]
                keyed.append((start_ns, 1, start_ns - end_ns, seq, event))
                keyed.append((end_ns, 0, start_ns - end_ns, -seq, event))
            else:
                keyed.append((event[2] if kind == EV_COUNTER else event[3], 2, 0, seq, event))
        keyed.sort(key=lambda k: k[:4])
        with self._lock:
            if self._file is None:
                return
            for _, order, _, _, event in keyed:
                self._write_one(event, order, thread_names)
            self._file.flush()

    def _write_one(
        self, event: RawEvent, order: int, thread_names: dict[int, tuple[str, int]]
    ) -> None:
        kind = event[0]
        if kind == EV_SLICE_AT:
            _, track, name, start_ns, end_ns, args = event
            uuid = self.track_uuid(track, thread_names)
            if order == 0:
                self._track_event(uuid, _TRACK_EVENT.TYPE_SLICE_END, end_ns, None, None)
            else:
                self._track_event(uuid, _TRACK_EVENT.TYPE_SLICE_BEGIN, start_ns, name, args)
        elif kind == EV_INSTANT:
            _, track, name, ts, args = event
            uuid = self.track_uuid(track, thread_names)
            self._track_event(uuid, _TRACK_EVENT.TYPE_INSTANT, ts, name, args)
        elif kind == EV_COUNTER:
            _, name, ts, value = event
            packet = self._packet()
            packet.timestamp = ts
            te = packet.track_event
            te.type = _TRACK_EVENT.TYPE_COUNTER
            te.track_uuid = self._counter_track(name)
            te.double_counter_value = float(value)
            self._emit(packet)
        else:  # pragma: no cover - the tracer only produces the kinds above
            raise ValueError(f"unknown raw event kind {kind!r}")

    def _track_event(
        self, uuid: int, type_: int, ts: int, name: str | None, args: dict[str, object] | None
    ) -> None:
        packet = self._packet()
        packet.timestamp = ts
        te = packet.track_event
        te.type = type_
        te.track_uuid = uuid
        if name is not None:
            te.name = name
        if args:
            for key, value in args.items():
                if key == FLOW_OUT:
                    te.flow_ids.append(int(value))  # type: ignore[call-overload]
                elif key == FLOW_IN:
                    te.terminating_flow_ids.append(int(value))  # type: ignore[call-overload]
                else:
                    set_annotation(te.debug_annotations.add(), key, value)
        self._emit(packet)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()
                self._file.close()
                self._file = None
