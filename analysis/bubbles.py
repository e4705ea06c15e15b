"""Device bubbles (maximal idle intervals) and who the CPU was busy with during them (§4).

Blame goes to the *deepest* CPU slice running at each instant of a bubble (its exclusive time),
so a ``wait_output`` nested in ``step`` is blamed, never the ``step`` envelope. A bubble's blame is
the label with the largest share of its time; time with no CPU slice running is
``(no cpu slice)``. When several CPU threads run blameable slices at once, each gets the time.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.build import nesting_depth
from analysis.frames import ROLE_CPU, require_columns
from analysis.intervals import Union, complement, intersect_measure, overlap_pairs, union
from instrument.schema import CpuSlice

__all__ = ["NO_CPU", "find_bubbles", "blame_label", "blame_bubbles", "blame_table"]

NO_CPU = "(no cpu slice)"
_CANONICAL = {s.value for s in CpuSlice} - {CpuSlice.STEP.value}
BUBBLE_COLUMNS = {"bubble_id": "int64", "start_ns": "int64", "end_ns": "int64", "dur_ns": "int64"}


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


def _candidates(slices: pd.DataFrame, envelopes: tuple[str, ...]) -> pd.DataFrame:
    cpu = slices[(slices["role"] == ROLE_CPU) & ~slices["name"].isin(envelopes)]
    canonical = cpu["name"].isin(_CANONICAL)
    # Engines annotated with canonical names are blamed on those; others on whatever ran.
    return cpu[canonical] if canonical.any() else cpu


def _exclusive_segments(cpu: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(start, end, owner row)`` pieces where each candidate slice is the deepest one running."""
    track = cpu["track_id"].to_numpy(np.int64)
    ts, end = cpu["ts_ns"].to_numpy(np.int64), cpu["end_ns"].to_numpy(np.int64)
    n = ts.size
    depth = nesting_depth(track, ts, end).astype(np.int64)
    left = pd.DataFrame({"row": np.arange(n), "track": track, "ts": ts, "key": depth - 1})
    right = pd.DataFrame({"parent": np.arange(n), "track": track, "ts": ts, "key": depth})
    merged = pd.merge_asof(
        left.sort_values("ts"),
        right.sort_values("ts"),
        on="ts",
        by=["track", "key"],
        direction="backward",
        allow_exact_matches=True,
    )
    parent = np.full(n, -1, dtype=np.int64)
    parent[merged["row"].to_numpy()] = merged["parent"].fillna(-1).to_numpy(np.int64)
    parent[depth == 0] = -1
    # Events: a start makes its slice the owner; an end hands ownership back to the parent.
    ev_t = np.concatenate((ts, end))
    ev_owner = np.concatenate((np.arange(n), parent))
    ev_track = np.concatenate((track, track))
    ev_order = np.concatenate((np.ones(n), np.zeros(n)))
    ev_depth = np.concatenate((depth, -depth))
    order = np.lexsort((ev_depth, ev_order, ev_t, ev_track))
    t, owner, tr = ev_t[order], ev_owner[order], ev_track[order]
    same = tr[1:] == tr[:-1]
    seg_s, seg_e, seg_o = t[:-1][same], t[1:][same], owner[:-1][same]
    keep = (seg_e > seg_s) & (seg_o >= 0)
    return seg_s[keep], seg_e[keep], seg_o[keep]


def blame_bubbles(
    bubbles: pd.DataFrame, slices: pd.DataFrame, envelopes: tuple[str, ...] = ("step",)
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Blame each bubble; returns ``(bubbles, pieces)``.

    ``bubbles`` gains ``blame`` (label), ``blame_ns`` and ``blame_share`` (of the bubble's blamed
    time). ``pieces`` has one row per (bubble, label): ``bubble_id``, ``label``, ``idle_ns``.
    """
    require_columns(bubbles, BUBBLE_COLUMNS, "blame_bubbles")
    require_columns(
        slices, ["role", "name", "kind", "track_id", "ts_ns", "end_ns"], "blame_bubbles"
    )
    cpu = _candidates(slices, envelopes)
    b_u = (bubbles["start_ns"].to_numpy(np.int64), bubbles["end_ns"].to_numpy(np.int64))
    labels = blame_label(cpu["name"].to_numpy(object), cpu["kind"].to_numpy(object))
    seg_s, seg_e, seg_o = _exclusive_segments(cpu)
    seg_idx, bub_idx, ps, pe = overlap_pairs(seg_s, seg_e, b_u)
    pieces = pd.DataFrame(
        {"bubble_id": bub_idx, "label": labels[seg_o[seg_idx]], "idle_ns": pe - ps}
    )
    covered = union(cpu["ts_ns"].to_numpy(np.int64), cpu["end_ns"].to_numpy(np.int64))
    uncovered = bubbles["dur_ns"].to_numpy(np.int64) - intersect_measure(*b_u, covered)
    none = pd.DataFrame(
        {"bubble_id": bubbles["bubble_id"].to_numpy(), "label": NO_CPU, "idle_ns": uncovered}
    )
    pieces = pd.concat([pieces, none[none["idle_ns"] > 0]], ignore_index=True)
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
