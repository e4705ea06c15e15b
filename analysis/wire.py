"""Vectorised protobuf wire-format scanning with numpy.

Parsing millions of small ``TracePacket`` messages one by one costs microseconds each in Python.
Instead every message of one level is scanned *in lockstep*: iteration ``k`` decodes the ``k``-th
field of all messages at once, so the Python loop runs as many times as the widest message has
fields, not once per message. Nested messages are scanned the same way from their byte ranges.

Only what the trace reader needs is decoded here (varints, fixed 32/64-bit values and the byte
range of length-delimited fields); rare, rich messages (track descriptors, interned data) are
handed to the ``perfetto`` package's generated classes instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "WireError",
    "FieldTable",
    "split_outer_packets",
    "read_varints",
    "scan_fields",
    "decode_strings",
]

WIRE_VARINT = 0
WIRE_I64 = 1
WIRE_LEN = 2
WIRE_I32 = 5
_MAX_VARINT_BYTES = 10


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message."""


@dataclass(frozen=True)
class FieldTable:
    """One row per decoded field, in no particular order across messages.

    ``msg``: index of the owning message in the scanned batch; ``field``: field number;
    ``wire``: wire type; ``value``: the varint / fixed value (``uint64``), or for a
    length-delimited field the byte offset of its payload; ``length``: payload length (0 else).
    ``pos``: byte offset of the field's tag (keeps the order of repeated fields).
    """

    msg: np.ndarray
    field: np.ndarray
    wire: np.ndarray
    value: np.ndarray
    length: np.ndarray
    pos: np.ndarray

    def select(self, field: int, wire: int | None = None) -> np.ndarray:
        """Boolean mask of rows holding ``field`` (optionally of one wire type)."""
        mask = self.field == field
        if wire is not None:
            mask &= self.wire == wire
        return mask


def split_outer_packets(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Walk the outer ``Trace`` framing: repeated field 1, length-delimited.

    Returns ``(starts, ends, num_bytes_dropped)``: payload byte ranges of the complete packets and
    how many bytes at the tail belong to a cut-off packet (a killed writer). Raises
    :class:`WireError` when a tag is not ``TracePacket`` framing (not a Perfetto trace, or corrupt).
    """
    data = buf.tobytes()
    size = len(data)
    starts: list[int] = []
    ends: list[int] = []
    pos = 0
    while pos < size:
        if data[pos] != 0x0A:
            raise WireError(f"byte {pos}: 0x{data[pos]:02x} is not a TracePacket tag (0x0a)")
        length, cursor, shift = 0, pos + 1, 0
        while cursor < size and data[cursor] & 0x80:
            length |= (data[cursor] & 0x7F) << shift
            shift += 7
            cursor += 1
        if cursor >= size or shift > 63:
            break
        length |= data[cursor] << shift
        cursor += 1
        if cursor + length > size:
            break
        starts.append(cursor)
        ends.append(cursor + length)
        pos = cursor + length
    return (
        np.asarray(starts, dtype=np.int64),
        np.asarray(ends, dtype=np.int64),
        size - pos,
    )


def read_varints(buf: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode one varint at every offset in ``pos``.

    Returns ``(value uint64, next_pos int64, ok bool)``; ``ok`` is False where the varint runs
    past the buffer or exceeds 10 bytes.
    """
    size = buf.shape[0]
    value = np.zeros(pos.shape[0], dtype=np.uint64)
    next_pos = pos.astype(np.int64, copy=True)
    ok = np.ones(pos.shape[0], dtype=bool)
    idx = np.arange(pos.shape[0])
    cursor = next_pos.copy()
    for k in range(_MAX_VARINT_BYTES):
        inside = cursor < size
        ok[idx[~inside]] = False
        idx, cursor = idx[inside], cursor[inside]
        byte = buf[cursor]
        value[idx] |= (byte & 0x7F).astype(np.uint64) << np.uint64(7 * k)
        next_pos[idx] = cursor + 1
        more = (byte & 0x80) != 0
        idx, cursor = idx[more], cursor[more] + 1
        if idx.size == 0:
            return value, next_pos, ok
    ok[idx] = False
    return value, next_pos, ok


def _read_fixed(buf: np.ndarray, pos: np.ndarray, width: int) -> np.ndarray:
    """Little-endian fixed-width values (``width`` 4 or 8) at each offset, as ``uint64``."""
    if pos.size == 0:
        return np.zeros(0, dtype=np.uint64)
    grid = pos[:, None] + np.arange(width)
    raw = np.ascontiguousarray(buf[grid])
    dtype = "<u8" if width == 8 else "<u4"
    return raw.view(dtype).reshape(-1).astype(np.uint64)


def scan_fields(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> FieldTable:
    """Decode every field of every message ``buf[starts[i]:ends[i]]``, all messages in lockstep.

    Raises :class:`WireError` naming the first malformed message's byte offset.
    """
    size = buf.shape[0]
    cursor = starts.astype(np.int64, copy=True)
    ends = ends.astype(np.int64)
    owner_all = np.arange(cursor.shape[0])
    parts: list[tuple[np.ndarray, ...]] = []
    live = cursor < ends
    while live.any():
        owner, pos, end = owner_all[live], cursor[live], ends[live]
        tag, after_tag, ok = read_varints(buf, pos)
        field = (tag >> np.uint64(3)).astype(np.int64)
        wire = (tag & np.uint64(7)).astype(np.int64)
        value = np.zeros(owner.shape[0], dtype=np.uint64)
        length = np.zeros(owner.shape[0], dtype=np.int64)
        nxt = after_tag.copy()
        m = wire == WIRE_VARINT
        value[m], nxt[m], ok_v = read_varints(buf, after_tag[m])
        ok[m] &= ok_v
        for wire_type, width in ((WIRE_I64, 8), (WIRE_I32, 4)):
            m = (wire == wire_type) & ok & (after_tag + width <= size)
            value[m] = _read_fixed(buf, after_tag[m], width)
            nxt[m] = after_tag[m] + width
        m = wire == WIRE_LEN
        ln, payload, ok_l = read_varints(buf, after_tag[m])
        ok[m] &= ok_l
        value[m] = payload.astype(np.uint64)
        length[m] = ln.astype(np.int64)
        nxt[m] = payload + length[m]
        ok &= np.isin(wire, (WIRE_VARINT, WIRE_I64, WIRE_LEN, WIRE_I32)) & (nxt <= end)
        ok &= field > 0
        if not ok.all():
            bad = int(pos[~ok][0])
            raise WireError(f"malformed protobuf field at byte {bad}")
        parts.append((owner, field, wire, value, length, pos))
        cursor[live] = nxt
        live = cursor < ends
    if not parts:
        empty_i = np.zeros(0, dtype=np.int64)
        return FieldTable(empty_i, empty_i, empty_i, np.zeros(0, np.uint64), empty_i, empty_i)
    cols = [np.concatenate(c) for c in zip(*parts, strict=False)]
    return FieldTable(*cols)


def decode_strings(
    data: bytes, starts: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, list[str]]:
    """Factorise the UTF-8 strings ``data[s:s+n]`` into ``(codes int64, uniques)``.

    Strings are grouped by length and compared as fixed-width byte rows, so no Python object is
    made per occurrence, only per distinct string.
    """
    codes = np.full(starts.shape[0], -1, dtype=np.int64)
    uniques: list[str] = []
    buf = np.frombuffer(data, dtype=np.uint8)
    for width in np.unique(lengths):
        rows = np.nonzero(lengths == width)[0]
        if width == 0:
            codes[rows] = len(uniques)
            uniques.append("")
            continue
        grid = np.ascontiguousarray(buf[starts[rows, None] + np.arange(width)])
        keys = grid.view(np.dtype((np.void, int(width)))).reshape(-1)
        distinct, inverse = np.unique(keys, return_inverse=True)
        codes[rows] = inverse.reshape(-1) + len(uniques)
        uniques.extend(bytes(d).decode("utf-8", errors="replace") for d in distinct)
    return codes, uniques
