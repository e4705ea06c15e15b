"""Reading a Perfetto trace file back packet by packet, tolerating a truncated tail.

A ``Trace`` message is a sequence of field-1 length-delimited ``TracePacket`` records. Walking the
framing by hand (instead of ``Trace.ParseFromString``) lets a file cut mid-packet by a killed
process load up to its last whole packet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

__all__ = ["PacketScan", "scan_packets", "read_packets", "resolve_interned", "TraceReadError"]

_PACKET_TAG = 0x0A  # field 1, wire type 2 (length-delimited)


class TraceReadError(ValueError):
    """The bytes are not a Perfetto protobuf trace."""


@dataclass
class PacketScan:
    packets: list[Any]  # perfetto_trace_pb2.TracePacket
    truncated_bytes: int  # bytes of an incomplete last packet that were skipped


def _varint(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= len(data):
            raise IndexError("varint runs past the end")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise TraceReadError("malformed varint in the trace framing")


def scan_packets(data: bytes) -> PacketScan:
    """Parse every whole packet; a cut tail is counted, anything else malformed raises."""
    view = memoryview(data)
    packets: list[Any] = []
    pos = 0
    end = len(data)
    while pos < end:
        start = pos
        tag = data[pos]
        if tag != _PACKET_TAG:
            raise TraceReadError(
                f"not a Perfetto trace: unexpected byte 0x{tag:02x} at offset {pos} "
                "(expected a TracePacket field)"
            )
        try:
            length, pos = _varint(view, pos + 1)
        except IndexError:
            return PacketScan(packets, end - start)
        if pos + length > end:
            return PacketScan(packets, end - start)
        packet = pb.TracePacket()
        try:
            packet.ParseFromString(view[pos : pos + length].tobytes())
        except Exception as err:  # protobuf's DecodeError has no stable import path
            raise TraceReadError(f"corrupt TracePacket at offset {start}: {err}") from None
        packets.append(packet)
        pos += length
    return PacketScan(packets, 0)


def resolve_interned(packets: list[Any]) -> None:
    """Fill in interned names in place: event ``name`` from ``name_iid``, annotation ``name``
    from ``name_iid`` and ``string_value`` from ``string_value_iid``.

    Interning tables are kept per trusted sequence and reset when a packet clears the sequence's
    incremental state, as Perfetto's trace processor does.
    """
    cleared = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
    tables: dict[int, tuple[dict[int, str], dict[int, str], dict[int, str]]] = {}
    for packet in packets:
        seq = packet.trusted_packet_sequence_id
        if packet.sequence_flags & cleared or packet.incremental_state_cleared or seq not in tables:
            tables[seq] = ({}, {}, {})
        names, keys, strings = tables[seq]
        if packet.HasField("interned_data"):
            data = packet.interned_data
            names.update((e.iid, e.name) for e in data.event_names)
            keys.update((e.iid, e.name) for e in data.debug_annotation_names)
            strings.update((e.iid, e.str.decode()) for e in data.debug_annotation_string_values)
        if not packet.HasField("track_event"):
            continue
        te = packet.track_event
        if te.HasField("name_iid"):
            te.name = names.get(te.name_iid, "")
        for ann in te.debug_annotations:
            if ann.HasField("name_iid"):
                ann.name = keys.get(ann.name_iid, "")
            if ann.HasField("string_value_iid"):
                ann.string_value = strings.get(ann.string_value_iid, "")


def read_packets(path: str) -> PacketScan:
    """Every whole packet of the file at ``path``, interned names resolved."""
    with open(path, "rb") as f:
        scan = scan_packets(f.read())
    resolve_interned(scan.packets)
    return scan
