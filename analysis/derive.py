"""Frames derived from instants, shared by every loader: decisions, syncs, metadata, config."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from analysis.frames import (
    DECISION_COLUMNS,
    FLOW_COLUMNS,
    SYNC_COLUMNS,
    empty_frame,
)
from instrument.schema import Arg, Instant

__all__ = [
    "decisions_from_instants",
    "syncs_from_instants",
    "instant_args",
    "flows_from_mentions",
    "parse_requested",
    "OUTPUT_DIGEST_KEY",
]

# Proposed schema key (not yet in instrument.schema.Arg): an arg of ``trace_metadata`` (or any
# process instant) holding a digest of every request's output tokens, for A/B output agreement.
OUTPUT_DIGEST_KEY = "output_digest"
_CORE = {"track_id", "track", "scope", "name", "ts_ns"}


def parse_requested(value: object) -> bool | None:
    """``requested``/``resolved`` as written by any producer: bool, "True"/"False", None/"auto",
    or the name of a choice (``spec_method``: "ngram" is on, "none" is not requested; docs/design.md §2.1)."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return None
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return bool(value)
    text = str(value).strip().lower()
    if text in ("", "auto", "nan", "none"):
        return None  # "none": not requested (auto) / nothing chosen
    return text not in ("false", "0", "no", "off")


def _present(value: object) -> bool:
    return (
        value is not None
        and value is not pd.NA
        and not (isinstance(value, float) and np.isnan(value))
    )


def instant_args(instants: pd.DataFrame, name: str) -> dict[str, Any]:
    """All args of the instants called ``name`` merged in time order (later values win)."""
    rows = instants[instants["name"] == name].sort_values("ts_ns", kind="stable")
    out: dict[str, Any] = {}
    arg_cols = [c for c in rows.columns if c not in _CORE]
    for record in rows[arg_cols].to_dict("records"):
        for key, value in record.items():
            if _present(value):
                out[key] = value.item() if isinstance(value, np.generic) else value
    return out


def decisions_from_instants(instants: pd.DataFrame) -> pd.DataFrame:
    """``feature_decision`` instants as a typed frame (columns: DECISION_COLUMNS)."""
    rows = instants[instants["name"] == Instant.FEATURE_DECISION.value]
    if rows.empty or Arg.FEATURE.value not in rows.columns:
        return empty_frame(DECISION_COLUMNS)

    def col(key: str, default: object) -> pd.Series:
        if key in rows.columns:
            return rows[key].astype(object).where(rows[key].notna(), default)
        return pd.Series([default] * len(rows), index=rows.index, dtype=object)

    return pd.DataFrame(
        {
            "feature": col(Arg.FEATURE.value, "").astype(str).to_numpy(object),
            "requested": np.array(
                [parse_requested(v) for v in col(Arg.REQUESTED.value, None)], dtype=object
            ),
            "resolved": np.array(
                [bool(parse_requested(v)) for v in col(Arg.RESOLVED.value, False)], dtype=bool
            ),
            "reason": col(Arg.REASON.value, "").astype(str).to_numpy(object),
            "shown": np.array(
                [bool(parse_requested(v)) for v in col(Arg.SHOWN.value, False)], dtype=bool
            ),
            "ts_ns": rows["ts_ns"].to_numpy(np.int64),
        }
    ).reset_index(drop=True)


def syncs_from_instants(instants: pd.DataFrame) -> pd.DataFrame:
    """``sync`` instants as a typed frame (columns: SYNC_COLUMNS); ``hot`` False when absent."""
    rows = instants[instants["name"] == Instant.SYNC.value]
    if rows.empty:
        return empty_frame(SYNC_COLUMNS)

    def text(key: str) -> np.ndarray:
        if key not in rows.columns:
            return np.full(len(rows), "", dtype=object)
        return rows[key].astype(object).where(rows[key].notna(), "").astype(str).to_numpy(object)

    hot = (
        rows[Arg.HOT.value].map(lambda v: bool(parse_requested(v))).to_numpy(bool)
        if Arg.HOT.value in rows.columns
        else np.zeros(len(rows), dtype=bool)
    )
    return pd.DataFrame(
        {
            "ts_ns": rows["ts_ns"].to_numpy(np.int64),
            "track": rows["track"].astype(str).to_numpy(object),
            "op": text(Arg.OP.value),
            "where": text(Arg.WHERE.value),
            "stack": text(Arg.STACK.value),
            "hot": hot,
        }
    )


def flows_from_mentions(
    flow_id: np.ndarray, slice_id: np.ndarray, ts_ns: np.ndarray, terminating: np.ndarray
) -> pd.DataFrame:
    """One row per flow: the earliest non-terminating mention is the source, the terminating
    mention (else the latest) the destination.

    Mentions whose slice is unknown (-1) are dropped first. Columns: FLOW_COLUMNS.
    """
    keep = slice_id >= 0
    if not keep.any():
        return empty_frame(FLOW_COLUMNS)
    df = pd.DataFrame(
        {
            "flow_id": flow_id[keep],
            "slice": slice_id[keep],
            "term": terminating[keep],
            "ts": ts_ns[keep],
        }
    )
    df = df.sort_values(["flow_id", "term", "ts"], kind="stable")
    grouped = df.groupby("flow_id", sort=True)["slice"]
    first, last, count = grouped.first(), grouped.last(), grouped.size()
    return pd.DataFrame(
        {
            "flow_id": first.index.to_numpy(np.uint64),
            "src_slice_id": first.to_numpy(np.int64),
            "dst_slice_id": np.where(count.to_numpy() > 1, last.to_numpy(np.int64), -1),
        }
    )
