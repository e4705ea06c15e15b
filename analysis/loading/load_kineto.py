"""Load a Kineto / torch.profiler Chrome-JSON trace (PyTorch, vLLM, SGLang) into frames.

Mapping onto the stepscope contract:

* ``kernel``, ``gpu_memset`` and MTIA ``mtia_ccp_events`` events become device slices on
  ``gpu:<device> compute``, ``gpu_memcpy`` (and MTIA ``dma_*``) on ``gpu:<device> copy`` (the
  stream is kept in ``stream``); ``gpu_user_annotation`` ranges and MTIA ``event_record`` /
  ``event_wait`` markers go to ``gpu:<device> annotations`` (role ``annotation``, not work);
* CPU events (``cpu_op``, ``user_annotation``, ``python_function``, ``cuda_runtime``,
  ``cuda_driver``, ``mtia_runtime``) become slices on their thread's track; the profile renames
  ranges (``gpu_model_runner: forward`` → ``launch``, ``ProfilerStep#7`` → ``step`` 7, ...);
* CUDA, HIP and MTIA synchronising calls (``cudaStreamSynchronize``, ``hipDeviceSynchronize``,
  ``synchronizeStream``, ... see ``SYNC_CALLS``) become ``wait_output`` with kind ``sync``; a
  blocking copy (``cudaMemcpy``, ``hipMemcpy``, ``hipMemcpyWithStream``, ...) whose copy is
  device-to-host, or any copy into pageable memory, becomes ``wait_output`` with kind
  ``d2h_copy``; each of those, plus ``aten::item``/``aten::_local_scalar_dense``, is also a
  ``sync`` instant (``hot`` when inside ``schedule``/``prepare_inputs``/``launch``);
* ``distributedInfo.rank`` / ``world_size`` become ``metadata["rank"]`` / ``["world_size"]``;
* launch → kernel flows come from the ``correlation`` ids; steps come from step envelopes,
  else from consecutive ``schedule`` ranges; a kernel takes its launch's step.
Events of unknown categories are kept on their thread track with role ``other`` and named in
``metadata["notes"]`` (one line, with counts), never dropped silently. The JSON is decoded by
``analysis.loading.kineto_decode`` (typed, columnar; no per-event Python).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from analysis.frames import (
    COUNTER_COLUMNS,
    DECISION_COLUMNS,
    INSTANT_COLUMNS,
    ROLE_ANNOTATION,
    ROLE_COMPUTE,
    ROLE_COPY,
    ROLE_CPU,
    ROLE_OTHER,
    SYNC_COLUMNS,
    TraceError,
    TraceFrames,
    categorical_from_codes,
    categorize,
    empty_frame,
)
from analysis.intervals import assign, union
from analysis.loading.build import nesting_depth, unique_first_inverse
from analysis.loading.derive import flows_from_mentions
from analysis.loading.kineto_decode import KinetoColumns, decode_kineto
from analysis.loading.profiles import Profile, get_profile
from instrument.schema import Arg, CpuSlice

__all__ = ["load_kineto", "frames_of_columns", "SYNC_CALLS"]

_DEVICE_CATS = {
    "kernel": ROLE_COMPUTE,
    "gpu_memset": ROLE_COMPUTE,
    "gpu_memcpy": ROLE_COPY,
    "gpu_user_annotation": ROLE_ANNOTATION,
    "mtia_ccp_events": ROLE_COMPUTE,  # MTIA device work (markers and DMA: see _roles)
}
# MTIA command-processor events that mark a point or a wait on the device, not work.
_MTIA_MARKERS = frozenset({"event_record", "event_wait"})
# Host runtime calls (CUDA, HIP -- Kineto files HIP calls under cuda_runtime too -- and MTIA).
_RUNTIME_CATS = ("cuda_runtime", "cuda_driver", "runtime", "mtia_runtime")
_CPU_CATS = {
    "runtime",
    "mtia_runtime",
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
        "hipStreamSynchronize",
        "hipEventSynchronize",
        "hipDeviceSynchronize",
        "hipCtxSynchronize",
        "synchronizeStream",  # MTIA runtime
        "synchronize",
    }
)
# Copies that block the host until they finish when they go device-to-host.
_BLOCKING_COPIES = frozenset(
    {
        "cudaMemcpy",
        "cuMemcpyDtoH",
        "cuMemcpyDtoH_v2",
        "hipMemcpy",
        "hipMemcpyWithStream",
        "hipMemcpyDtoH",
    }
)
_SCALAR_OPS = frozenset({"aten::item", "aten::_local_scalar_dense"})
_HOT = (CpuSlice.SCHEDULE.value, CpuSlice.PREPARE_INPUTS.value, CpuSlice.LAUNCH.value)
WAIT_SYNC, WAIT_D2H = "sync", "d2h_copy"


def _complete(ev: pd.DataFrame) -> pd.DataFrame:
    """The complete (``X``) events with a timestamp, categoricals kept."""
    keep = (ev["ph"] == "X").to_numpy() & np.isfinite(ev["ts_us"].to_numpy())
    return ev.drop(columns="ph")[keep].reset_index(drop=True)


def _roles(cat: pd.Series, name: pd.Series) -> pd.Categorical:
    """Role of each complete event from its category (per distinct category, not per event)."""
    cats = cat.cat.categories.to_numpy(object)
    by_cat = np.asarray(
        [_DEVICE_CATS.get(c, ROLE_CPU if c in _CPU_CATS else ROLE_OTHER) for c in cats],
        dtype=object,
    )
    codes = cat.cat.codes.to_numpy().astype(np.int64)
    labels = np.asarray([*by_cat, ROLE_ANNOTATION, ROLE_COPY, ROLE_COMPUTE], dtype=object)
    mtia = (cat == "mtia_ccp_events").to_numpy()
    if mtia.any():  # markers (record/wait on an event) are not work; DMA requests are copies
        raw = name.to_numpy(object)[mtia].astype(str)
        marker = np.isin(raw, list(_MTIA_MARKERS))
        dma = np.char.startswith(raw, "dma")
        n = len(by_cat)
        codes[mtia] = np.where(marker, n, np.where(dma, n + 1, n + 2))
    return categorical_from_codes(codes, labels)


def _tracks(
    x: pd.DataFrame, role: pd.Categorical, thread_names: dict[tuple[str, str], str]
) -> pd.DataFrame:
    """Assign ``track``/``role``/``device_index``/``track_id`` to complete events (names are
    built once per distinct thread or device lane); returns the tracks frame."""
    is_dev = role.isin([ROLE_COMPUTE, ROLE_COPY, ROLE_ANNOTATION])
    pid_num = pd.to_numeric(pd.Series(x["pid"].cat.categories), errors="coerce").to_numpy()
    device = np.where(
        np.isnan(x["device"].to_numpy()), pid_num[x["pid"].cat.codes.to_numpy()], x["device"]
    )
    device = np.where(is_dev, np.nan_to_num(device, nan=0).astype(np.int64), -1)
    lane = np.select(
        [role == ROLE_COMPUTE, role == ROLE_COPY, role == ROLE_ANNOTATION], [0, 1, 2], 3
    )
    p_codes = x["pid"].cat.codes.to_numpy().astype(np.int64)
    t_codes = x["tid"].cat.codes.to_numpy().astype(np.int64)
    n_tid = len(x["tid"].cat.categories) + 1
    # One key per track: device lanes (device, lane) and threads (pid, tid) never collide.
    key = np.where(
        is_dev,
        -(device * 4 + lane) - 1,
        p_codes * n_tid + t_codes,
    )
    _, first, inverse = unique_first_inverse(key)
    pids = x["pid"].cat.categories.to_numpy(object)
    tids = x["tid"].cat.categories.to_numpy(object)
    lanes = ("compute", "copy", "annotations", "")
    key_names = [
        f"gpu:{device[i]} {lanes[lane[i]]}"
        if is_dev[i]
        else (
            thread_names.get((pids[p_codes[i]], tids[t_codes[i]])) or f"thread {tids[t_codes[i]]}"
        )
        for i in first.tolist()
    ]  # one per distinct thread or device lane
    # Tracks are keyed by name (as in the Perfetto loader), ids in order of first appearance.
    order = np.argsort(first, kind="stable")
    name_codes, track_names = pd.factorize(np.asarray(key_names, dtype=object)[order])
    key_track = np.empty(order.size, dtype=np.int64)
    key_track[order] = name_codes
    track_id = key_track[inverse]
    head = first[order][np.unique(name_codes, return_index=True)[1]]  # first event per track
    names = list(track_names)
    roles = [ROLE_CPU if role[i] == ROLE_OTHER else role[i] for i in head.tolist()]
    devs = device[head].tolist()
    tk_pid = pids[p_codes[head]].tolist()
    tk_tid = tids[t_codes[head]].tolist()
    track_names = np.asarray(names, dtype=object)
    x["track"] = categorical_from_codes(track_id, track_names)
    x["role"] = role
    x["device_index"] = device
    x["track_id"] = track_id.astype(np.int64)
    return pd.DataFrame(
        {
            "track_id": np.arange(len(names), dtype=np.int64),
            "uuid": np.arange(len(names), dtype=np.uint64),
            "parent_id": np.full(len(names), -1, dtype=np.int64),
            "name": pd.Series(track_names, dtype=object),
            "role": pd.Series(np.asarray(roles, dtype=object), dtype=object),
            "pid": pd.to_numeric(pd.Series(tk_pid, dtype=object), errors="coerce")
            .fillna(-1)
            .to_numpy(np.int64),
            "tid": pd.to_numeric(pd.Series(tk_tid, dtype=object), errors="coerce")
            .fillna(-1)
            .to_numpy(np.int64),
            "device": np.asarray(devs, dtype=np.int64),
        }
    )


def _mark_waits(x: pd.DataFrame) -> None:
    """Rename synchronising runtime calls to ``wait_output`` (kind sync / d2h_copy)."""
    copies = x[(x["cat"] == "gpu_memcpy") & x["correlation"].notna()]
    d2h = copies["name"].str.contains("DtoH|Device -> Pageable|Pageable", regex=True)
    d2h_corr = set(copies["correlation"][d2h].tolist())
    pageable = set(copies["correlation"][copies["name"].str.contains("Pageable")].tolist())
    runtime = x["cat"].isin(_RUNTIME_CATS).to_numpy(bool)
    raw = x["raw_name"]
    is_sync = runtime & raw.isin(SYNC_CALLS).to_numpy(bool)
    # Copy calls first (a few rows), then their correlations: no hash lookup per event.
    copy_call = runtime & (
        raw.isin(_BLOCKING_COPIES).to_numpy(bool)
        | raw.str.startswith(("cudaMemcpy", "hipMemcpy")).to_numpy(bool)
    )
    rows = np.flatnonzero(copy_call)
    corr = x["correlation"].iloc[rows]
    blocking_copy = np.zeros(len(x), bool)
    blocking_copy[rows] = (
        (raw.iloc[rows].isin(_BLOCKING_COPIES) & corr.isin(d2h_corr))
        | (raw.iloc[rows].str.startswith(("cudaMemcpy", "hipMemcpy")) & corr.isin(pageable))
    ).to_numpy(bool)
    blocking_copy &= ~is_sync
    x["name"] = _with(x["name"], is_sync | blocking_copy, CpuSlice.WAIT_OUTPUT.value)
    x["kind"] = _with(_with(x["kind"], is_sync, WAIT_SYNC), blocking_copy, WAIT_D2H)


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
    cpu = (x["role"] == ROLE_CPU).to_numpy()
    waits = (x["name"] == CpuSlice.WAIT_OUTPUT.value).to_numpy() & x["kind"].isin(
        [WAIT_SYNC, WAIT_D2H]
    ).to_numpy()
    hit = x.loc[cpu & (waits | x["raw_name"].isin(_SCALAR_OPS).to_numpy())]
    if hit.empty:
        return empty_frame(SYNC_COLUMNS)
    hot = cpu & x["name"].isin(_HOT).to_numpy()
    hot_u = union(x["ts_ns"].to_numpy()[hot], x["end_ns"].to_numpy()[hot])
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


_NOT_AFTER_TRACKS = ["pid", "tid", "ts_us", "dur_us", "device", "device_index"]


def _slices(x: pd.DataFrame, prof: Profile) -> pd.DataFrame:
    x["ts_ns"] = np.round(x["ts_us"].to_numpy() * 1e3).astype(np.int64)
    dur_us = np.nan_to_num(x["dur_us"].to_numpy(), nan=0.0).clip(min=0)
    x["dur_ns"] = np.round(dur_us * 1e3).astype(np.int64)
    x["end_ns"] = x["ts_ns"] + x["dur_ns"]
    x["raw_name"] = x["name"]
    x["step"] = -1
    order = np.lexsort((-x["end_ns"].to_numpy(), x["ts_ns"].to_numpy()))
    # The sort moves only the columns read from here on (not the raw times, ids, devices).
    x = x.drop(columns=_NOT_AFTER_TRACKS).take(order).reset_index(drop=True)
    x = _apply_profile(x, prof)
    _mark_waits(x)
    _assign_steps(x)
    depth = nesting_depth(
        x["track_id"].to_numpy(np.int64), x["ts_ns"].to_numpy(), x["end_ns"].to_numpy()
    )
    x["depth"] = np.where(x["role"].isin([ROLE_CPU, ROLE_OTHER]), depth, 0).astype(np.int32)
    x["slice_id"] = np.arange(len(x), dtype=np.int64)
    return x


def _apply_profile(x: pd.DataFrame, prof: Profile) -> pd.DataFrame:
    """``prof.apply`` on one row per distinct (role, raw name), broadcast to every row.

    A profile maps a slice by its role and raw name only (``Profile.apply``), so this equals
    applying it to every row, at the cost of the distinct names instead of the events.
    """
    key = (
        x["role"].cat.codes.to_numpy().astype(np.int64) * (len(x["raw_name"].cat.categories) + 1)
        + x["raw_name"].cat.codes.to_numpy()
    )
    _, first, inverse = unique_first_inverse(key)
    distinct = x.take(first).reset_index(drop=True)
    distinct["name"] = pd.Series(distinct["name"].to_numpy(object), dtype=object)
    distinct["kind"] = pd.Series(np.full(len(distinct), "", dtype=object), dtype=object)
    mapped = prof.apply(distinct)
    x["name"] = categorical_from_codes(inverse, mapped["name"].to_numpy(object))
    x["kind"] = categorical_from_codes(inverse, mapped["kind"].to_numpy(object))
    x["step"] = mapped["step"].to_numpy(np.int64)[inverse]
    return x


def _with(col: pd.Series | pd.Categorical, mask: np.ndarray, value: str) -> pd.Categorical:
    """``col`` (categorical) with ``value`` written where ``mask`` holds (sorted categories)."""
    cat = col.array if isinstance(col, pd.Series) else col
    labels = cat.categories.to_numpy(object)
    codes = cat.codes.astype(np.int64)
    codes[mask] = labels.size
    return categorical_from_codes(codes, [*labels, value])


def _rank_metadata(extra: dict[str, Any]) -> dict[str, Any]:
    """``rank``/``world_size`` from Kineto's ``distributedInfo`` (whatever the file's name)."""
    info = extra.get("distributedInfo")
    out: dict[str, Any] = {}
    if isinstance(info, dict):
        for key in (Arg.RANK.value, Arg.WORLD_SIZE.value):
            value = info.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
                out[key] = int(value)
    return out


def _notes(x: pd.DataFrame) -> tuple[list[str], list[str]]:
    """Categories the diagnosis does not use, and a one-line note naming them with counts."""
    other = x["role"].to_numpy(object) == ROLE_OTHER
    if not other.any():
        return [], []
    counts = pd.Series(x["cat"].to_numpy(object)[other]).value_counts().sort_index()
    names = [str(c) or "(no category)" for c in counts.index]
    listed = ", ".join(f"{n} ({c})" for n, c in zip(names, counts.tolist(), strict=True))
    return names, [
        f"events of categories not analysed (kept on their thread tracks, not device work, "
        f"never blamed as work): {listed}"
    ]


def load_kineto(data: bytes, profile: Profile | str | None = None) -> TraceFrames:
    """Frames of a Kineto JSON trace held in ``data`` (already decompressed)."""
    prof = get_profile(profile or "vllm")
    return frames_of_columns(decode_kineto(data), len(data), prof)


def frames_of_columns(
    cols: KinetoColumns, num_bytes: int, profile: Profile | str | None = None
) -> TraceFrames:
    """Frames of an already decoded Kineto trace of ``num_bytes`` bytes of JSON."""
    prof = get_profile(profile or "vllm")
    ev = cols.events
    if ev.empty:
        raise TraceError("the trace holds no events")
    complete = _complete(ev)
    if complete.empty:
        raise TraceError(
            f"the trace holds no complete ('X') events ({len(ev)} events): metadata only, nothing to analyse"
        )
    role = _roles(complete["cat"], complete["name"])
    tracks = _tracks(complete, role, cols.thread_names)
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
    slices = pd.DataFrame(
        {
            "slice_id": x["slice_id"].to_numpy(),
            "track_id": x["track_id"].to_numpy(),
            "track": x["track"],
            "role": x["role"],
            "name": x["name"],
            "raw_name": x["raw_name"].cat.remove_unused_categories(),
            "ts_ns": x["ts_ns"].to_numpy(),
            "dur_ns": x["dur_ns"].to_numpy(),
            "end_ns": x["end_ns"].to_numpy(),
            "depth": x["depth"].to_numpy(),
            "step": x["step"].to_numpy(np.int64),
            "kind": x["kind"],
            "stream": pd.array(x["stream"].to_numpy(), dtype="Int64"),
            "correlation": pd.array(x["correlation"].to_numpy(), dtype="Int64"),
        }
    )
    unknown, notes = _notes(x)
    metadata: dict[str, Any] = {
        "format": "kineto",
        "profile": prof.name,
        "bytes_total": num_bytes,
        "bytes_dropped": 0,
        "num_events": len(ev),
        "unknown_categories": unknown,
        "notes": notes,
        **_rank_metadata(cols.extra),
    }
    metadata.update(cols.extra)
    frames = TraceFrames(
        slices=slices,
        instants=categorize(_instants(ev)),
        counters=_counters(cols.counters),
        flows=flows,
        tracks=tracks,
        decisions=empty_frame(DECISION_COLUMNS),  # Kineto traces carry no feature decisions
        syncs=_syncs(x),
        metadata=metadata,
    )
    return frames


def _instants(ev: pd.DataFrame) -> pd.DataFrame:
    keep = ev["ph"].isin(["i", "I"]).to_numpy() & np.isfinite(ev["ts_us"].to_numpy())
    inst = ev[keep]
    if inst.empty:
        return empty_frame(INSTANT_COLUMNS)
    return pd.DataFrame(
        {
            "track_id": np.full(len(inst), -1, dtype=np.int64),
            "track": pd.Categorical("thread " + inst["tid"].astype(object)),
            "scope": np.full(len(inst), "thread", dtype=object),
            "name": inst["name"].astype(object).to_numpy(object),
            "ts_ns": np.round(inst["ts_us"].to_numpy() * 1e3).astype(np.int64),
        }
    )


def _counters(counters: list[tuple[str, float, dict[str, Any]]]) -> pd.DataFrame:
    rows = [
        (f"{n}.{k}" if len(a) > 1 else n, t, v)
        for n, t, a in counters
        for k, v in a.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    ]
    if not rows:
        return empty_frame(COUNTER_COLUMNS)
    name, ts, value = zip(*rows, strict=True)
    return pd.DataFrame(
        {
            "track_id": -1,
            "name": pd.Series(name, dtype=object),
            "ts_ns": np.round(np.asarray(ts) * 1e3).astype(np.int64),
            "value": np.asarray(value, dtype=np.float64),
        }
    ).astype(COUNTER_COLUMNS)
