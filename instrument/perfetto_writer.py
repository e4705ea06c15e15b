"""Turns the tracer's raw event tuples into streamed, compact Perfetto protobuf packets.

Runs off the hot path (the tracer's flush thread, or at close). Each batch appends whole
``TracePacket`` records and flushes the file, so a killed process leaves a trace that loads up to
the last flush (at worst with one truncated packet at the tail, which readers skip).

Compact encoding (what a step costs, see ``bench/bench_trace_size.py``):

* event names, annotation names and string values are interned (``interned_data`` +
  ``name_iid`` / ``string_value_iid``) on one trusted sequence; the state is cleared by a packet
  flagged ``SEQ_INCREMENTAL_STATE_CLEARED`` at the start of the file (and of every ring segment),
  and every event packet is flagged ``SEQ_NEEDS_INCREMENTAL_STATE``;
* each track is described once, the first time an event uses it;
* process-scoped instants (``trace_metadata``, ``engine_config``, ``feature_decision``) use plain
  names: they are rare, and a ring segment replays them in its preamble.

Capture control (which steps are written, and the exact count of those that are not) is applied
here through a :class:`~instrument.capture.CaptureGate`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import Any

from instrument import proto_encode as pe
from instrument.capture import CaptureConfig, CaptureGate
from instrument.events import (
    EV_COUNTER,
    EV_COUNTERS,
    EV_INSTANT,
    EV_REQUEST,
    EV_SLICE_AT,
    EV_SPAN,
    EV_STAGE,
    FLOW_IN,
    FLOW_OUT,
    RawEvent,
    expand_counters,
    expand_request,
    expand_span,
    expand_stage,
    unflatten,
)
from instrument.ring_output import FileOutput, RingOutput
from instrument.schema import PROCESS_NAME, Arg, CaptureArg, Instant, request_track_name

__all__ = ["PerfettoWriter"]

_SEQ_ID = 0x5753  # one writer per file: a fixed trusted sequence id
_SEQ = pe.field_varint(10, _SEQ_ID)
_SEQ_NEEDS = _SEQ + pe.field_varint(13, pe.SEQ_NEEDS_INCREMENTAL_STATE)
_STEP = Arg.STEP.value
_BEGIN, _END = pe.field_varint(9, pe.TYPE_SLICE_BEGIN), pe.field_varint(9, pe.TYPE_SLICE_END)
_INSTANT, _COUNTER = pe.field_varint(9, pe.TYPE_INSTANT), pe.field_varint(9, pe.TYPE_COUNTER)


_REQUEST_TRACK_PREFIX = request_track_name("")
# Closing counts written only when non-zero (absent = 0).
_ZERO_OMITTED = ("dropped_", CaptureArg.ENGINE_SKIPPED_STEPS_PREFIX.value,
                 CaptureArg.ENGINE_SKIPPED_INSTANTS.value)  # fmt: skip


def _is_request_slice(event: RawEvent) -> bool:
    """A slice on a request's track (``request <id>``), written when the request finishes."""
    return (
        event[0] == EV_SLICE_AT
        and isinstance(event[1], str)
        and event[1].startswith(_REQUEST_TRACK_PREFIX)
    )


def _event_packet(ts: int, te: bytes, interned: bytes, seq: bytes = _SEQ_NEEDS) -> bytes:
    body = b"\x40" + pe.varint(ts) + seq + b"\x5a" + pe.varint(len(te)) + te
    if interned:
        body += b"\x62" + pe.varint(len(interned)) + interned
    return pe.frame_packet(body)


def _expand(events: Iterable[RawEvent]) -> Iterable[RawEvent]:
    """Events with each ``EV_REQUEST`` replaced by its slices, each ``EV_COUNTERS`` by its
    counter samples, each ``EV_SPAN`` and ``EV_STAGE`` by its slice."""
    for event in events:
        kind = event[0]
        if kind == EV_SPAN:
            yield expand_span(event)
        elif kind == EV_STAGE:
            yield expand_stage(event)
        elif kind == EV_REQUEST:
            yield from expand_request(event)
        elif kind == EV_COUNTERS:
            yield from expand_counters(event)
        else:
            yield event


class PerfettoWriter:
    """Owns the output (file or ring), the track uuids, the interning tables and the gate.

    Tracks are described lazily the first time an event names them: thread tracks by thread key,
    named tracks (device lanes, requests) by name, counter tracks by counter name.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        process_name: str = PROCESS_NAME,
        capture: CaptureConfig | None = None,
        pid: int | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.capture = capture or CaptureConfig()
        self.gate = CaptureGate(self.capture)
        ring = self.capture.ring_bytes
        self._out: FileOutput | RingOutput = (
            RingOutput(self.path, ring) if ring else FileOutput(self.path)
        )
        self._lock = threading.Lock()
        self._closed = False
        self._pid = pid if pid is not None else os.getpid()  # the traced process
        self._next_uuid = (self._pid << 20) + 1
        self._process_uuid = self._next_uuid  # set by the first _describe
        self._tracks: dict[tuple[str, object], bytes] = {}  # key -> encoded track_uuid field
        self._descriptors: list[bytes] = []  # framed descriptor packets, in order
        self._sticky: list[bytes] = []  # framed process-scoped instants
        self._cur_step: int | None = None
        self._pending_desc: list[bytes] = []  # descriptors made while encoding one event
        self._written_steps: set[int] = set()
        self.num_packets = 0
        self._process_field = self._describe(
            ("process", None),
            pe.field_bytes(
                3, pe.field_varint(1, self._pid) + pe.field_bytes(6, process_name.encode())
            ),
            parent=False,
        )
        self._reset_interning()
        if isinstance(self._out, RingOutput):
            self._out.open_segment(b"".join(self._descriptors), self._cleared_packet())
        else:
            self._out.write(b"".join(self._descriptors) + self._cleared_packet())

    # ---- interning and tracks ---------------------------------------------------------------
    def _reset_interning(self) -> None:
        self._names: dict[str, bytes] = {}  # event name -> encoded name_iid field
        self._keys: dict[str, bytes] = {}  # annotation key -> encoded name_iid field
        self._strings: dict[str, int] = {}  # string value -> iid

    @staticmethod
    def _cleared_packet() -> bytes:
        return pe.frame_packet(_SEQ + pe.field_varint(13, pe.SEQ_INCREMENTAL_STATE_CLEARED))

    def _describe(self, key: tuple[str, object], kind_fields: bytes, parent: bool = True) -> bytes:
        uuid = self._next_uuid
        self._next_uuid += 1
        desc = pe.field_varint(1, uuid) + kind_fields
        if parent:
            desc += pe.field_varint(5, self._process_uuid)
        else:
            self._process_uuid = uuid
        packet = pe.frame_packet(_SEQ + pe.field_bytes(60, desc))
        self._descriptors.append(packet)
        self._pending_desc.append(packet)
        field = pe.field_varint(11, uuid)
        self._tracks[key] = field
        return field

    def _track(
        self, track: int | str | tuple[str, int] | None, names: dict[int, tuple[str, int]]
    ) -> bytes:
        if track is None:
            return self._process_field
        key: tuple[str, object] = ("thread", track) if isinstance(track, int) else ("named", track)
        field = self._tracks.get(key)
        if field is not None:
            return field
        if isinstance(track, int):
            name, native_id = names.get(track, (f"thread-{track}", track))
            thread = pe.field_varint(1, self._pid) + pe.field_varint(2, native_id)
            return self._describe(key, pe.field_bytes(4, thread + pe.field_bytes(5, name.encode())))
        # ``(name, n)``: the n-th further track of that name (one device lane's second stream,
        # whose slices may overlap the first's in time: a track of their own, the lane's name).
        name = track if isinstance(track, str) else track[0]
        return self._describe(key, pe.field_bytes(2, name.encode()))

    def _counter_track(self, name: str) -> bytes:
        field = self._tracks.get(("counter", name))
        if field is None:
            kind = pe.field_bytes(2, name.encode()) + pe.field_bytes(8, b"")
            field = self._describe(("counter", name), kind)
        return field

    # ---- encoding ---------------------------------------------------------------------------
    def _encode(self, type_field: bytes, track: bytes, ts: int, name: str, args: Any) -> bytes:
        """An interned TrackEvent packet (slice begin or instant)."""
        interned = b""
        name_f = self._names.get(name)
        if name_f is None:
            iid = len(self._names) + 1
            name_f = self._names[name] = b"\x50" + pe.varint(iid)
            interned += pe.field_bytes(
                2, pe.field_varint(1, iid) + pe.field_bytes(2, name.encode())
            )
        te = type_field + track + name_f
        if args:
            for key, value in args.items():
                if key == FLOW_OUT:
                    te += pe.field_fixed64(47, int(value))
                    continue
                if key == FLOW_IN:
                    te += pe.field_fixed64(48, int(value))
                    continue
                key_f = self._keys.get(key)
                if key_f is None:
                    iid = len(self._keys) + 1
                    key_f = self._keys[key] = pe.name_iid_field(iid)
                    entry = pe.field_varint(1, iid) + pe.field_bytes(2, key.encode())
                    interned += pe.field_bytes(3, entry)
                str_iid = None
                if not isinstance(value, (bool, int, float)):
                    text = "None" if value is None else str(value)
                    str_iid = self._strings.get(text)
                    if str_iid is None:
                        str_iid = self._strings[text] = len(self._strings) + 1
                        entry = pe.field_varint(1, str_iid) + pe.field_bytes(2, text.encode())
                        interned += pe.field_bytes(29, entry)
                ann = pe.annotation(key_f, value, str_iid)
                te += b"\x22" + pe.varint(len(ann)) + ann
        return _event_packet(ts, te, interned)

    def _encode_sticky(self, ts: int, name: str, args: Any) -> bytes:
        """A process-scoped instant with plain names (no dependency on interning state)."""
        te = _INSTANT + self._process_field + pe.field_bytes(23, name.encode())
        for key, value in (args or {}).items():
            ann = pe.annotation(pe.name_field(key), value)
            te += b"\x22" + pe.varint(len(ann)) + ann
        return _event_packet(ts, te, b"", _SEQ)

    def _encode_one(
        self, event: RawEvent, is_end: bool, names: dict[int, tuple[str, int]]
    ) -> bytes:
        kind = event[0]
        if kind == EV_SLICE_AT:
            track = self._track(event[1], names)
            if is_end:
                return _event_packet(event[4], _END + track, b"")
            return self._encode(_BEGIN, track, event[3], event[2], event[5])
        if kind == EV_INSTANT:
            return self._encode(
                _INSTANT, self._track(event[1], names), event[3], event[2], event[4]
            )
        if kind == EV_COUNTER:
            _, name, ts, value = event
            if isinstance(value, int) and not isinstance(value, bool):
                te = _COUNTER + self._counter_track(name) + pe.field_varint(30, value)
            else:
                te = _COUNTER + self._counter_track(name) + pe.field_double(44, float(value))
            return _event_packet(ts, te, b"")
        raise ValueError(f"unknown raw event kind {kind!r}")  # pragma: no cover

    # ---- batches ----------------------------------------------------------------------------
    def _gate(
        self, events: Iterable[RawEvent]
    ) -> tuple[list[RawEvent], list[tuple[int, int, int, int, RawEvent, int | None]]]:
        """Split off process instants, attribute each event to a step, apply rules 1-3.

        Returns (sticky events, time-ordered entries ``(ts, order, -dur, seq, event, step)``;
        a complete slice has a begin (order 1) and an end (order 0) entry).
        """
        gate, cur = self.gate, self._cur_step
        sticky: list[RawEvent] = []
        keyed: list[tuple[int, int, int, int, RawEvent, int | None]] = []
        for seq, event in enumerate(_expand(events)):
            kind = event[0]
            step = cur
            if kind == EV_SLICE_AT:
                args = event[5]
                own = args.get(_STEP) if args else None
                if isinstance(own, int):
                    step = own
                    if isinstance(event[1], int):
                        cur = own
            elif kind == EV_INSTANT and event[1] is None:
                sticky.append(event)
                continue
            if step is not None:
                reason = gate.static(step)
                if reason is not None:
                    if not _is_request_slice(event):
                        gate.drop(reason)
                        continue
                    step = None  # a request's track spans many steps: kept (docs/design.md)
            if kind == EV_SLICE_AT:
                start_ns, end_ns = event[3], event[4]
                keyed.append((start_ns, 1, start_ns - end_ns, seq, event, step))
                keyed.append((end_ns, 0, start_ns - end_ns, -seq, event, step))
            else:
                ts = event[2] if kind == EV_COUNTER else event[3]
                keyed.append((ts, 2, 0, seq, event, step))
        self._cur_step = cur
        keyed.sort()  # (ts, order, -dur, ±seq) is unique: the event itself is never compared
        return sticky, keyed

    def _encode_batch(
        self,
        keyed: list[tuple[int, int, int, int, RawEvent, int | None]],
        names: dict[int, tuple[str, int]],
    ) -> tuple[list[bytes], set[int], int]:
        chunks: list[bytes] = []
        steps: set[int] = set()
        size = self._out.size
        gate, admitted = self.gate, self.gate.admitted
        encode = self._encode_one
        num_events = 0
        for _, order, _, _, event, step in keyed:
            if step is not None:
                if step not in admitted and not gate.admit(step, size):
                    if order:  # count a slice once, at its begin
                        gate.drop("size")
                    continue
                steps.add(step)
            packet = encode(event, order == 0, names)
            if self._pending_desc:
                for desc in self._pending_desc:
                    chunks.append(desc)
                    size += len(desc)
                self._pending_desc = []
            chunks.append(packet)
            size += len(packet)
            num_events += order != 0
        return chunks, steps, num_events

    def write_flat(self, flat: list[Any], thread_names: dict[int, tuple[str, int]]) -> None:
        """:meth:`write` of a flat batch (the tracer's buffer: ``instrument.events.unflatten``)."""
        self.write(unflatten(flat), thread_names)

    def write(self, events: Iterable[RawEvent], thread_names: dict[int, tuple[str, int]]) -> None:
        """Gate, convert and append a batch of raw events in time order; flushes the file.

        Complete slices become a begin and an end packet. Within a batch, packets are ordered by
        time; at equal times ends come before begins and longer slices begin first, so nesting
        survives coarse clocks. Readers sort across batches by timestamp.
        """
        with self._lock:
            if self._closed:
                return
            sticky, keyed = self._gate(events)
            for event in sticky:
                packet = self._encode_sticky(event[3], event[2], event[4])
                self._sticky.append(packet)
                self._out.write(packet)
            chunks, steps, num_events = self._encode_batch(keyed, thread_names)
            out = self._out
            if isinstance(out, RingOutput) and not out.fits(sum(map(len, chunks))):
                self._reset_interning()
                out.rotate(b"".join(self._descriptors + self._sticky), self._cleared_packet())
                chunks, steps, num_events = self._encode_batch(keyed, thread_names)
            out.write(b"".join(chunks))
            self.num_packets += len(chunks) + len(sticky)
            if isinstance(out, RingOutput):
                out.record(num_events, steps)
                self._written_steps |= steps
            out.flush()

    def ring_counts(self) -> dict[str, int]:
        """Steps and events evicted from the ring (empty without a ring)."""
        out = self._out
        if not isinstance(out, RingOutput):
            return {}
        evicted = self._written_steps - out.kept_steps()
        return {
            f"{CaptureArg.DROPPED_STEPS_PREFIX.value}ring": len(evicted),
            f"{CaptureArg.DROPPED_EVENTS_PREFIX.value}ring": out.evicted_events,
            "ring_rotations": out.num_rotations,
        }

    def write_metadata(self, args: dict[str, object], ts_ns: int) -> None:
        """A ``trace_metadata`` instant written now, never gated (used at close)."""
        with self._lock:
            if not self._closed:
                self._out.write(self._encode_sticky(ts_ns, Instant.TRACE_METADATA.value, args))

    def finish(
        self,
        dropped: dict[str, int],
        ts_ns: int,
        skipped_steps: dict[str, int] | None = None,
        skipped_instants: int = 0,
    ) -> None:
        """End of trace: the closing ``trace_metadata`` (the tracer's own ``dropped`` counts, the
        gate's, with the steps the engine skipped (``skipped_steps`` per reason, and the thread
        instants not written meanwhile: ``CaptureGate.skipped``), and the ring's; zero drop and
        skip counts left out), a small "closed" instant, close."""
        counts: dict[str, object] = {f"dropped_{k}": v for k, v in dropped.items()}
        if skipped_steps or skipped_instants:
            self.gate.skipped(skipped_steps or {}, skipped_instants)
        counts.update(self.gate.counts())
        counts.update(self.ring_counts())
        self.write_metadata(
            {k: v for k, v in counts.items() if v or not k.startswith(_ZERO_OMITTED)}, ts_ns
        )
        self.close({"closed": True}, ts_ns)

    def close(self, final_metadata: dict[str, object] | None = None, ts_ns: int = 0) -> None:
        """Write a last ``trace_metadata`` instant (when given), then close (assemble a ring)."""
        with self._lock:
            if self._closed:
                return
            if final_metadata is not None:
                self._out.write(
                    self._encode_sticky(ts_ns, Instant.TRACE_METADATA.value, final_metadata)
                )
            self._closed = True
            self._out.close()
