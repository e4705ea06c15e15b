"""Hand-built Perfetto traces with exact timestamps (a second producer besides the Tracer).

``TraceSpec`` lists slices per track with explicit times; ``write_perfetto`` encodes them as
TrackEvent begin/end packets, optionally with interned names (as the Perfetto SDK writes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

TE = pb.TrackEvent
SEQ = 7


@dataclass
class TraceSpec:
    """Slices as (track, name, start_ns, end_ns, args); instants as (track|None, name, ts, args)."""

    slices: list[tuple[str, str, int, int, dict[str, object]]] = field(default_factory=list)
    instants: list[tuple[str | None, str, int, dict[str, object]]] = field(default_factory=list)

    def cpu(self, name: str, start: int, end: int, **args: object) -> None:
        self.slices.append(("engine-core", name, start, end, args))

    def gpu(self, name: str, start: int, end: int, **args: object) -> None:
        self.slices.append(("gpu:0 compute", name, start, end, args))


def _annotate(
    te: object, args: dict[str, object], interned: dict[str, int] | None, new: pb.InternedData
) -> None:
    for key, value in args.items():
        ann = te.debug_annotations.add()  # type: ignore[attr-defined]
        if interned is not None:
            if key not in interned:
                interned[key] = len(interned) + 1
                entry = new.debug_annotation_names.add()
                entry.iid, entry.name = interned[key], key
            ann.name_iid = interned[key]
        else:
            ann.name = key
        if isinstance(value, bool):
            ann.bool_value = value
        elif isinstance(value, int):
            ann.int_value = value
        elif isinstance(value, float):
            ann.double_value = value
        else:
            ann.string_value = str(value)


def encode(spec: TraceSpec, intern: bool = False) -> bytes:
    """Serialise ``spec`` as a Perfetto Trace."""
    trace = pb.Trace()
    uuids: dict[str | None, int] = {None: 1}
    proc = trace.packet.add()
    proc.track_descriptor.uuid = 1
    proc.track_descriptor.process.pid = 42
    proc.track_descriptor.process.process_name = "stepscope"
    tracks = {t for t, *_ in spec.slices} | {t for t, *_ in spec.instants if t is not None}
    for name in sorted(tracks):
        uuids[name] = len(uuids) + 1
        p = trace.packet.add()
        d = p.track_descriptor
        d.uuid, d.parent_uuid = uuids[name], 1
        if name.startswith("gpu:") or name.startswith("request "):
            d.name = name
        else:
            d.thread.pid, d.thread.tid, d.thread.thread_name = 42, uuids[name], name
    names: dict[str, int] | None = {} if intern else None
    annots: dict[str, int] | None = {} if intern else None
    events: list[tuple[int, int, str | None, int, str, dict[str, object]]] = []
    for track, name, start, end, args in spec.slices:
        events.append((start, 1, track, TE.TYPE_SLICE_BEGIN, name, args))
        events.append((end, 0, track, TE.TYPE_SLICE_END, name, {}))
    for track, name, ts, args in spec.instants:
        events.append((ts, 2, track, TE.TYPE_INSTANT, name, args))
    first = True
    for ts, _, track, typ, name, args in sorted(events, key=lambda e: (e[0], e[1])):
        p = trace.packet.add()
        p.timestamp, p.trusted_packet_sequence_id = ts, SEQ
        if first:
            p.sequence_flags = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
            first = False
        p.track_event.type, p.track_event.track_uuid = typ, uuids[track]
        new = pb.InternedData()
        if typ != TE.TYPE_SLICE_END:
            if names is not None:
                if name not in names:
                    names[name] = len(names) + 1
                    entry = new.event_names.add()
                    entry.iid, entry.name = names[name], name
                p.track_event.name_iid = names[name]
            else:
                p.track_event.name = name
            _annotate(p.track_event, args, annots, new)
        if new.ByteSize():
            p.interned_data.CopyFrom(new)
    return trace.SerializeToString()


def write(spec: TraceSpec, path: Path, intern: bool = False) -> Path:
    path.write_bytes(encode(spec, intern))
    return path
