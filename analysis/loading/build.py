"""Vectorised helpers shared by the loaders: slice pairing, nesting depth, argument pivoting."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis.frames import categorical_from_codes

__all__ = [
    "ArgTable",
    "SlicePairs",
    "pair_begin_end",
    "nesting_depth",
    "nesting_parent",
    "unique_first_inverse",
    "grouped_cumsum",
    "pivot_args",
]

VT_INT, VT_DOUBLE, VT_BOOL, VT_STR = 0, 1, 2, 3
# Columns that get a sentinel instead of a nullable dtype so metrics can use plain numpy.
_SENTINEL_INT = {"step": -1}
_SENTINEL_STR = {"kind": ""}


@dataclass(frozen=True)
class ArgTable:
    """Arguments in long form: one row per (target row, key, value).

    ``row``: index of the owning row in the target frame; ``key``: code into ``keys``;
    ``vtype``: one of int/double/bool/str; ``ival`` int64, ``dval`` float64, ``sval`` code into
    ``strings`` (meaningful per ``vtype``).
    """

    row: np.ndarray
    key: np.ndarray
    vtype: np.ndarray
    ival: np.ndarray
    dval: np.ndarray
    sval: np.ndarray
    keys: list[str]
    strings: list[str]

    def remap_rows(self, new_row: np.ndarray) -> ArgTable:
        """Send each arg to ``new_row[row]``; args whose new row is -1 are dropped."""
        target = new_row[self.row] if self.row.size else self.row
        keep = target >= 0
        return ArgTable(
            target[keep],
            self.key[keep],
            self.vtype[keep],
            self.ival[keep],
            self.dval[keep],
            self.sval[keep],
            self.keys,
            self.strings,
        )


@dataclass(frozen=True)
class SlicePairs:
    """Matched begin/end events. ``begin``/``end`` index the input events; ``depth`` per slice."""

    begin: np.ndarray
    end: np.ndarray
    depth: np.ndarray
    num_unterminated: int
    num_unmatched_ends: int


def grouped_cumsum(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Inclusive cumulative sum of ``values`` within each key, in input order per key."""
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    csum = np.cumsum(values[order])
    first = np.ones(order.shape[0], dtype=bool)
    first[1:] = sorted_keys[1:] != sorted_keys[:-1]
    group_begin = np.maximum.accumulate(np.where(first, np.arange(order.shape[0]), 0))
    offset = (csum - values[order])[group_begin]
    out = np.empty_like(csum)
    out[order] = csum - offset
    return out


def pair_begin_end(track: np.ndarray, ts: np.ndarray, is_begin: np.ndarray) -> SlicePairs:
    """Match SLICE_BEGIN/SLICE_END events per track by nesting level (a stack, vectorised).

    Events are taken in (track, ts, input order). The level before a begin equals the level after
    its end, and within one (track, level) begins and ends alternate, so pairing is "each begin
    with the next event of its group when that is an end". Begins left open (a cut-off trace)
    and ends without a begin are counted, not guessed at.
    """
    n = ts.shape[0]
    if n == 0:
        z = np.zeros(0, dtype=np.int64)
        return SlicePairs(z, z, z.astype(np.int32), 0, 0)
    order = np.lexsort((np.arange(n), ts, track))
    delta = np.where(is_begin[order], 1, -1).astype(np.int64)
    level_after = grouped_cumsum(track[order], delta)
    level = np.where(delta > 0, level_after - 1, level_after)
    tr = track[order]
    group_order = np.lexsort((np.arange(n), level, tr))
    g_track, g_level = tr[group_order], level[group_order]
    g_begin = delta[group_order] > 0
    same_next = np.zeros(n, dtype=bool)
    same_next[:-1] = (g_track[1:] == g_track[:-1]) & (g_level[1:] == g_level[:-1])
    next_is_end = np.zeros(n, dtype=bool)
    next_is_end[:-1] = ~g_begin[1:]
    paired = g_begin & same_next & next_is_end
    b_pos = np.nonzero(paired)[0]
    begin = order[group_order[b_pos]]
    end = order[group_order[b_pos + 1]]
    num_begins = int(is_begin.sum())
    num_ends = n - num_begins
    # Depth is relative to the track's shallowest level (unmatched ends push levels below 0).
    lv = g_level[b_pos]
    min_level = pd.Series(lv).groupby(g_track[b_pos]).transform("min").to_numpy()
    depth = (lv - np.minimum(min_level, 0)).astype(np.int32)
    keep = np.argsort(begin, kind="stable")
    return SlicePairs(
        begin[keep],
        end[keep],
        depth[keep],
        num_begins - b_pos.size,
        num_ends - b_pos.size,
    )


def nesting_depth(track: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Depth of each interval among intervals of its track, assuming proper nesting.

    depth = (intervals of the track that started before it, in (start asc, end desc) order)
    minus (those that ended at or before its start).
    """
    return _nesting(track, start, end)[0]


def nesting_parent(
    track: np.ndarray, start: np.ndarray, end: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(depth, parent)`` of each interval among those of its track (proper nesting assumed):
    :func:`nesting_depth`, and the row of the interval it sits in (-1 at depth 0): the last
    interval of the track one level up before it in (start asc, end desc) order."""
    depth, order = _nesting(track, start, end)
    n = depth.size
    parent = np.full(n, -1, dtype=np.int64)
    if n == 0:
        return depth, parent
    # Positions in sorted order, grouped by (track, depth) and ascending within a group: the
    # parent of position k is the last position before k in group (track, depth[k] - 1).
    tr = track[order]
    first = np.ones(n, dtype=bool)
    first[1:] = tr[1:] != tr[:-1]
    levels = int(depth.max()) + 2
    key = (np.cumsum(first) - 1) * levels + depth[order].astype(np.int64)
    by_key = np.argsort(key, kind="stable")
    packed = key[by_key] * n + by_key
    pos = np.arange(n)
    at = np.searchsorted(packed, (key - 1) * n + pos) - 1
    found = packed[np.maximum(at, 0)]
    ok = (at >= 0) & (found // n == key - 1) & (depth[order] > 0)
    parent[order[ok]] = order[found[ok] % n]
    return depth, parent


def _nesting(
    track: np.ndarray, start: np.ndarray, end: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Depths (see :func:`nesting_depth`) and the (track, start asc, end desc) order."""
    n = start.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64)
    order = _track_start_end_order(track, start, end)
    tr, st = track[order], start[order]
    first = np.ones(n, dtype=bool)
    first[1:] = tr[1:] != tr[:-1]
    group_begin = np.maximum.accumulate(np.where(first, np.arange(n), 0))
    rank = np.arange(n) - group_begin
    # Ends sorted within each track: offset ends by track so one searchsorted serves all tracks.
    track_codes = np.cumsum(first) - 1
    span = int(end.max() - start.min()) + 1
    base = int(start.min())
    key_end = np.sort(track_codes * span + (end[order] - base))
    key_start = track_codes * span + (st - base)
    ended = np.searchsorted(key_end, key_start, side="right") - group_begin
    depth = np.empty(n, dtype=np.int32)
    depth[order] = np.maximum(rank - ended, 0)
    return depth, order


def unique_first_inverse(key: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(key, return_index=True, return_inverse=True)`` for int keys; keys spanning a
    small range (a few codes per row at most) are counted instead of sorted."""
    n = key.size
    if n == 0:
        return np.unique(key, return_index=True, return_inverse=True)
    lo, hi = int(key.min()), int(key.max())
    if hi - lo > 4 * n:
        return np.unique(key, return_index=True, return_inverse=True)
    k = (key - lo).astype(np.int64)
    first_at = np.full(hi - lo + 1, n, dtype=np.int64)
    np.minimum.at(first_at, k, np.arange(n, dtype=np.int64))
    present = first_at < n
    slot = np.cumsum(present) - 1  # a present key's index among the distinct keys
    return np.flatnonzero(present) + lo, first_at[present], slot[k]


def _track_start_end_order(track: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """``np.lexsort((-end, start, track))``. Rows already in (start asc, end desc) order (the
    loaders sort slices so) need only a stable sort by track, a radix sort for small ids."""
    d_start = np.diff(start)
    if not ((d_start > 0) | ((d_start == 0) & (np.diff(end) <= 0))).all():
        return np.lexsort((-end, start, track))
    lo, hi = int(track.min()), int(track.max())
    if hi - lo < 2**15:  # 16-bit keys: numpy's stable sort is then a radix sort
        return np.argsort((track - lo).astype(np.int16), kind="stable")
    return np.argsort(track, kind="stable")


def _column_for(key: str, n: int, rows: np.ndarray, args: ArgTable, sel: np.ndarray) -> object:
    vt = args.vtype[sel]
    types = set(np.unique(vt).tolist())
    r = rows[sel]
    if types == {VT_INT} and key in _SENTINEL_INT:
        col = np.full(n, _SENTINEL_INT[key], dtype=np.int64)
        col[r] = args.ival[sel]
        return col
    if types == {VT_INT}:
        values = np.zeros(n, dtype=np.int64)
        mask = np.ones(n, dtype=bool)
        values[r], mask[r] = args.ival[sel], False
        return pd.arrays.IntegerArray(values, mask)
    if types <= {VT_INT, VT_DOUBLE}:
        col = np.full(n, np.nan)
        col[r] = np.where(vt == VT_INT, args.ival[sel].astype(np.float64), args.dval[sel])
        return col
    if types == {VT_BOOL}:
        values = np.zeros(n, dtype=bool)
        mask = np.ones(n, dtype=bool)
        values[r], mask[r] = args.ival[sel] != 0, False
        return pd.arrays.BooleanArray(values, mask)
    fill = _SENTINEL_STR.get(key)
    if types == {VT_STR} and fill is not None:
        codes = np.full(n, len(args.strings), dtype=np.int64)
        codes[r] = args.sval[sel]
        return categorical_from_codes(codes, [*args.strings, fill])
    strings = np.asarray(args.strings + [None], dtype=object)
    col = np.full(n, fill, dtype=object)
    as_str = strings[np.where(vt == VT_STR, args.sval[sel], len(args.strings))]
    as_obj = np.where(
        vt == VT_STR,
        as_str,
        np.where(
            vt == VT_BOOL,
            (args.ival[sel] != 0).astype(object),
            np.where(vt == VT_DOUBLE, args.dval[sel].astype(object), args.ival[sel].astype(object)),
        ),
    )
    col[r] = as_obj
    return col


def pivot_args(n: int, args: ArgTable, reserved: set[str]) -> dict[str, object]:
    """Wide columns (one per key) for a frame of ``n`` rows.

    A key that clashes with a ``reserved`` core column is renamed ``arg.<key>``. ``step`` becomes
    int64 with -1 for absent, ``kind`` a category column with "" for absent; other int args are nullable
    ``Int64``, bools nullable ``boolean``, mixed or string args object columns.
    """
    out: dict[str, object] = {}
    if args.row.size == 0:
        return out
    for code in np.unique(args.key).tolist():
        key = args.keys[code]
        sel = args.key == code
        name = f"arg.{key}" if key in reserved else key
        out[name] = _column_for(key, n, args.row, args, sel)
    return out
