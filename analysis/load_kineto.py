"""Load a Kineto / torch.profiler Chrome-JSON trace (PyTorch, vLLM, SGLang) into frames.

Mapping onto the stepscope contract:

* ``kernel`` and ``gpu_memset`` events become device slices on ``gpu:<device> compute``,
  ``gpu_memcpy`` on ``gpu:<device> copy`` (the CUDA stream is kept in ``stream``);
  ``gpu_user_annotation`` ranges go to ``gpu:<device> annotations`` (role ``annotation``);
* CPU events (``cpu_op``, ``user_annotation``, ``python_function``, ``cuda_runtime``,
  ``cuda_driver``) become slices on their thread's track; the profile renames ranges
  (``gpu_model_runner: forward`` → ``launch``, ``ProfilerStep#7`` → ``step`` 7, ...);
* ``cudaStreamSynchronize``/``cudaEventSynchronize``/``cudaDeviceSynchronize`` (and driver
  equivalents) become ``wait_output`` with kind ``sync``; a ``cudaMemcpy`` whose copy is
  device-to-host, or any copy into pageable memory, becomes ``wait_output`` with kind
  ``d2h_copy``; each of those, plus ``aten::item``/``aten::_local_scalar_dense``, is also a
  ``sync`` instant (``hot`` when inside ``schedule``/``prepare_inputs``/``launch``);
* launch → kernel flows come from the ``correlation`` ids; steps come from step envelopes,
  else from consecutive ``schedule`` ranges; a kernel takes its launch's step.
Events of unknown categories are kept on their thread track with role ``other``.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd

from analysis.build import nesting_depth
from analysis.derive import flows_from_mentions
from analysis.frames import (
    COUNTER_COLUMNS,
    INSTANT_COLUMNS,
    ROLE_ANNOTATION,
    ROLE_COMPUTE,
    ROLE_COPY,
    ROLE_CPU,
    ROLE_OTHER,
    SYNC_COLUMNS,
    TraceError,
    TraceFrames,
    categorize,
    empty_frame,
)
from analysis.intervals import assign, union
from analysis.profiles import Profile, get_profile
from instrument.schema import CpuSlice

__all__ = ["load_kineto", "SYNC_CALLS"]

_DEVICE_CATS = {
    "kernel": ROLE_COMPUTE,
    "gpu_memset": ROLE_COMPUTE,
    "gpu_memcpy": ROLE_COPY,
    "gpu_user_annotation": ROLE_ANNOTATION,
}
_CPU_CATS = {
    "cpu_op",
    "user_annotation",
    "python_function",
    "cuda_runtime",
    "cuda_driver",
    "cpu_instant_event",
    "fwdbwd",
    "trace",
}
SYNC_CALLS = frozenset(
    {
        "cudaStreamSynchronize",
        "cudaEventSynchronize",
        "cudaDeviceSynchronize",
        "cuStreamSynchronize",
        "cuEventSynchronize",
        "cuCtxSynchronize",
    }
)
_SCALAR_OPS = frozenset({"aten::item", "aten::_local_scalar_dense"})
_HOT = (CpuSlice.SCHEDULE.value, CpuSlice.PREPARE_INPUTS.value, CpuSlice.LAUNCH.value)
WAIT_SYNC, WAIT_D2H = "sync", "d2h_copy"


def _events(data: bytes) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        where = f" at byte {exc.pos}" if isinstance(exc, json.JSONDecodeError) else ""
        raise TraceError(f"not valid JSON{where} (cut off or not a trace?)") from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise TraceError("a Kineto trace needs a 'traceEvents' list")
    events = [e for e in events if isinstance(e, dict)]
    if not events:
        raise TraceError("the trace holds no events")
    extra = {k: v for k, v in doc.items() if k != "traceEvents"} if isinstance(doc, dict) else {}
    return events, extra


def _num(values: list[Any]) -> np.ndarray:
    return pd.to_numeric(pd.Series(values, dtype=object), errors="coerce").to_numpy(np.float64)


def _columns(events: list[dict[str, Any]]) -> pd.DataFrame:
    args: list[dict[str, Any]] = [a if isinstance(a := e.get("args"), dict) else {} for e in events]
    df = pd.DataFrame(
        {
            "ph": [str(e.get("ph", "")) for e in events],
            "cat": [str(e.get("cat", "")).lower() for e in events],
            "name": [str(e.get("name", "")) for e in events],
            "pid": [str(e.get("pid", "")) for e in events],
            "tid": [str(e.get("tid", "")) for e in events],
            "ts_us": _num([e.get("ts") for e in events]),
            "dur_us": _num([e.get("dur") for e in events]),
            "device": _num([a.get("device") for a in args]),
            "stream": _num([a.get("stream") for a in args]),
            "correlation": _num([a.get("correlation") for a in args]),
        }
    )
    df["args"] = args
    return df


def _thread_names(df: pd.DataFrame) -> dict[tuple[str, str], str]:
    meta = df[(df["ph"] == "M") & (df["name"] == "thread_name")]
    return {
        (p, t): str(a.get("name", ""))
        for p, t, a in zip(meta["pid"], meta["tid"], meta["args"], strict=False)
    }


def _tracks(x: pd.DataFrame, thread_names: dict[tuple[str, str], str]) -> pd.DataFrame:
    """Assign ``track``/``role``/``device`` to complete events; returns the tracks frame."""
    role = x["cat"].map(_DEVICE_CATS)
    is_dev = role.notna().to_numpy()
    device = np.where(np.isnan(x["device"]), pd.to_numeric(x["pid"], errors="coerce"), x["device"])
    device = np.nan_to_num(device, nan=0).astype(np.int64)
    lane = role.map({ROLE_COMPUTE: "compute", ROLE_COPY: "copy", ROLE_ANNOTATION: "annotations"})
    dev_track = "gpu:" + pd.Series(device, index=x.index).astype(str) + " " + lane.fillna("")
    pid_tid = zip(
        x["pid"].to_numpy(object).tolist(), x["tid"].to_numpy(object).tolist(), strict=False
    )
    cpu_track = [thread_names.get(pt) or f"thread {pt[1]}" for pt in pid_tid]
    known_cpu = x["cat"].isin(_CPU_CATS).to_numpy()
    x["track"] = np.where(is_dev, dev_track.to_numpy(object), np.asarray(cpu_track, dtype=object))
    x["role"] = np.where(is_dev, role.to_numpy(object), np.where(known_cpu, ROLE_CPU, ROLE_OTHER))
    x["device_index"] = np.where(is_dev, device, -1)
    keys = x.drop_duplicates("track")[["track", "role", "device_index", "pid", "tid"]]
    keys = keys.reset_index(drop=True)
    x["track_id"] = x["track"].map(pd.Series(keys.index, index=keys["track"])).to_numpy(np.int64)
    return pd.DataFrame(
        {
            "track_id": keys.index.to_numpy(np.int64),
            "uuid": keys.index.to_numpy(np.uint64),
            "parent_id": np.full(len(keys), -1, dtype=np.int64),
            "name": keys["track"].to_numpy(object),
            "role": np.where(keys["role"] == ROLE_OTHER, ROLE_CPU, keys["role"]).astype(object),
            "pid": pd.to_numeric(keys["pid"], errors="coerce").fillna(-1).to_numpy(np.int64),
            "tid": pd.to_numeric(keys["tid"], errors="coerce").fillna(-1).to_numpy(np.int64),
            "device": keys["device_index"].to_numpy(np.int64),
        }
    )


def _mark_waits(x: pd.DataFrame) -> None:
    """Rename synchronising runtime calls to ``wait_output`` (kind sync / d2h_copy)."""
    copies = x[(x["cat"] == "gpu_memcpy") & x["correlation"].notna()]
    d2h = copies["name"].str.contains("DtoH|Device -> Pageable|Pageable", regex=True)
    d2h_corr = set(copies["correlation"][d2h].tolist())
    pageable = set(copies["correlation"][copies["name"].str.contains("Pageable")].tolist())
    runtime = x["cat"].isin(["cuda_runtime", "cuda_driver"])
    is_sync = runtime & x["raw_name"].isin(SYNC_CALLS)
    corr = x["correlation"]
    blocking_copy = runtime & (
        (
            x["raw_name"].isin(["cudaMemcpy", "cuMemcpyDtoH", "cuMemcpyDtoH_v2"])
            & corr.isin(d2h_corr)
        )
        | (x["raw_name"].str.startswith("cudaMemcpy") & corr.isin(pageable))
    )
    x.loc[is_sync, ["name", "kind"]] = [CpuSlice.WAIT_OUTPUT.value, WAIT_SYNC]
    x.loc[blocking_copy & ~is_sync, ["name", "kind"]] = [CpuSlice.WAIT_OUTPUT.value, WAIT_D2H]


def _assign_steps(x: pd.DataFrame) -> None:
    """Steps from envelopes (else consecutive schedules); kernels take their launch's step."""
    cpu = (x["role"] == ROLE_CPU).to_numpy()
    env = x[cpu & (x["name"] == CpuSlice.STEP.value).to_numpy()]
    if len(env):
        e_s, e_e = env["ts_ns"].to_numpy(), env["end_ns"].to_numpy()
        order = np.argsort(e_s, kind="stable")
        idx = assign(x["ts_ns"].to_numpy(), e_s[order], e_e[order])
        env_step = env["step"].to_numpy(np.int64)[order]
        env_step = np.where(env_step >= 0, env_step, np.arange(order.size))
        step = np.where(idx >= 0, env_step[np.maximum(idx, 0)], -1)
    else:
        sched = np.sort(
            x.loc[cpu & (x["name"] == CpuSlice.SCHEDULE.value).to_numpy(), "ts_ns"].to_numpy()
        )
        step = (
            np.searchsorted(sched, x["ts_ns"].to_numpy(), side="right") - 1
            if sched.size
            else np.full(len(x), -1)
        )
    step = np.where(cpu, step, -1).astype(np.int64)
    dev = ~cpu & x["correlation"].notna().to_numpy()
    launches = pd.Series(step[cpu], index=x["correlation"].to_numpy()[cpu])
    launches = launches[launches.index.notna() & (launches.to_numpy() >= 0)]
    launches = launches[~launches.index.duplicated()]
    step[dev] = launches.reindex(x["correlation"].to_numpy()[dev]).fillna(-1).to_numpy(np.int64)
    x["step"] = step


def _syncs(x: pd.DataFrame) -> pd.DataFrame:
    cpu = x[x["role"] == ROLE_CPU]
    hit = cpu[
        (cpu["name"] == CpuSlice.WAIT_OUTPUT.value) & cpu["kind"].isin([WAIT_SYNC, WAIT_D2H])
        | cpu["raw_name"].isin(_SCALAR_OPS)
    ]
    if hit.empty:
        return empty_frame(SYNC_COLUMNS)
    hot_ranges = cpu[cpu["name"].isin(_HOT)]
    hot_u = union(hot_ranges["ts_ns"].to_numpy(), hot_ranges["end_ns"].to_numpy())
    return pd.DataFrame(
        {
            "ts_ns": hit["ts_ns"].to_numpy(np.int64),
            "track": hit["track"].to_numpy(object),
            "op": hit["raw_name"].to_numpy(object),
            "where": hit["step"].map(lambda s: f"step {s}" if s >= 0 else "").to_numpy(object),
            "stack": np.full(len(hit), "", dtype=object),
            "hot": assign(hit["ts_ns"].to_numpy(), *hot_u) >= 0,
        }
    )


def _slices(x: pd.DataFrame, prof: Profile) -> pd.DataFrame:
    x["ts_ns"] = np.round(x["ts_us"].to_numpy() * 1e3).astype(np.int64)
    x["dur_ns"] = np.round(np.nan_to_num(x["dur_us"].to_numpy(), nan=0.0).clip(min=0) * 1e3).astype(
        np.int64
    )
    x["end_ns"] = x["ts_ns"] + x["dur_ns"]
    x["raw_name"] = x["name"]
    x["kind"] = ""
    x["step"] = -1
    x = x.sort_values(["ts_ns", "end_ns"], ascending=[True, False], kind="stable").reset_index(
        drop=True
    )
    x = prof.apply(x)
    _mark_waits(x)
    _assign_steps(x)
    depth = nesting_depth(
        x["track_id"].to_numpy(np.int64), x["ts_ns"].to_numpy(), x["end_ns"].to_numpy()
    )
    x["depth"] = np.where(x["role"].isin([ROLE_CPU, ROLE_OTHER]), depth, 0).astype(np.int32)
    x["slice_id"] = np.arange(len(x), dtype=np.int64)
    return x


def load_kineto(data: bytes, profile: Profile | str | None = None) -> TraceFrames:
    """Frames of a Kineto JSON trace held in ``data`` (already decompressed)."""
    prof = get_profile(profile or "vllm")
    events, extra = _events(data)
    df = _columns(events)
    complete = df[(df["ph"] == "X") & np.isfinite(df["ts_us"].to_numpy())].copy()
    if complete.empty:
        raise TraceError(
            f"the trace holds no complete ('X') events ({len(df)} events): metadata only, nothing to analyse"
        )
    tracks = _tracks(complete, _thread_names(df))
    x = _slices(complete, prof)
    cpu = (x["role"] == ROLE_CPU).to_numpy()
    corr = x["correlation"].to_numpy()
    mention = ~np.isnan(corr) & (cpu | x["role"].isin([ROLE_COMPUTE, ROLE_COPY]).to_numpy())
    flows = flows_from_mentions(
        corr[mention].astype(np.uint64),
        x["slice_id"].to_numpy()[mention],
        x["ts_ns"].to_numpy()[mention],
        ~cpu[mention],
    )
    slices = x[
        [
            "slice_id",
            "track_id",
            "track",
            "role",
            "name",
            "raw_name",
            "ts_ns",
            "dur_ns",
            "end_ns",
            "depth",
            "step",
            "kind",
            "stream",
            "correlation",
        ]
    ].copy()
    slices["stream"] = slices["stream"].astype("Int64")
    slices["correlation"] = slices["correlation"].astype("Int64")
    unknown = sorted(set(complete["cat"]) - set(_DEVICE_CATS) - _CPU_CATS)
    metadata: dict[str, Any] = {
        "format": "kineto",
        "profile": prof.name,
        "bytes_total": len(data),
        "bytes_dropped": 0,
        "num_events": len(df),
        "unknown_categories": unknown,
    }
    for key in ("schemaVersion", "distributedInfo", "deviceProperties", "baseTimeNanoseconds"):
        if key in extra:
            metadata[key] = extra[key]
    frames = TraceFrames.empty()
    frames.slices, frames.tracks, frames.flows = categorize(slices), tracks, flows
    frames.syncs = _syncs(x)
    frames.instants = categorize(_instants(df, tracks))
    frames.counters = _counters(df)
    frames.metadata = metadata
    return frames


def _instants(df: pd.DataFrame, tracks: pd.DataFrame) -> pd.DataFrame:
    inst = df[df["ph"].isin(["i", "I"]) & np.isfinite(df["ts_us"].to_numpy())]
    if inst.empty:
        return empty_frame(INSTANT_COLUMNS)
    return pd.DataFrame(
        {
            "track_id": np.full(len(inst), -1, dtype=np.int64),
            "track": ("thread " + inst["tid"]).to_numpy(object),
            "scope": np.full(len(inst), "thread", dtype=object),
            "name": inst["name"].to_numpy(object),
            "ts_ns": np.round(inst["ts_us"].to_numpy() * 1e3).astype(np.int64),
        }
    )


def _counters(df: pd.DataFrame) -> pd.DataFrame:
    c = df[(df["ph"] == "C") & np.isfinite(df["ts_us"].to_numpy())]
    rows = [
        (f"{n}.{k}" if len(a) > 1 else n, t, v)
        for n, t, a in zip(c["name"], c["ts_us"], c["args"], strict=False)
        for k, v in a.items()
        if isinstance(v, (int, float))
    ]
    if not rows:
        return empty_frame(COUNTER_COLUMNS)
    name, ts, value = zip(*rows, strict=False)
    return pd.DataFrame(
        {
            "track_id": -1,
            "name": list(name),
            "ts_ns": np.round(np.asarray(ts) * 1e3).astype(np.int64),
            "value": np.asarray(value, dtype=np.float64),
        }
    ).astype(COUNTER_COLUMNS)
