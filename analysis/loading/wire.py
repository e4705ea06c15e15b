"""Vectorised protobuf wire-format scanning with numpy.

Parsing millions of small ``TracePacket`` messages one by one costs microseconds each in Python.
Instead every message of one level is scanned *in lockstep*: iteration ``k`` decodes the ``k``-th
field of all messages at once, so the Python loop runs as many times as the widest message has
fields, not once per message. Only the fields a caller asks for are kept: scalars land straight in
one array per field (one slot per message), repeated fields in rows sorted by message.

The outer ``Trace`` framing is split by the C protobuf parser (``repeated bytes packet = 1``),
which is ten times faster than a Python walk; a file it cannot parse (a cut tail) is walked in
Python to find its last whole packet.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = [
    "WireError",
    "Rows",
    "Scan",
    "padded",
    "split_outer_packets",
    "read_varints",
    "scan_fields",
    "decode_strings",
    "WIRE_VARINT",
    "WIRE_I64",
    "WIRE_LEN",
    "WIRE_I32",
]

WIRE_VARINT = 0
WIRE_I64 = 1
WIRE_LEN = 2
WIRE_I32 = 5
_MAX_VARINT_BYTES = 10
_CHUNK = 1 << 15  # messages scanned together
PAD = 16  # zero bytes after the data so reads past the end need no bounds checks


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message."""


def padded(data: bytes) -> np.ndarray:
    """``data`` as uint8 with ``PAD`` zero bytes appended (what the scanners expect)."""
    buf = np.zeros(len(data) + PAD, dtype=np.uint8)
    buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    return buf


@dataclass(frozen=True)
class Rows:
    """Every occurrence of one repeated field, sorted by (message, position in the message).

    ``msg``: owning message index; ``value``: varint/fixed value (uint64), or for a
    length-delimited field the payload's byte offset; ``length``: payload length (0 else).
    """

    msg: np.ndarray
    value: np.ndarray
    length: np.ndarray


@dataclass(frozen=True)
class Scan:
    """Scanned fields of ``n`` messages.

    ``value[f]``/``present[f]``: the last occurrence of field ``f`` per message (uint64 value, or
    payload offset for length-delimited fields), ``length[f]`` its payload length (for the fields
    asked for); ``rows[(f, wire)]``: all
    occurrences of a repeated field with that wire type.
    """

    n: int
    value: dict[int, np.ndarray]
    length: dict[int, np.ndarray]
    present: dict[int, np.ndarray]
    rows: dict[tuple[int, int], Rows]


def _framing_class() -> type:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fdp = descriptor_pb2.FileDescriptorProto(name="stepscope_framing.proto", package="stepscope")
    msg = fdp.message_type.add(name="Framing")
    msg.field.add(
        name="packet",
        number=1,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED,
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("stepscope.Framing"))  # type: ignore[no-any-return]


_FRAMING: list[type] = []


def _varint_size(n: np.ndarray) -> np.ndarray:
    size = np.ones(n.shape[0], dtype=np.int64)
    for k in range(1, _MAX_VARINT_BYTES):
        size += n >= (1 << (7 * k))
    return size


def _split_fast(data: bytes) -> tuple[np.ndarray, np.ndarray] | None:
    """Packet payload ranges via the C parser, or None when the file does not parse whole."""
    if not _FRAMING:
        _FRAMING.append(_framing_class())
    try:
        packets = _FRAMING[0].FromString(data).packet  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 -- DecodeError has no stable import path
        return None
    lengths = np.fromiter(map(len, packets), dtype=np.int64, count=len(packets))
    ends = np.cumsum(1 + _varint_size(lengths) + lengths)
    if (ends[-1] if ends.size else 0) != len(data) or (data and data[0] != 0x0A):
        return None  # other top-level fields: walk in Python, which names the bad byte
    return ends - lengths, ends


def _split_slow(data: bytes) -> tuple[np.ndarray, np.ndarray, int]:
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
    return np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64), size - pos


def split_outer_packets(data: bytes) -> tuple[np.ndarray, np.ndarray, int]:
    """Walk the outer ``Trace`` framing: repeated field 1, length-delimited.

    Returns ``(starts, ends, num_bytes_dropped)``: payload byte ranges of the complete packets and
    how many bytes at the tail belong to a cut-off packet (a killed writer). Raises
    :class:`WireError` when a tag is not ``TracePacket`` framing (not a Perfetto trace, or corrupt).
    """
    fast = _split_fast(data)
    if fast is not None:
        return fast[0], fast[1], 0
    return _split_slow(data)


_LOW7 = np.arange(256, dtype=np.int64) & 0x7F
_HIGH_BITS = 0x8080808080808080 - (1 << 64)  # as int64


def _words(buf: np.ndarray) -> np.ndarray:
    """An int64 view of ``buf`` at every byte offset (unaligned little-endian 8-byte words)."""
    return np.ndarray((buf.shape[0] - 7,), dtype="<i8", buffer=buf, strides=(1,))


def _swar_varints(words: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode varints of up to 8 bytes held in little-endian words, all at once (SWAR).

    Returns ``(value, num_bytes, complete)``; ``complete`` is False where all 8 bytes carry a
    continuation bit (the varint goes on; ``value`` then holds its first 56 bits).
    """
    term = ~words & _HIGH_BITS  # high bit of each byte that ends a varint
    lsb = term & -term  # the first ending byte's high bit
    num_bytes = (np.bitwise_count((lsb - 1).view(np.uint64)).astype(np.int64) + 1) >> 3
    v = words & ((lsb << 1) - 1) & 0x7F7F7F7F7F7F7F7F
    v = (v & 0x007F007F007F007F) | ((v & 0x7F007F007F007F00) >> 1)
    v = (v & 0x00003FFF00003FFF) | ((v & 0x3FFF00003FFF0000) >> 2)
    v = (v & 0x000000000FFFFFFF) | ((v & 0x0FFFFFFF00000000) >> 4)
    return v, np.minimum(num_bytes, 8), term != 0


def read_varints(buf: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode one varint at every offset in ``pos`` of a :func:`padded` buffer.

    One byte gather serves the (common) one-byte varints; longer ones are decoded from 8-byte
    words with bit tricks, and the rare 9- and 10-byte ones finish byte by byte. Returns
    ``(value int64, next_pos int64, ok bool)``: values of 2**63 and above come out as negative
    int64 (view them as uint64); ``ok`` is False where the varint is longer than 10 bytes (one
    running past the data is caught by the caller's bounds check).
    """
    byte = buf[pos]
    value = _LOW7[byte]
    next_pos = pos + 1
    ok = np.ones(pos.shape[0], dtype=bool)
    idx = np.flatnonzero(byte & 0x80)
    if idx.size == 0:
        return value, next_pos, ok
    start = np.minimum(pos[idx], buf.shape[0] - 8)
    v, num_bytes, complete = _swar_varints(_words(buf)[start])
    value[idx] = v
    next_pos[idx] = start + num_bytes
    idx = idx[~complete]
    for k in (8, 9):
        if idx.size == 0:
            break
        byte = buf[np.minimum(pos[idx] + k, buf.shape[0] - 1)]
        value[idx] |= _LOW7[byte] << (7 * k)
        next_pos[idx] = pos[idx] + k + 1
        idx = idx[(byte & 0x80) != 0]
    ok[idx] = False
    return value, next_pos, ok


def _read_fixed(buf: np.ndarray, pos: np.ndarray, width: int) -> np.ndarray:
    """Little-endian fixed-width values (``width`` 4 or 8) at each offset, as int64 bits."""
    if pos.size == 0:
        return np.zeros(0, dtype=np.int64)
    raw = np.ascontiguousarray(buf[pos[:, None] + np.arange(width)])
    if width == 8:
        return raw.view("<i8").reshape(-1).copy()
    return raw.view("<u4").reshape(-1).astype(np.int64)


def _decode_field(
    buf: np.ndarray, pos: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(field, wire, value, length, next position, ok) of the field starting at each ``pos``.

    ``value`` is int64 bits: the varint or fixed value, or a length-delimited payload's offset.
    """
    tag, after, ok = read_varints(buf, pos)
    field = tag >> 3
    wire = tag & 7
    # Varint values and length prefixes are both a varint right after the tag: one pass.
    is_len = wire == WIRE_LEN
    value, nxt, ok_v = read_varints(buf, after)
    varint_or_len = is_len | (wire == WIRE_VARINT)
    ok &= ok_v | ~varint_or_len
    length = np.where(is_len, value, 0)
    ok &= (length >= 0) & (length < (1 << 40))
    if is_len.any():
        value[is_len] = nxt[is_len]
        nxt += length
    if not varint_or_len.all():
        for wire_type, width in ((WIRE_I64, 8), (WIRE_I32, 4)):
            m = np.flatnonzero(wire == wire_type)
            if m.size:
                value[m] = _read_fixed(buf, np.minimum(after[m], buf.shape[0] - width), width)
                nxt[m] = after[m] + width
        ok &= varint_or_len | (wire == WIRE_I64) | (wire == WIRE_I32)
    ok &= field > 0
    return field, wire, value, length, nxt, ok


def scan_fields(
    buf: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    last: Iterable[int] = (),
    repeated: Iterable[tuple[int, int]] = (),
    lengths: Iterable[int] = (),
) -> Scan:
    """Decode messages ``buf[starts[i]:ends[i]]`` of a :func:`padded` buffer, all in lockstep.

    ``last``: fields kept as one value per message (the last occurrence wins, as protobuf
    merges scalars); ``lengths``: those of them whose payload length is wanted too
    (length-delimited fields); ``repeated``: (field, wire) pairs kept as :class:`Rows`. Other
    fields are skipped. Raises :class:`WireError` naming the first malformed field's byte offset.
    """
    n = starts.shape[0]
    last, repeated = tuple(last), tuple(repeated)
    top = max([*last, *(f for f, _ in repeated)], default=0) + 1
    # Dispatch tables indexed by field * 8 + wire: slot of a 'last' field, of a repeated key.
    last_slot = np.full(top * 8 + 8, -1, dtype=np.int64)
    for i, f in enumerate(last):
        last_slot[f * 8 : f * 8 + 8] = i
    rep_slot = np.full(top * 8 + 8, -1, dtype=np.int64)
    for i, (f, w) in enumerate(repeated):
        rep_slot[f * 8 + w] = i
    len_fields = tuple(f for f in last if f in set(lengths))
    len_row = np.full(len(last), -1, dtype=np.int64)
    for i, f in enumerate(last):
        if f in len_fields:
            len_row[i] = len_fields.index(f)
    value = np.zeros((len(last), n), dtype=np.int64)
    length = np.zeros((len(len_fields), n), dtype=np.int64)
    present = np.zeros((len(last), n), dtype=bool)
    out = (value.reshape(-1), length.reshape(-1), present.reshape(-1))
    pieces: list[list[tuple[np.ndarray, ...]]] = [[] for _ in repeated]  # per key, per chunk
    # Chunks keep the temporaries small: they stay in cache and in malloc's reused memory.
    for a in range(0, n, _CHUNK):
        b = min(a + _CHUNK, n)
        owner = np.arange(a, b)
        cursor, end = starts[a:b].astype(np.int64), ends[a:b].astype(np.int64)
        live = cursor < end
        owner, cursor, end = owner[live], cursor[live], end[live]
        parts: list[tuple[np.ndarray, ...]] = []
        while owner.size:
            field, wire, val, ln, nxt, ok = _decode_field(buf, cursor)
            ok &= nxt <= end
            if not ok.all():
                raise WireError(f"malformed protobuf field at byte {int(cursor[~ok][0])}")
            code = np.minimum(field, top) * 8 + wire
            slot = last_slot[code]
            hit = np.flatnonzero(slot >= 0)
            if hit.size:
                flat = slot[hit] * n + owner[hit]
                out[0][flat] = val[hit]
                out[2][flat] = True
                if len_fields:
                    lrow = len_row[slot[hit]]
                    keep = lrow >= 0
                    out[1][(lrow * n + owner[hit])[keep]] = ln[hit][keep]
            if repeated:
                rslot = rep_slot[code]
                hit = np.flatnonzero(rslot >= 0)
                if hit.size:
                    parts.append((rslot[hit], owner[hit], val[hit], ln[hit]))
            more = nxt < end
            owner, cursor, end = owner[more], nxt[more], end[more]
        _sort_chunk_rows(parts, pieces)
    z = np.zeros(0, dtype=np.int64)
    rows = {
        key: Rows(*(np.concatenate(c) for c in zip(*p, strict=True)))
        if p
        else Rows(z, z.astype(np.uint64), z)
        for key, p in zip(repeated, pieces, strict=True)
    }
    return Scan(
        n,
        {f: value[i].view(np.uint64) for i, f in enumerate(last)},
        {f: length[i] for i, f in enumerate(len_fields)},
        {f: present[i] for i, f in enumerate(last)},
        rows,
    )


def _sort_chunk_rows(
    parts: list[tuple[np.ndarray, ...]], pieces: list[list[tuple[np.ndarray, ...]]]
) -> None:
    """Append one chunk's repeated-field hits to ``pieces[key]``, sorted by message (iteration
    order = position in the message). Chunks cover increasing message ranges, so sorting each
    small chunk and concatenating in chunk order sorts the whole, with no full-size sort."""
    if not parts:
        return
    slot, msg, val, ln = (np.concatenate(c) for c in zip(*parts, strict=True))
    order = np.lexsort((msg, slot))
    slot, msg, val, ln = slot[order], msg[order], val[order].view(np.uint64), ln[order]
    bounds = np.searchsorted(slot, np.arange(len(pieces) + 1))
    for key, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if b > a:
            pieces[key].append((msg[a:b], val[a:b], ln[a:b]))


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
