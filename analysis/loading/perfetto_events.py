"""Decode a Perfetto ``Trace`` into flat numpy event columns (no per-packet Python loop).

Handles the parts of the format that producers other than stepscope use too: interned event
and annotation names (``interned_data`` + ``sequence_flags``, scoped per trusted sequence and
reset when incremental state is cleared), ``trace_packet_defaults`` track uuids, packed or
unpacked flow ids, and a cut-off tail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from analysis.loading.build import VT_BOOL, VT_DOUBLE, VT_INT, VT_STR, ArgTable, grouped_cumsum
from analysis.loading.wire import WIRE_I64, WIRE_LEN, WIRE_VARINT, Scan, decode_strings, scan_fields

__all__ = ["PacketEvents", "decode_events"]

# TracePacket fields
_P_TIMESTAMP, _P_TRACK_EVENT, _P_SEQ_ID, _P_INTERNED = 8, 11, 10, 12
_P_SEQ_FLAGS, _P_STATE_CLEARED, _P_DEFAULTS, _P_TRACK_DESC = 13, 41, 59, 60
# TrackEvent fields
_E_TYPE, _E_TRACK, _E_NAME, _E_NAME_IID, _E_ANNOT = 9, 11, 23, 10, 4
_E_FLOWS, _E_TERM_FLOWS, _E_FLOWS_OLD, _E_TERM_FLOWS_OLD = 47, 48, 36, 42
_E_COUNTER_INT, _E_COUNTER_DOUBLE = 30, 44
# DebugAnnotation fields
_A_NAME_IID, _A_NAME, _A_BOOL, _A_UINT, _A_INT, _A_DOUBLE = 1, 10, 2, 3, 4, 5
_A_STRING, _A_STRING_IID, _A_POINTER = 6, 17, 7
_SEQ_CLEARED = 1


@dataclass(frozen=True)
class PacketEvents:
    """Every ``TrackEvent`` of the trace as columns (index = event order in the file).

    ``type``: TrackEvent.Type; ``track_uuid`` uint64; ``ts_ns`` int64; ``name``: code into
    ``names`` (-1 = none); ``counter`` float64 (NaN unless a counter); ``flow_event``/``flow_id``/
    ``flow_terminating``: one row per flow id mention; ``args``: annotations keyed by event index.
    ``descriptors``: the raw ``TrackDescriptor`` messages, in file order.
    """

    type: np.ndarray
    track_uuid: np.ndarray
    ts_ns: np.ndarray
    name: np.ndarray
    names: list[str]
    counter: np.ndarray
    flow_event: np.ndarray
    flow_id: np.ndarray
    flow_terminating: np.ndarray
    args: ArgTable
    descriptors: list[Any]
    num_packets: int


def _scalar(scan: Scan, field: int, dtype: str, fill: int = 0) -> np.ndarray:
    out = scan.value[field].astype(dtype)
    if fill:
        out[~scan.present[field]] = fill
    return out


def _len_rows(scan: Scan, field: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(message, payload offset, length) of every occurrence of a length-delimited field."""
    rows = scan.rows[(field, WIRE_LEN)]
    return rows.msg, rows.value.astype(np.int64), rows.length


def _parse_each(data: bytes, starts: np.ndarray, lengths: np.ndarray, cls: Any) -> list[Any]:
    return [
        cls.FromString(data[s : s + n])
        for s, n in zip(starts.tolist(), lengths.tolist(), strict=False)
    ]


class _Interning:
    """Interned strings per (sequence, generation, iid), resolved with joins."""

    def __init__(self) -> None:
        self.rows: dict[str, list[tuple[int, int, int, str]]] = {
            "event": [],
            "annot": [],
            "str": [],
        }

    def add(self, seq: int, gen: int, msg: Any) -> None:
        for entry in msg.event_names:
            self.rows["event"].append((seq, gen, entry.iid, entry.name))
        for entry in msg.debug_annotation_names:
            self.rows["annot"].append((seq, gen, entry.iid, entry.name))
        for entry in msg.debug_annotation_string_values:
            self.rows["str"].append((seq, gen, entry.iid, entry.str.decode("utf-8", "replace")))

    def resolve(
        self, table: str, seq: np.ndarray, gen: np.ndarray, iid: np.ndarray, uniques: list[str]
    ) -> np.ndarray:
        """Codes into ``uniques`` (extended in place) for each (seq, gen, iid); -1 if unknown."""
        rows = self.rows[table]
        if not rows or iid.size == 0:
            return np.full(iid.shape[0], -1, dtype=np.int64)
        known = pd.DataFrame(rows, columns=["seq", "gen", "iid", "text"])
        known = known.drop_duplicates(["seq", "gen", "iid"], keep="last")
        codes, texts = pd.factorize(known["text"])
        uniques_before = len(uniques)
        uniques.extend(str(t) for t in texts)
        k_seq, k_gen = known["seq"].to_numpy(np.int64), known["gen"].to_numpy(np.int64)
        k_iid = known["iid"].to_numpy(np.uint64)
        limits = (1 << 24, 1 << 19, 1 << 20)  # packs (seq, gen, iid) into one int64 key
        if (
            max(int(k_seq.max()), int(seq.max())) < limits[0]
            and max(int(k_gen.max()), int(gen.max())) < limits[1]
            and int(iid.max()) < limits[2]
            and int(k_iid.max()) < limits[2]
        ):

            def pack(s: np.ndarray, g: np.ndarray, i: np.ndarray) -> np.ndarray:
                return (s.astype(np.int64) << 39) | (g.astype(np.int64) << 20) | i.astype(np.int64)

            keys = pack(k_seq, k_gen, k_iid)
            order = np.argsort(keys)
            keys, k_codes = keys[order], codes[order] + uniques_before
            query = pack(seq, gen, iid)
            at = np.minimum(np.searchsorted(keys, query), keys.shape[0] - 1)
            return np.where(keys[at] == query, k_codes[at], -1).astype(np.int64)
        known["code"] = codes + uniques_before
        query_df = pd.DataFrame({"seq": seq, "gen": gen, "iid": iid.astype(np.uint64)})
        known["iid"] = k_iid
        merged = query_df.merge(
            known[["seq", "gen", "iid", "code"]], how="left", on=["seq", "gen", "iid"]
        )
        return merged["code"].fillna(-1).to_numpy(np.int64)


_PACKET_LAST = (_P_TIMESTAMP, _P_SEQ_ID, _P_SEQ_FLAGS, _P_STATE_CLEARED, _P_TRACK_EVENT)
_PACKET_ROWS = ((_P_INTERNED, WIRE_LEN), (_P_DEFAULTS, WIRE_LEN), (_P_TRACK_DESC, WIRE_LEN))
_FLOW_FIELDS = (
    (_E_FLOWS, False),
    (_E_TERM_FLOWS, True),
    (_E_FLOWS_OLD, False),
    (_E_TERM_FLOWS_OLD, True),
)
_EVENT_LAST = (_E_TYPE, _E_TRACK, _E_NAME, _E_NAME_IID, _E_COUNTER_INT, _E_COUNTER_DOUBLE)
_EVENT_ROWS = ((_E_ANNOT, WIRE_LEN),) + tuple(
    (f, w) for f, _ in _FLOW_FIELDS for w in (WIRE_I64, WIRE_VARINT, WIRE_LEN)
)
_ANNOT_LAST: tuple[int, ...] = (
    _A_NAME_IID,
    _A_NAME,
    _A_BOOL,
    _A_UINT,
    _A_INT,
    _A_DOUBLE,
    _A_STRING,
)
_ANNOT_LAST += (_A_STRING_IID, _A_POINTER)


def _interning_and_defaults(
    data: bytes, top: Scan, seq: np.ndarray, gen: np.ndarray
) -> tuple[_Interning, dict[tuple[int, int], int], list[Any]]:
    interning = _Interning()
    msg, st, ln = _len_rows(top, _P_INTERNED)
    for pkt, parsed in zip(msg.tolist(), _parse_each(data, st, ln, pb.InternedData), strict=False):
        interning.add(int(seq[pkt]), int(gen[pkt]), parsed)
    defaults: dict[tuple[int, int], int] = {}
    msg, st, ln = _len_rows(top, _P_DEFAULTS)
    for pkt, parsed in zip(
        msg.tolist(), _parse_each(data, st, ln, pb.TracePacketDefaults), strict=False
    ):
        if parsed.track_event_defaults.HasField("track_uuid"):
            defaults[(int(seq[pkt]), int(gen[pkt]))] = parsed.track_event_defaults.track_uuid
    _, st, ln = _len_rows(top, _P_TRACK_DESC)
    return interning, defaults, _parse_each(data, st, ln, pb.TrackDescriptor)


def decode_events(
    data: bytes, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> PacketEvents:
    """Decode all packets ``buf[starts[i]:ends[i]]`` (payloads of the outer framing) of a
    :func:`~analysis.loading.wire.padded` buffer."""
    n = starts.shape[0]
    top = scan_fields(buf, starts, ends, _PACKET_LAST, _PACKET_ROWS, (_P_TRACK_EVENT,))
    ts = _scalar(top, _P_TIMESTAMP, "int64")
    seq = _scalar(top, _P_SEQ_ID, "int64")
    flags = _scalar(top, _P_SEQ_FLAGS, "int64")
    cleared = (_scalar(top, _P_STATE_CLEARED, "int64") != 0) | ((flags & _SEQ_CLEARED) != 0)
    gen = grouped_cumsum(seq, cleared.astype(np.int64))
    interning, defaults, descriptors = _interning_and_defaults(data, top, seq, gen)

    ev_pkt = np.flatnonzero(top.present[_P_TRACK_EVENT])
    ev_start = top.value[_P_TRACK_EVENT][ev_pkt].astype(np.int64)
    m = ev_pkt.shape[0]
    ev_end = ev_start + top.length[_P_TRACK_EVENT][ev_pkt]
    del top  # its per-packet columns are no longer needed
    te = scan_fields(buf, ev_start, ev_end, _EVENT_LAST, _EVENT_ROWS, (_E_NAME,))
    ev_seq, ev_gen = seq[ev_pkt], gen[ev_pkt]

    track_uuid = te.value[_E_TRACK].copy()
    has_track = te.present[_E_TRACK]
    if defaults and not has_track.all():
        key = pd.MultiIndex.from_arrays([ev_seq[~has_track], ev_gen[~has_track]])
        table = pd.Series(list(defaults.values()), index=pd.MultiIndex.from_tuples(list(defaults)))
        track_uuid[~has_track] = table.reindex(key).fillna(0).to_numpy(np.uint64)

    name = np.full(m, -1, dtype=np.int64)
    rows = np.flatnonzero(te.present[_E_NAME])
    codes, names = decode_strings(
        data, te.value[_E_NAME][rows].astype(np.int64), te.length[_E_NAME][rows]
    )
    name[rows] = codes
    rows = np.flatnonzero(te.present[_E_NAME_IID])
    name[rows] = interning.resolve(
        "event", ev_seq[rows], ev_gen[rows], te.value[_E_NAME_IID][rows], names
    )

    counter = np.full(m, np.nan)
    rows = np.flatnonzero(te.present[_E_COUNTER_INT])
    counter[rows] = te.value[_E_COUNTER_INT][rows].view(np.int64).astype(np.float64)
    rows = np.flatnonzero(te.present[_E_COUNTER_DOUBLE])
    counter[rows] = te.value[_E_COUNTER_DOUBLE][rows].view(np.float64)

    flow_event, flow_id, flow_term = _flows(buf, te)
    args = _annotations(data, buf, te, ev_seq, ev_gen, interning)
    return PacketEvents(
        type=_scalar(te, _E_TYPE, "int64"),
        track_uuid=track_uuid,
        ts_ns=ts[ev_pkt],
        name=name,
        names=names,
        counter=counter,
        flow_event=flow_event,
        flow_id=flow_id,
        flow_terminating=flow_term,
        args=args,
        descriptors=descriptors,
        num_packets=n,
    )


def _flows(buf: np.ndarray, te: Scan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    events, ids, term = [np.zeros(0, np.int64)], [np.zeros(0, np.uint64)], [np.zeros(0, bool)]
    for field, terminating in _FLOW_FIELDS:
        for wire in (WIRE_I64, WIRE_VARINT):
            r = te.rows[(field, wire)]
            events.append(r.msg)
            ids.append(r.value)
            term.append(np.full(r.msg.shape[0], terminating))
        r = te.rows[(field, WIRE_LEN)]  # packed fixed64
        for row, start, length in zip(
            r.msg.tolist(), r.value.astype(np.int64).tolist(), r.length.tolist(), strict=False
        ):
            packed = np.ascontiguousarray(buf[start : start + length]).view("<u8")
            events.append(np.full(packed.shape[0], row))
            ids.append(packed.astype(np.uint64))
            term.append(np.full(packed.shape[0], terminating))
    return (
        np.concatenate(events).astype(np.int64),
        np.concatenate(ids).astype(np.uint64),
        np.concatenate(term).astype(bool),
    )


def _annotations(
    data: bytes,
    buf: np.ndarray,
    te: Scan,
    ev_seq: np.ndarray,
    ev_gen: np.ndarray,
    interning: _Interning,
) -> ArgTable:
    owner, start, length = _len_rows(te, _E_ANNOT)
    k = owner.shape[0]
    da = scan_fields(buf, start, start + length, _ANNOT_LAST, (), (_A_NAME, _A_STRING))
    key = np.full(k, -1, dtype=np.int64)
    rows = np.flatnonzero(da.present[_A_NAME])
    codes, keys = decode_strings(
        data, da.value[_A_NAME][rows].astype(np.int64), da.length[_A_NAME][rows]
    )
    key[rows] = codes
    rows = np.flatnonzero(da.present[_A_NAME_IID])
    key[rows] = interning.resolve(
        "annot", ev_seq[owner[rows]], ev_gen[owner[rows]], da.value[_A_NAME_IID][rows], keys
    )

    vtype = np.full(k, -1, dtype=np.int64)
    ival = np.zeros(k, dtype=np.int64)
    dval = np.zeros(k, dtype=np.float64)
    sval = np.full(k, -1, dtype=np.int64)
    for field, vt in (
        (_A_BOOL, VT_BOOL),
        (_A_UINT, VT_INT),
        (_A_INT, VT_INT),
        (_A_POINTER, VT_INT),
    ):
        rows = np.flatnonzero(da.present[field])
        vtype[rows] = vt
        ival[rows] = da.value[field][rows].view(np.int64)
    rows = np.flatnonzero(da.present[_A_DOUBLE])
    vtype[rows] = VT_DOUBLE
    dval[rows] = da.value[_A_DOUBLE][rows].view(np.float64)
    rows = np.flatnonzero(da.present[_A_STRING])
    codes, strings = decode_strings(
        data, da.value[_A_STRING][rows].astype(np.int64), da.length[_A_STRING][rows]
    )
    vtype[rows] = VT_STR
    sval[rows] = codes
    rows = np.flatnonzero(da.present[_A_STRING_IID])
    vtype[rows] = VT_STR
    sval[rows] = interning.resolve(
        "str", ev_seq[owner[rows]], ev_gen[owner[rows]], da.value[_A_STRING_IID][rows], strings
    )
    keep = (vtype >= 0) & (key >= 0) & ~((vtype == VT_STR) & (sval < 0))
    return ArgTable(
        owner[keep], key[keep], vtype[keep], ival[keep], dval[keep], sval[keep], keys, strings
    )
