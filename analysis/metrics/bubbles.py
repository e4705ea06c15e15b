"""Device bubbles (maximal idle intervals) and who the CPU was busy with during them (§4).

Each instant of a bubble gets one label, chosen in tiers (the first tier running wins):

1. a canonical slice (``schedule``, ``wait_output(sync)``, ...; DESIGN.md §3) running on any
   thread, the deepest one: the engine's own words, used only where such a slice covers the time;
2. the deepest slice of a thread that launches device work (a thread with a
   ``cudaLaunchKernel``/``hipLaunchKernel``/memcpy-style runtime call or a slice sharing a
   kernel's ``correlation``, or a thread holding canonical slices); every CPU thread when no
   thread is known to launch;
3. the deepest slice of any other thread doing work;
4. ``(cpu waiting)``: a launching thread was itself waiting (a ``threading.py(...): wait``,
   sleep, lock or queue wait frame, or anything nested in one): the host had nothing to do;
5. ``(no cpu slice)``: nothing ran (other threads that wait, a tqdm monitor, do not count).

Never labels: the profile's envelopes (``step``), the profiler's own whole-trace span
(``PyTorch Profiler (0)``, Kineto ``"cat": "Trace"``). When several threads of one tier run at
once, the deepest slice (trace nesting depth) wins, so each instant has one label. A bubble's blame is the label with the largest share of its time, so a
10 µs sync inside a 1 ms bubble spent in ``aten::copy_`` does not name the bubble.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from analysis.frames import ROLE_COMPUTE, ROLE_COPY, ROLE_CPU, require_columns
from analysis.intervals import (
    Union,
    assign,
    complement,
    intersect,
    overlap_pairs,
    union,
    unique_sorted,
)
from analysis.loading.build import nesting_parent
from instrument.schema import CpuSlice

__all__ = [
    "NO_CPU",
    "CPU_WAITING",
    "find_bubbles",
    "blame_label",
    "blame_bubbles",
    "blame_table",
    "is_profiler_span",
    "is_wait_frame",
    "launch_tracks",
]

NO_CPU = "(no cpu slice)"
CPU_WAITING = "(cpu waiting)"
_CANONICAL = {s.value for s in CpuSlice} - {CpuSlice.STEP.value}
_BLAME_INPUT = ["name", "raw_name", "kind", "track_id", "ts_ns", "end_ns", "depth"]
BUBBLE_COLUMNS = {"bubble_id": "int64", "start_ns": "int64", "end_ns": "int64", "dur_ns": "int64"}
# The profiler's own spans over the whole capture (Kineto "cat": "Trace" events).
_PROFILER_SPAN = re.compile(
    r"^(PyTorch Profiler|__cupti_profiler__|MTIA Activity Trace|__MTIA_CCP_events__) \(-?\d+\)$"
)
# Frames of a thread that is waiting, not working (Python stack names as torch.profiler's
# with_stack writes them, and the C functions they call).
_WAIT_FRAME = re.compile(
    r"^threading\.py\(\d+\): (wait|join|_wait_for_tstate_lock)$"
    r"|^queue\.py\(\d+\): get$"
    r"|^selectors\.py\(\d+\): select$"
    r"|^tqdm/_monitor\.py\(\d+\): run$"
    r"|^multiprocessing/(connection|synchronize)\.py\(\d+\): (wait|poll|_poll|recv|recv_bytes|__enter__)$"
    r"|^asyncio/base_events\.py\(\d+\): _run_once$"
    r"|^(time\.)?sleep$|^<built-in function sleep>$"
    r"|^<built-in method (acquire|wait|poll|select|epoll|recv|recv_into|sleep)\b"
)
# Runtime calls that put work on a device (CUDA runtime/driver, HIP).
_LAUNCH_CALL = re.compile(r"^(cuda|hip|cu)(Ext)?(Module)?(Launch|GraphLaunch|Memcpy|Memset)")


def _name_flags(names: pd.Series, pattern: re.Pattern[str]) -> np.ndarray:
    """``pattern.search`` per row, evaluated once per distinct name."""
    if isinstance(names.dtype, pd.CategoricalDtype):
        codes, distinct = names.cat.codes.to_numpy(), names.cat.categories
    else:
        codes, distinct = pd.factorize(names.astype(str))
    hit = np.fromiter((bool(pattern.search(str(v))) for v in distinct), bool, len(distinct))
    return np.append(hit, False)[codes]  # code -1 (missing) -> the appended False


def is_profiler_span(names: pd.Series) -> np.ndarray:
    """True where a raw name is the profiler's own whole-capture span (never blamed)."""
    return _name_flags(names, _PROFILER_SPAN)


def is_wait_frame(names: pd.Series) -> np.ndarray:
    """True where a raw name is a frame of a waiting thread (wait, sleep, lock, queue get)."""
    return _name_flags(names, _WAIT_FRAME)


def _member(values: np.ndarray, distinct: np.ndarray) -> np.ndarray:
    """``values[i] in distinct`` for a sorted distinct array (no ``np.isin``/``np.unique``)."""
    if distinct.size == 0:
        return np.zeros(values.shape, bool)
    at = np.minimum(np.searchsorted(distinct, values), distinct.size - 1)
    return distinct[at] == values


def launch_tracks(slices: pd.DataFrame) -> np.ndarray:
    """Track ids of the CPU threads that put work on a device: a launch/memcpy runtime call, a
    slice sharing a device slice's ``correlation`` (Kineto), or a canonical slice (the engine
    thread). Empty when none is known."""
    cpu = (slices["role"] == ROLE_CPU).to_numpy(bool)  # row masks, no frame copies
    hit = _name_flags(slices["raw_name"], _LAUNCH_CALL) | slices["name"].isin(_CANONICAL).to_numpy(
        bool
    )
    if "correlation" in slices.columns:
        dev = slices["role"].isin([ROLE_COMPUTE, ROLE_COPY]).to_numpy(bool)
        corr = slices["correlation"].to_numpy(np.float64, na_value=np.nan)
        dev_corr = unique_sorted(corr[dev & ~np.isnan(corr)])
        hit[cpu] |= _member(corr[cpu], dev_corr)
    return unique_sorted(slices["track_id"].to_numpy(np.int64)[cpu & hit])


def _waiting(cpu: pd.DataFrame) -> np.ndarray:
    """True for wait frames and every slice nested in one on the same thread."""
    wait = is_wait_frame(cpu["raw_name"])
    out = wait.copy()
    track = cpu["track_id"].to_numpy(np.int64)
    ts, end = cpu["ts_ns"].to_numpy(np.int64), cpu["end_ns"].to_numpy(np.int64)
    for t in unique_sorted(track[wait]):  # few threads ever wait
        mine = track == t
        w_s, w_e = union(ts[mine & wait], end[mine & wait])
        k = assign(ts[mine], w_s, w_e)
        inside = (k >= 0) & (end[mine] <= w_e[np.maximum(k, 0)])
        out[np.flatnonzero(mine)[inside]] = True
    return out


def find_bubbles(busy: Union, start_ns: int, end_ns: int) -> pd.DataFrame:
    """Maximal idle intervals of the device inside ``[start_ns, end_ns)``.

    Columns: ``bubble_id``, ``start_ns``, ``end_ns``, ``dur_ns`` (int64), in time order.
    """
    s, e = complement(busy, start_ns, end_ns) if end_ns > start_ns else (np.zeros(0, np.int64),) * 2
    return pd.DataFrame(
        {"bubble_id": np.arange(s.size), "start_ns": s, "end_ns": e, "dur_ns": e - s}
    ).astype(BUBBLE_COLUMNS)


def blame_label(name: np.ndarray, kind: np.ndarray) -> np.ndarray:
    """``wait_output(accepted_count)`` style labels: the name, with the kind when there is one."""
    name = name.astype(object)
    kind = kind.astype(object)
    with_kind = kind != ""
    out = name.copy()
    out[with_kind] = name[with_kind] + "(" + kind[with_kind] + ")"
    return out


def _exclusive_segments(
    track: np.ndarray, ts: np.ndarray, end: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(start, end, owner row)`` pieces where each candidate slice (int64 track, start and end
    per row) is the deepest one running."""
    n = ts.size
    if n == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    depth, parent = nesting_parent(track, ts, end)
    depth = depth.astype(np.int64)
    # Events: a start makes its slice the owner; an end hands ownership back to the parent.
    ev_t = np.concatenate((ts, end))
    ev_owner = np.concatenate((np.arange(n), parent))
    ev_track = np.concatenate((track, track))
    ev_order = np.concatenate((np.ones(n, np.int64), np.zeros(n, np.int64)))
    ev_depth = np.concatenate((depth, -depth))
    order = _event_order(ev_track, ev_t, ev_order, ev_depth)
    t, owner, tr = ev_t[order], ev_owner[order], ev_track[order]
    same = tr[1:] == tr[:-1]
    seg_s, seg_e, seg_o = t[:-1][same], t[1:][same], owner[:-1][same]
    keep = (seg_e > seg_s) & (seg_o >= 0)
    return seg_s[keep], seg_e[keep], seg_o[keep]


def _event_order(
    track: np.ndarray, t: np.ndarray, start: np.ndarray, depth: np.ndarray
) -> np.ndarray:
    """``np.lexsort((depth, start, t, track))`` of int64 keys: one stable argsort of the four
    keys packed into one int64 when they fit (twice as fast on 400k events), else the lexsort."""
    lo_track, lo_t, lo_depth = int(track.min()), int(t.min()), int(depth.min())
    n_track = int(track.max()) - lo_track + 1
    n_t = int(t.max()) - lo_t + 1
    n_depth = int(depth.max()) - lo_depth + 1
    if n_track * n_t * 2 * n_depth >= 2**62:
        return np.lexsort((depth, start, t, track))
    key = ((track - lo_track) * n_t + (t - lo_t)) * 2 + start
    return np.argsort(key * n_depth + (depth - lo_depth), kind="stable")


def _tier_pieces(
    seg: tuple[np.ndarray, np.ndarray, np.ndarray], labels: np.ndarray, left: Union
) -> tuple[pd.DataFrame, Union]:
    """Pieces of the still-unlabelled idle time ``left`` that segments cover, and what is left."""
    s, e, owner = seg
    i, _, ps, pe = overlap_pairs(s, e, left)
    pieces = pd.DataFrame({"start_ns": ps, "label": labels[owner[i]], "idle_ns": pe - ps})
    if not left[0].size:
        return pieces, left
    lo, hi = int(left[0][0]), int(left[1][-1])
    return pieces, intersect(left, complement(union(s, e), lo, hi))


def _segments(
    track: np.ndarray, ts: np.ndarray, end: np.ndarray, keep: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exclusive segments of the deepest slice among the rows ``keep``; owners index all rows."""
    rows = np.flatnonzero(keep)
    s, e, o = _exclusive_segments(track[rows], ts[rows], end[rows])
    return s, e, rows[o]


def _deepest_across_threads(
    seg: tuple[np.ndarray, np.ndarray, np.ndarray], depth: np.ndarray, track: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One owner per instant: where several threads' segments overlap, the deepest slice wins
    (ties: the lower track id), so a thread parked in a shallow range (a main thread inside
    ``## backward ##`` while the autograd thread launches) does not take the time."""
    s, e, owner = seg
    if s.size == 0:
        return seg
    owner_track = track[owner]
    if (owner_track == owner_track[0]).all():  # one thread (the usual case): disjoint segments,
        order = np.argsort(s, kind="stable")  # which the sweep below would return in start order
        return s[order], e[order], owner[order]
    edges = unique_sorted(np.concatenate((s, e)))
    lo, hi = edges[:-1], edges[1:]
    best_depth = np.full(lo.size, -1, dtype=np.int64)
    best_owner = np.full(lo.size, -1, dtype=np.int64)
    for t in unique_sorted(owner_track):  # one pass per thread; segments of a thread are disjoint
        mine = np.flatnonzero(owner_track == t)
        mine = mine[np.argsort(s[mine], kind="stable")]
        k = assign(lo, s[mine], e[mine])
        who = owner[mine][np.maximum(k, 0)]
        d = np.where(k >= 0, depth[who], -1)
        better = d > best_depth
        best_depth[better], best_owner[better] = d[better], who[better]
    keep = best_owner >= 0
    return lo[keep], hi[keep], best_owner[keep]


def blame_bubbles(
    bubbles: pd.DataFrame, slices: pd.DataFrame, envelopes: tuple[str, ...] = ("step",)
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Blame each bubble by the tiers of the module docstring; returns ``(bubbles, pieces)``.

    ``bubbles`` gains ``blame`` (label), ``blame_ns`` and ``blame_share`` (of the bubble's blamed
    time). ``pieces`` has one row per (bubble, label): ``bubble_id``, ``label``, ``idle_ns``.
    """
    require_columns(bubbles, BUBBLE_COLUMNS, "blame_bubbles")
    require_columns(slices, ["role", *_BLAME_INPUT], "blame_bubbles")
    candidate = (
        (slices["role"] == ROLE_CPU).to_numpy(bool)
        & ~slices["name"].isin(envelopes).to_numpy(bool)
        & ~is_profiler_span(slices["raw_name"])
    )  # one take of the columns used here, not of the whole frame
    cpu = slices.loc[candidate, _BLAME_INPUT].reset_index(drop=True)
    labels = blame_label(cpu["name"].to_numpy(object), cpu["kind"].to_numpy(object))
    waiting = _waiting(cpu)
    canonical = cpu["name"].isin(_CANONICAL).to_numpy(bool) & ~waiting
    launchers = launch_tracks(slices)
    on_launcher = (
        np.isin(cpu["track_id"].to_numpy(np.int64), launchers)
        if launchers.size
        else np.ones(len(cpu), bool)
    )
    depth = cpu["depth"].to_numpy(np.int64)
    track = cpu["track_id"].to_numpy(np.int64)
    ts, end = cpu["ts_ns"].to_numpy(np.int64), cpu["end_ns"].to_numpy(np.int64)
    seg_all = _exclusive_segments(track, ts, end)
    working = ~waiting[seg_all[2]]
    launcher_seg = on_launcher[seg_all[2]]
    tiers = [
        (_segments(track, ts, end, canonical), labels),
        (tuple(a[working & launcher_seg] for a in seg_all), labels),
        (tuple(a[working & ~launcher_seg] for a in seg_all), labels),
        (
            tuple(a[~working & launcher_seg] for a in seg_all),
            np.full(len(cpu), CPU_WAITING, dtype=object),
        ),
    ]
    tiers = [(_deepest_across_threads(seg, depth, track), names) for seg, names in tiers]
    b_s = bubbles["start_ns"].to_numpy(np.int64)
    b_e = bubbles["end_ns"].to_numpy(np.int64)
    left: Union = (b_s, b_e)
    found = []
    for seg, names in tiers:
        pieces, left = _tier_pieces(seg, names, left)
        found.append(pieces)
    found.append(pd.DataFrame({"start_ns": left[0], "label": NO_CPU, "idle_ns": left[1] - left[0]}))
    pieces = pd.concat(found, ignore_index=True)
    pieces["bubble_id"] = bubbles["bubble_id"].to_numpy(np.int64)[
        assign(pieces["start_ns"].to_numpy(np.int64), b_s, b_e)
    ]
    pieces = pieces.groupby(["bubble_id", "label"], as_index=False, sort=True)["idle_ns"].sum()
    pieces = pieces.astype({"bubble_id": "int64", "label": "object", "idle_ns": "int64"})
    total = pieces.groupby("bubble_id")["idle_ns"].transform("sum")
    top = (
        pieces.assign(share=pieces["idle_ns"] / total)
        .sort_values(["bubble_id", "idle_ns"], ascending=[True, False], kind="stable")
        .drop_duplicates("bubble_id")
    )
    out = bubbles.merge(
        top.rename(columns={"label": "blame", "idle_ns": "blame_ns", "share": "blame_share"}),
        on="bubble_id",
        how="left",
    )
    out["blame"] = out["blame"].fillna(NO_CPU).astype(object)
    out["blame_ns"] = out["blame_ns"].fillna(0).astype(np.int64)
    out["blame_share"] = out["blame_share"].fillna(0.0).astype(np.float64)
    return out, pieces


def blame_table(pieces: pd.DataFrame) -> pd.DataFrame:
    """Idle time per label over all bubbles: ``label``, ``idle_ns``, ``share`` (of blamed time),
    largest first."""
    require_columns(pieces, ["label", "idle_ns"], "blame_table")
    table = pieces.groupby("label", as_index=False)["idle_ns"].sum()
    total = table["idle_ns"].sum()
    table["share"] = table["idle_ns"] / total if total else 0.0
    return (
        table.sort_values("idle_ns", ascending=False, kind="stable")
        .reset_index(drop=True)
        .astype({"label": "object", "idle_ns": "int64", "share": "float64"})
    )
