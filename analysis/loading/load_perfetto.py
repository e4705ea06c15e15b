"""Load a Perfetto protobuf trace (stepscope's own, or any TrackEvent producer) into frames.

The outer ``Trace`` framing is walked by hand so that a file cut off mid-packet (a killed process)
loads up to its last complete packet; ``metadata["bytes_dropped"]`` says how much was lost.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from analysis.frames import (
    COUNTER_COLUMNS,
    INSTANT_COLUMNS,
    ROLE_COMPUTE,
    ROLE_COPY,
    ROLE_CPU,
    ROLE_KERNEL,
    ROLE_OTHER,
    ROLE_REQUEST,
    SLICE_COLUMNS,
    TraceError,
    TraceFrames,
    categorical_from_codes,
    categorize,
)
from analysis.loading.build import pair_begin_end, pivot_args
from analysis.loading.derive import (
    OUTPUT_DIGEST_KEY,
    decisions_from_instants,
    flows_from_mentions,
    instant_args,
    syncs_from_instants,
)
from analysis.loading.perfetto_events import PacketEvents, decode_events
from analysis.loading.profiles import Profile, get_profile
from analysis.loading.wire import WireError, padded, split_outer_packets
from instrument.schema import (
    DEVICE_COMPUTE,
    DEVICE_COPY,
    DEVICE_KERNELS,
    ENGINE_THREAD,
    Instant,
    parse_device_track_name,
    parse_request_track_name,
)

__all__ = ["load_perfetto"]

_TE = pb.TrackEvent
ROLE_COUNTER = "counter"
ROLE_PROCESS = "process"
_LANE_ROLES = {DEVICE_COMPUTE: ROLE_COMPUTE, DEVICE_COPY: ROLE_COPY, DEVICE_KERNELS: ROLE_KERNEL}


def _track_row(desc: Any) -> dict[str, Any]:
    name = desc.name
    if not name and desc.HasField("thread"):
        name = desc.thread.thread_name or f"thread {desc.thread.tid}"
    if not name and desc.HasField("process"):
        name = desc.process.process_name or f"process {desc.process.pid}"
    name = name or f"track {desc.uuid}"
    device = parse_device_track_name(name)
    if device is not None:
        role = _LANE_ROLES[device[1]]
    elif parse_request_track_name(name) is not None:
        role = ROLE_REQUEST
    elif desc.HasField("counter"):
        role = ROLE_COUNTER
    elif desc.HasField("thread") or name == ENGINE_THREAD:
        role = ROLE_CPU
    elif desc.HasField("process"):
        role = ROLE_PROCESS
    else:
        role = ROLE_OTHER
    return {
        "uuid": desc.uuid,
        "parent_uuid": desc.parent_uuid,
        "name": name,
        "role": role,
        "pid": desc.thread.pid if desc.HasField("thread") else desc.process.pid,
        "tid": desc.thread.tid if desc.HasField("thread") else 0,
        "device": device[0] if device is not None else -1,
    }


def _tracks(events: PacketEvents) -> pd.DataFrame:
    """Tracks frame (TRACK_COLUMNS) covering every uuid an event uses, sorted by uuid."""
    rows = {d.uuid: _track_row(d) for d in events.descriptors}
    for uuid in np.unique(events.track_uuid).tolist():
        if uuid not in rows:
            rows[uuid] = {
                "uuid": uuid,
                "parent_uuid": 0,
                "name": f"track {uuid}",
                "role": ROLE_OTHER,
                "pid": 0,
                "tid": 0,
                "device": -1,
            }
    df = pd.DataFrame(sorted(rows.values(), key=lambda r: r["uuid"]))
    uuids = df["uuid"].to_numpy(np.uint64)
    parent = np.searchsorted(uuids, df["parent_uuid"].to_numpy(np.uint64))
    parent_ok = (parent < len(uuids)) & (
        uuids[np.minimum(parent, len(uuids) - 1)] == df["parent_uuid"].to_numpy(np.uint64)
    )
    # Threads inherit their process's pid when the descriptor left it out.
    out = pd.DataFrame(
        {
            "track_id": np.arange(len(df), dtype=np.int64),
            "uuid": uuids,
            "parent_id": np.where(parent_ok, parent, -1).astype(np.int64),
            "name": df["name"].astype(object).to_numpy(),
            "role": df["role"].astype(object).to_numpy(),
            "pid": df["pid"].to_numpy(np.int64),
            "tid": df["tid"].to_numpy(np.int64),
            "device": df["device"].to_numpy(np.int64),
        }
    )
    return out


def _named(codes: np.ndarray, names: list[str]) -> pd.Categorical:
    """Interned name codes (-1: no name) as a categorical; "" for no name."""
    return categorical_from_codes(np.where(codes >= 0, codes, len(names)), names + [""])


def _slices(
    ev: PacketEvents, track_id: np.ndarray, tracks: pd.DataFrame, profile: Profile
) -> tuple[pd.DataFrame, np.ndarray, dict[str, int]]:
    is_be = (ev.type == _TE.TYPE_SLICE_BEGIN) | (ev.type == _TE.TYPE_SLICE_END)
    idx = np.nonzero(is_be)[0]
    pairs = pair_begin_end(track_id[idx], ev.ts_ns[idx], ev.type[idx] == _TE.TYPE_SLICE_BEGIN)
    begin, end = idx[pairs.begin], idx[pairs.end]
    order = np.lexsort((pairs.depth, ev.ts_ns[begin]))
    begin, end, depth = begin[order], end[order], pairs.depth[order]
    n = begin.shape[0]
    event_to_slice = np.full(ev.type.shape[0], -1, dtype=np.int64)
    event_to_slice[begin] = np.arange(n)
    event_to_slice[end] = np.arange(n)
    tid = track_id[begin]
    raw = _named(ev.name[begin], ev.names)
    ts, end_ns = ev.ts_ns[begin], ev.ts_ns[end]
    cols: dict[str, Any] = {
        "slice_id": np.arange(n, dtype=np.int64),
        "track_id": tid,
        "track": categorical_from_codes(tid, tracks["name"].to_numpy(object)),
        "role": categorical_from_codes(tid, tracks["role"].to_numpy(object)),
        "name": raw,
        "raw_name": raw.copy(),
        "ts_ns": ts,
        "dur_ns": end_ns - ts,
        "end_ns": end_ns,
        "depth": depth.astype(np.int32),
        "step": np.full(n, -1, dtype=np.int64),
        "kind": categorical_from_codes(np.zeros(n, dtype=np.int64), [""]),
    }
    cols.update(
        pivot_args(n, ev.args.remap_rows(event_to_slice), set(SLICE_COLUMNS) - {"step", "kind"})
    )
    df = pd.DataFrame(cols, copy=False)
    stats = {
        "unterminated_slices": pairs.num_unterminated,
        "unmatched_ends": pairs.num_unmatched_ends,
    }
    return categorize(profile.apply(df)), event_to_slice, stats


def _instants(ev: PacketEvents, track_id: np.ndarray, tracks: pd.DataFrame) -> pd.DataFrame:
    idx = np.nonzero(ev.type == _TE.TYPE_INSTANT)[0]
    n = idx.shape[0]
    tid = track_id[idx]
    role = tracks["role"].to_numpy(object)[tid]
    scope = np.where(role == ROLE_CPU, "thread", np.where(role == ROLE_PROCESS, "process", "track"))
    event_to_instant = np.full(ev.type.shape[0], -1, dtype=np.int64)
    event_to_instant[idx] = np.arange(n)
    cols: dict[str, Any] = {
        "track_id": tid,
        "track": tracks["name"].to_numpy(object)[tid],
        "scope": scope.astype(object),
        "name": _named(ev.name[idx], ev.names),
        "ts_ns": ev.ts_ns[idx],
    }
    cols.update(pivot_args(n, ev.args.remap_rows(event_to_instant), set(INSTANT_COLUMNS)))
    return categorize(pd.DataFrame(cols))


def _counters(ev: PacketEvents, track_id: np.ndarray, tracks: pd.DataFrame) -> pd.DataFrame:
    idx = np.nonzero((ev.type == _TE.TYPE_COUNTER) & ~np.isnan(ev.counter))[0]
    tid = track_id[idx]
    df = pd.DataFrame(
        {
            "track_id": tid,
            "name": tracks["name"].to_numpy(object)[tid],
            "ts_ns": ev.ts_ns[idx],
            "value": ev.counter[idx],
        }
    )
    return df.astype(COUNTER_COLUMNS)


def load_perfetto(data: bytes, profile: Profile | str | None = None) -> TraceFrames:
    """Frames of a Perfetto ``Trace`` held in ``data`` (already decompressed)."""
    prof = get_profile(profile or "stepscope")
    if not data:
        raise TraceError("the file is empty")
    buf = padded(data)
    try:
        starts, ends, dropped = split_outer_packets(data)
        if starts.size == 0:
            raise TraceError(f"no complete TracePacket: the file ({len(data)} bytes) is truncated")
        ev = decode_events(data, buf, starts, ends)
    except WireError as exc:
        raise TraceError(f"not a readable Perfetto trace: {exc}") from None
    tracks = _tracks(ev)
    track_id = np.searchsorted(tracks["uuid"].to_numpy(np.uint64), ev.track_uuid).astype(np.int64)
    slices, event_to_slice, stats = _slices(ev, track_id, tracks, prof)
    instants = _instants(ev, track_id, tracks)
    flow_slice = event_to_slice[ev.flow_event] if ev.flow_event.size else ev.flow_event
    flows = flows_from_mentions(
        ev.flow_id, flow_slice, ev.ts_ns[ev.flow_event], ev.flow_terminating
    )
    meta = instant_args(instants, Instant.TRACE_METADATA.value)
    config = instant_args(instants, Instant.ENGINE_CONFIG.value)
    metadata: dict[str, Any] = {
        **meta,
        "format": "perfetto",
        "profile": prof.name,
        "bytes_total": len(data),
        "bytes_dropped": int(dropped),
        "num_packets": ev.num_packets,
        **stats,
    }
    digest = meta.get(OUTPUT_DIGEST_KEY, config.get(OUTPUT_DIGEST_KEY))
    if digest is not None:
        metadata[OUTPUT_DIGEST_KEY] = digest
    if slices.empty:
        raise TraceError(
            f"the trace holds no slices ({len(instants)} instants, {ev.num_packets} packets): "
            "metadata only, nothing to analyse"
        )
    return TraceFrames(
        slices=slices,
        instants=instants,
        counters=_counters(ev, track_id, tracks),
        flows=flows,
        tracks=tracks,
        decisions=decisions_from_instants(instants),
        syncs=syncs_from_instants(instants),
        metadata=metadata,
        config=config,
    )
