"""Hand-written protobuf encoding of the few Perfetto messages the writer emits.

Building ``perfetto_trace_pb2`` objects costs several microseconds per packet on the flush thread
(which shares the GIL with the engine); concatenating pre-encoded field bytes costs a fraction of
that. Field numbers are those of ``protos/perfetto/trace`` (checked against the generated classes
in ``tests/instrument/test_interning.py``).
"""

from __future__ import annotations

import struct

__all__ = [
    "varint",
    "field_varint",
    "field_bytes",
    "field_double",
    "field_fixed64",
    "frame_packet",
    "annotation",
    "name_iid_field",
    "name_field",
    "TYPE_SLICE_BEGIN",
    "TYPE_SLICE_END",
    "TYPE_INSTANT",
    "TYPE_COUNTER",
    "SEQ_INCREMENTAL_STATE_CLEARED",
    "SEQ_NEEDS_INCREMENTAL_STATE",
]

_U64 = (1 << 64) - 1
_pack_double = struct.Struct("<d").pack
_pack_u64 = struct.Struct("<Q").pack

TYPE_SLICE_BEGIN, TYPE_SLICE_END, TYPE_INSTANT, TYPE_COUNTER = 1, 2, 3, 4
SEQ_INCREMENTAL_STATE_CLEARED, SEQ_NEEDS_INCREMENTAL_STATE = 1, 2

# DebugAnnotation fields
_A_NAME_IID, _A_BOOL, _A_INT, _A_DOUBLE, _A_NAME, _A_STRING_IID, _A_STRING = 1, 2, 4, 5, 10, 17, 6


def _varint_slow(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# Varints of 14-bit chunks: whole (last chunk) and with both continuation bits set (others).
_VAR14 = [_varint_slow(i) for i in range(1 << 14)]
_CONT14 = [bytes(((i & 0x7F) | 0x80, (i >> 7) | 0x80)) for i in range(1 << 14)]


def varint(value: int) -> bytes:
    """Base-128 varint; negative ints as 64-bit two's complement (10 bytes), like int64."""
    if 0 <= value < 16384:
        return _VAR14[value]
    value &= _U64
    out = _CONT14[value & 0x3FFF]
    value >>= 14
    while value >= 16384:
        out += _CONT14[value & 0x3FFF]
        value >>= 14
    return out + _VAR14[value]


def _tag(field: int, wire: int) -> bytes:
    return varint((field << 3) | wire)


def field_varint(field: int, value: int) -> bytes:
    return _tag(field, 0) + varint(value)


def field_bytes(field: int, payload: bytes) -> bytes:
    return _tag(field, 2) + varint(len(payload)) + payload


def field_double(field: int, value: float) -> bytes:
    return _tag(field, 1) + _pack_double(value)


def field_fixed64(field: int, value: int) -> bytes:
    return _tag(field, 1) + _pack_u64(value & _U64)


def frame_packet(body: bytes) -> bytes:
    """One ``Trace.packet`` entry (field 1, length-delimited)."""
    return b"\x0a" + varint(len(body)) + body


def annotation(name_field: bytes, value: object, string_iid: int | None = None) -> bytes:
    """A ``DebugAnnotation`` payload: ``name_field`` (pre-encoded name or name_iid) + value.

    ``string_iid`` replaces a string value by its interned id. bool is tested before int (a bool
    is an int); None is written as the string "None".
    """
    if isinstance(value, bool):
        return name_field + (b"\x10\x01" if value else b"\x10\x00")
    if isinstance(value, int):
        return name_field + b"\x20" + varint(value)
    if isinstance(value, float):
        return name_field + b"\x29" + _pack_double(value)
    if string_iid is not None:
        return name_field + b"\x88\x01" + varint(string_iid)  # field 17, varint
    data = str(value).encode("utf-8")
    return name_field + b"\x32" + varint(len(data)) + data


def name_iid_field(iid: int) -> bytes:
    """A DebugAnnotation's ``name_iid`` field."""
    return b"\x08" + varint(iid)


def name_field(name: str) -> bytes:
    """A DebugAnnotation's plain ``name`` field."""
    data = name.encode("utf-8")
    return b"\x52" + varint(len(data)) + data
