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

from analysis.build import VT_BOOL, VT_DOUBLE, VT_INT, VT_STR, ArgTable, grouped_cumsum
from analysis.wire import WIRE_I64, WIRE_LEN, WIRE_VARINT, FieldTable, decode_strings, scan_fields

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


def _scalar(
    table: FieldTable, n: int, field: int, wire: int, dtype: str, fill: int = 0
) -> np.ndarray:
    out = np.full(n, fill, dtype=dtype)
    mask = table.select(field, wire)
    out[table.msg[mask]] = table.value[mask].astype(dtype)
    return out


def _ranges(table: FieldTable, field: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    mask = table.select(field, WIRE_LEN)
    order = np.argsort(table.pos[mask], kind="stable")
    return (
        table.msg[mask][order],
        table.value[mask][order].astype(np.int64),
        table.length[mask][order],
    )


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
        known["code"] = codes + len(uniques)
        uniques.extend(str(t) for t in texts)
        query = pd.DataFrame({"seq": seq, "gen": gen, "iid": iid.astype(np.int64)})
        merged = query.merge(
            known[["seq", "gen", "iid", "code"]], how="left", on=["seq", "gen", "iid"]
        )
        return merged["code"].fillna(-1).to_numpy(np.int64)


def decode_events(
    data: bytes, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> PacketEvents:
    """Decode all packets ``buf[starts[i]:ends[i]]`` (payloads of the outer framing)."""
    n = starts.shape[0]
    top = scan_fields(buf, starts, ends)
    ts = _scalar(top, n, _P_TIMESTAMP, WIRE_VARINT, "int64")
    seq = _scalar(top, n, _P_SEQ_ID, WIRE_VARINT, "int64")
    flags = _scalar(top, n, _P_SEQ_FLAGS, WIRE_VARINT, "int64")
    cleared = (_scalar(top, n, _P_STATE_CLEARED, WIRE_VARINT, "int64") != 0) | (
        (flags & _SEQ_CLEARED) != 0
    )
    gen = grouped_cumsum(seq, cleared.astype(np.int64))

    interning = _Interning()
    msg, st, ln = _ranges(top, _P_INTERNED)
    for pkt, parsed in zip(msg.tolist(), _parse_each(data, st, ln, pb.InternedData), strict=False):
        interning.add(int(seq[pkt]), int(gen[pkt]), parsed)
    defaults: dict[tuple[int, int], int] = {}
    msg, st, ln = _ranges(top, _P_DEFAULTS)
    for pkt, parsed in zip(
        msg.tolist(), _parse_each(data, st, ln, pb.TracePacketDefaults), strict=False
    ):
        if parsed.track_event_defaults.HasField("track_uuid"):
            defaults[(int(seq[pkt]), int(gen[pkt]))] = parsed.track_event_defaults.track_uuid
    _, st, ln = _ranges(top, _P_TRACK_DESC)
    descriptors = _parse_each(data, st, ln, pb.TrackDescriptor)

    ev_pkt, ev_start, ev_len = _ranges(top, _P_TRACK_EVENT)
    m = ev_pkt.shape[0]
    te = scan_fields(buf, ev_start, ev_start + ev_len)
    ev_seq, ev_gen = seq[ev_pkt], gen[ev_pkt]

    track_uuid = _scalar(te, m, _E_TRACK, WIRE_VARINT, "uint64")
    has_track = np.zeros(m, dtype=bool)
    has_track[te.msg[te.select(_E_TRACK, WIRE_VARINT)]] = True
    if defaults and not has_track.all():
        key = pd.MultiIndex.from_arrays([ev_seq[~has_track], ev_gen[~has_track]])
        table = pd.Series(list(defaults.values()), index=pd.MultiIndex.from_tuples(list(defaults)))
        track_uuid[~has_track] = table.reindex(key).fillna(0).to_numpy(np.uint64)

    names: list[str] = []
    name = np.full(m, -1, dtype=np.int64)
    sel = te.select(_E_NAME, WIRE_LEN)
    codes, names = decode_strings(data, te.value[sel].astype(np.int64), te.length[sel])
    name[te.msg[sel]] = codes
    sel = te.select(_E_NAME_IID, WIRE_VARINT)
    rows = te.msg[sel]
    name[rows] = interning.resolve("event", ev_seq[rows], ev_gen[rows], te.value[sel], names)

    counter = np.full(m, np.nan)
    sel = te.select(_E_COUNTER_INT, WIRE_VARINT)
    counter[te.msg[sel]] = te.value[sel].view(np.int64).astype(np.float64)
    sel = te.select(_E_COUNTER_DOUBLE, WIRE_I64)
    counter[te.msg[sel]] = te.value[sel].view(np.float64)

    flow_event, flow_id, flow_term = _flows(buf, te)
    args = _annotations(data, buf, te, ev_seq, ev_gen, interning)
    return PacketEvents(
        type=_scalar(te, m, _E_TYPE, WIRE_VARINT, "int64"),
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


def _flows(buf: np.ndarray, te: FieldTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    events, ids, term = [], [], []
    for field, terminating in (
        (_E_FLOWS, False),
        (_E_TERM_FLOWS, True),
        (_E_FLOWS_OLD, False),
        (_E_TERM_FLOWS_OLD, True),
    ):
        for wire in (WIRE_I64, WIRE_VARINT):
            sel = te.select(field, wire)
            events.append(te.msg[sel])
            ids.append(te.value[sel])
            term.append(np.full(int(sel.sum()), terminating))
        sel = te.select(field, WIRE_LEN)  # packed fixed64
        for row, start, length in zip(
            te.msg[sel].tolist(),
            te.value[sel].astype(np.int64).tolist(),
            te.length[sel].tolist(),
            strict=False,
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
    te: FieldTable,
    ev_seq: np.ndarray,
    ev_gen: np.ndarray,
    interning: _Interning,
) -> ArgTable:
    owner, start, length = _ranges(te, _E_ANNOT)
    k = owner.shape[0]
    da = scan_fields(buf, start, start + length)
    keys: list[str] = []
    key = np.full(k, -1, dtype=np.int64)
    sel = da.select(_A_NAME, WIRE_LEN)
    codes, keys = decode_strings(data, da.value[sel].astype(np.int64), da.length[sel])
    key[da.msg[sel]] = codes
    sel = da.select(_A_NAME_IID, WIRE_VARINT)
    rows = da.msg[sel]
    key[rows] = interning.resolve(
        "annot", ev_seq[owner[rows]], ev_gen[owner[rows]], da.value[sel], keys
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
        sel = da.select(field, WIRE_VARINT)
        vtype[da.msg[sel]] = vt
        ival[da.msg[sel]] = da.value[sel].view(np.int64)
    sel = da.select(_A_DOUBLE, WIRE_I64)
    vtype[da.msg[sel]] = VT_DOUBLE
    dval[da.msg[sel]] = da.value[sel].view(np.float64)
    sel = da.select(_A_STRING, WIRE_LEN)
    codes, strings = decode_strings(data, da.value[sel].astype(np.int64), da.length[sel])
    vtype[da.msg[sel]] = VT_STR
    sval[da.msg[sel]] = codes
    sel = da.select(_A_STRING_IID, WIRE_VARINT)
    rows = da.msg[sel]
    vtype[rows] = VT_STR
    sval[rows] = interning.resolve(
        "str", ev_seq[owner[rows]], ev_gen[owner[rows]], da.value[sel], strings
    )
    keep = (vtype >= 0) & (key >= 0) & ~((vtype == VT_STR) & (sval < 0))
    return ArgTable(
        owner[keep], key[keep], vtype[keep], ival[keep], dval[keep], sval[keep], keys, strings
    )
