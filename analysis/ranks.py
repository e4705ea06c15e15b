"""A set of tensor-parallel rank traces on one timeline: per-rank metrics, stragglers, collectives.

Each rank of a tensor-parallel run writes its own trace (``<run>.rank<i>.pftrace``, with ``rank``,
``world_size`` and ``clock_offset_ns`` in its ``trace_metadata``; or a Kineto ``.json[.gz]`` with
``distributedInfo.rank`` / ``world_size``, whatever its file name). :func:`load_rank_set` reads a
list of such files or a directory of them; traces from different hosts are shifted by their
measured clock offset onto rank 0's clock (on one host CLOCK_MONOTONIC is shared and the measured
offset is only noise within ``clock_rtt_ns / 2``, so nothing is shifted).

Tables (DataFrame in, DataFrame out):

* :func:`forward_table` -- each rank's ``forward`` device slice per step (on a Kineto trace,
  which has kernels instead: the span of the step's kernels);
* :func:`straggler_table` -- per step, the rank whose forward ends last (the straggler), and how
  far the ranks' forward ends and starts are apart;
* :func:`collective_table` -- per rank and step, the host-timed collectives (``all_reduce`` /
  ``all_gather`` slices, CPU device) and the *arrival wait*: how long this rank's forward started
  before the last rank's, i.e. what it waits at the step's first collective (device traces only,
  so it is there on GPUs too, where collectives are not timed one by one).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from analysis.frames import ROLE_COMPUTE, ROLE_KERNEL, TraceError, TraceFrames, require_columns
from analysis.load import DEFAULT_MAX_DECOMPRESSED_MB, load_trace
from instrument.schema import Arg, DeviceSlice, ParallelSlice, parse_rank_trace_path

__all__ = [
    "RankSet",
    "load_rank_set",
    "rank_trace_files",
    "forward_table",
    "straggler_table",
    "collective_table",
    "COLLECTIVES",
]

COLLECTIVES = (ParallelSlice.ALL_REDUCE.value, ParallelSlice.ALL_GATHER.value)
# NCCL's device kernels (Kineto traces): each one is a collective (or send/recv) on the device.
NCCL_KERNEL = r"nccl(?:Dev)?Kernel_"  # matched at the start of the kernel name
_KINETO_SUFFIXES = (".json", ".json.gz")
FORWARD_COLUMNS = {"step": "int64", "rank": "int64", "start_ns": "int64", "end_ns": "int64"}
STRAGGLER_COLUMNS = {
    "step": "int64",
    "straggler_rank": "int64",
    "end_spread_ns": "int64",
    "last_start_rank": "int64",
    "start_spread_ns": "int64",
    "forward_max_ns": "int64",
    "forward_min_ns": "int64",
}
COLLECTIVE_COLUMNS = {
    "step": "int64",
    "rank": "int64",
    "num_collectives": "int64",
    "collective_ns": "int64",
    "arrival_wait_ns": "int64",
}


@dataclass
class RankSet:
    """The loaded traces of one run, by rank. ``clock_shift_ns[r]`` was subtracted from every
    timestamp of rank r (0 when all ranks ran on one host); ``notes``: what was odd."""

    frames: dict[int, TraceFrames]
    world_size: int
    clock_shift_ns: dict[int, int]
    same_host: bool
    notes: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.frames)


def rank_trace_files(paths: list[str]) -> list[str]:
    """The trace files named by ``paths``: files as given; a directory -> its
    ``*.rank<i>.pftrace`` files in rank order, else its Kineto ``*.json`` / ``*.json.gz`` files
    (their ranks come from ``distributedInfo`` when loaded). Raises :class:`TraceError` when
    none."""
    files: list[str] = []
    for path in paths:
        if not os.path.isdir(path):
            files.append(path)
            continue
        runs: dict[str, list[tuple[int, str]]] = {}
        for name in os.listdir(path):
            parsed = parse_rank_trace_path(name)
            if parsed is not None:
                runs.setdefault(parsed[0], []).append((parsed[1], os.path.join(path, name)))
        if not runs:
            kineto = sorted(n for n in os.listdir(path) if n.endswith(_KINETO_SUFFIXES))
            if not kineto:
                raise TraceError(
                    f"{path}: no <name>.rank<i>.pftrace or Kineto .json[.gz] files in this directory"
                )
            files.extend(os.path.join(path, n) for n in kineto)
            continue
        if len(runs) > 1:
            raise TraceError(
                f"{path}: rank traces of several runs ({', '.join(sorted(runs))}); "
                "give one run's files"
            )
        files.extend(f for _, f in sorted(runs.popitem()[1]))
    return files


def load_rank_set(
    paths: list[str],
    profile: str | None = None,
    max_decompressed_mb: float = DEFAULT_MAX_DECOMPRESSED_MB,
) -> RankSet:
    """Load every rank trace of ``paths`` (files and/or directories; see
    :func:`rank_trace_files`). Raises :class:`TraceError` on duplicate ranks or mixed runs."""
    frames: dict[int, TraceFrames] = {}
    sizes = set()
    for path in rank_trace_files(paths):
        f = load_trace(path, profile, max_decompressed_mb)
        parsed = parse_rank_trace_path(os.path.basename(path))
        rank = f.metadata.get(Arg.RANK.value, parsed[1] if parsed else None)
        if rank is None:
            raise TraceError(
                f"{path}: no rank in the trace metadata (Kineto: distributedInfo.rank) "
                "or the file name (<name>.rank<i>.pftrace)"
            )
        if int(rank) in frames:
            raise TraceError(f"{path}: rank {rank} given twice")
        frames[int(rank)] = f
        sizes.add(int(f.metadata.get(Arg.WORLD_SIZE.value, 0) or 0))
    sizes.discard(0)
    if len(sizes) > 1:
        raise TraceError(f"traces of different runs: world sizes {sorted(sizes)}")
    world_size = sizes.pop() if sizes else len(frames)
    notes = []
    missing = sorted(set(range(world_size)) - set(frames))
    if missing:
        listed = missing if len(missing) <= 10 else f"{_ranges(missing)} ({len(missing)} ranks)"
        notes.append(f"ranks {listed} of {world_size} missing: the tables cover the others")
    hosts = {f.metadata.get("host") for f in frames.values()}
    same_host = len(hosts) <= 1
    shift = {
        r: 0 if same_host else int(f.metadata.get(Arg.CLOCK_OFFSET_NS.value, 0) or 0)
        for r, f in frames.items()
    }
    frames = {r: _shifted(f, shift[r]) for r, f in frames.items()}
    return RankSet(frames, world_size, shift, same_host, notes)


def _ranges(values: list[int]) -> str:
    """``[2, 3, 4, 7]`` -> ``"2-4, 7"``."""
    parts: list[str] = []
    start = prev = values[0]
    for v in [*values[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(f"{start}-{prev}" if prev > start else f"{start}")
        if v is not None:
            start = prev = v
    return ", ".join(parts)


def _shifted(frames: TraceFrames, shift_ns: int) -> TraceFrames:
    """``frames`` on rank 0's clock: every timestamp minus ``shift_ns``."""
    if shift_ns == 0:
        return frames
    slices = frames.slices.assign(
        ts_ns=frames.slices["ts_ns"] - shift_ns, end_ns=frames.slices["end_ns"] - shift_ns
    )
    moved = {
        name: getattr(frames, name).assign(ts_ns=getattr(frames, name)["ts_ns"] - shift_ns)
        for name in ("instants", "counters", "decisions", "syncs")
    }
    return replace(frames, slices=slices, **moved)


def forward_table(ranks: RankSet) -> pd.DataFrame:
    """Each rank's ``forward`` device slice per step. Columns: ``step``, ``rank``, ``start_ns``,
    ``end_ns`` (int64; one row per step and rank, the step's first start / last end). A rank
    without ``forward`` slices (a Kineto trace: kernels, not stages) gives the span of its
    stepped compute kernels instead."""
    parts = []
    for rank, f in ranks.frames.items():
        s = f.slices
        require_columns(s, ["role", "name", "step", "ts_ns", "end_ns"], "forward_table")
        compute = s[s["role"] == ROLE_COMPUTE]
        fw = compute[compute["name"] == DeviceSlice.FORWARD.value]
        if fw.empty:
            fw = compute
        fw = fw[fw["step"] >= 0].groupby("step", as_index=False)
        parts.append(fw.agg(start_ns=("ts_ns", "min"), end_ns=("end_ns", "max")).assign(rank=rank))
    if not parts:
        return pd.DataFrame({k: pd.Series(dtype=v) for k, v in FORWARD_COLUMNS.items()})
    df = pd.concat(parts, ignore_index=True)[list(FORWARD_COLUMNS)]
    return df.astype(FORWARD_COLUMNS).sort_values(["step", "rank"]).reset_index(drop=True)


def straggler_table(forwards: pd.DataFrame) -> pd.DataFrame:
    """Per step seen by every rank of ``forwards``: ``straggler_rank`` (forward ends last),
    ``end_spread_ns`` (last end - first end), ``last_start_rank``, ``start_spread_ns``,
    ``forward_max_ns`` / ``forward_min_ns`` (longest / shortest forward of the step)."""
    require_columns(forwards, FORWARD_COLUMNS, "straggler_table")
    if forwards.empty:
        return pd.DataFrame({k: pd.Series(dtype=v) for k, v in STRAGGLER_COLUMNS.items()})
    num_ranks = forwards["rank"].nunique()
    df = forwards.assign(dur_ns=forwards["end_ns"] - forwards["start_ns"])
    df = df[df.groupby("step")["rank"].transform("nunique") == num_ranks]
    g = df.groupby("step")
    out = pd.DataFrame(
        {
            "straggler_rank": df.loc[g["end_ns"].idxmax(), ["step", "rank"]].set_index("step")[
                "rank"
            ],
            "end_spread_ns": g["end_ns"].max() - g["end_ns"].min(),
            "last_start_rank": df.loc[g["start_ns"].idxmax(), ["step", "rank"]].set_index("step")[
                "rank"
            ],
            "start_spread_ns": g["start_ns"].max() - g["start_ns"].min(),
            "forward_max_ns": g["dur_ns"].max(),
            "forward_min_ns": g["dur_ns"].min(),
        }
    ).reset_index()
    return out.astype(STRAGGLER_COLUMNS)


def collective_table(ranks: RankSet, forwards: pd.DataFrame) -> pd.DataFrame:
    """Per rank and step: ``num_collectives`` and ``collective_ns`` (host-timed collective slices
    inside the step's device slices; 0 where they are not recorded) and ``arrival_wait_ns``
    (the last rank's forward start minus this rank's: the wait at the first collective)."""
    require_columns(forwards, FORWARD_COLUMNS, "collective_table")
    arrival = forwards.assign(
        arrival_wait_ns=forwards.groupby("step")["start_ns"].transform("max") - forwards["start_ns"]
    )[["step", "rank", "arrival_wait_ns"]]
    measured = [_collectives_by_step(f.slices).assign(rank=r) for r, f in ranks.frames.items()]
    df = (
        arrival.merge(pd.concat(measured), on=["step", "rank"], how="left") if measured else arrival
    )
    df = df.reindex(columns=list(COLLECTIVE_COLUMNS)).fillna(0)
    return df.astype(COLLECTIVE_COLUMNS).sort_values(["step", "rank"]).reset_index(drop=True)


def _collectives_by_step(slices: pd.DataFrame) -> pd.DataFrame:
    """``step``, ``num_collectives``, ``collective_ns`` of one rank: each collective slice is
    assigned to the stepped compute slice of its track that contains it; each NCCL kernel
    counts in its own step (the step of its launch)."""
    device = slices[slices["role"].isin([ROLE_COMPUTE, ROLE_KERNEL])]
    nccl = device[device["raw_name"].str.match(NCCL_KERNEL) & (device["step"] >= 0)]
    compute = slices[slices["role"] == ROLE_COMPUTE]
    is_coll = compute["name"].isin(COLLECTIVES)
    coll, parents = compute[is_coll], compute[~is_coll & (compute["step"] >= 0)]
    rows = [
        pd.DataFrame({"step": nccl["step"].to_numpy(np.int64), "dur": nccl["dur_ns"].to_numpy()})
    ]
    for track, cs in coll.groupby("track"):
        ps = parents[parents["track"] == track].sort_values("ts_ns")
        p_ts, p_end = ps["ts_ns"].to_numpy(np.int64), ps["end_ns"].to_numpy(np.int64)
        c_ts, c_end = cs["ts_ns"].to_numpy(np.int64), cs["end_ns"].to_numpy(np.int64)
        i = np.searchsorted(p_ts, c_ts, side="right") - 1
        inside = (i >= 0) & (c_end <= p_end[np.maximum(i, 0)])
        steps = ps["step"].to_numpy(np.int64)[np.maximum(i, 0)][inside]
        rows.append(pd.DataFrame({"step": steps, "dur": (c_end - c_ts)[inside]}))
    if not rows:
        return pd.DataFrame({"step": [], "num_collectives": [], "collective_ns": []})
    df = pd.concat(rows).groupby("step", as_index=False)
    return df.agg(num_collectives=("dur", "size"), collective_ns=("dur", "sum"))
