"""Typed trace frames: the one in-memory shape every loader produces and every metric reads.

Column contracts (``*_ns`` are int64 nanoseconds on one host clock):

* ``slices``: ``slice_id`` int64, ``track_id`` int64, ``track`` category, ``role`` category
  (``cpu``, ``compute``, ``copy``, ``request``, ``annotation``, ``other``), ``name`` category
  (canonical stepscope name when the profile maps it, else the raw name), ``raw_name`` category,
  ``ts_ns``, ``dur_ns``, ``end_ns`` int64, ``depth`` int32, ``step`` int64 (-1 when the slice
  carries no step), ``kind`` category ("" when absent), then one column per other argument key.
* ``instants``: ``track_id``, ``track`` category, ``scope`` category (``thread``/``process``/
  ``track``), ``name`` category, ``ts_ns``, then one column per argument key.

Text columns with few distinct values (``CATEGORY_COLUMNS``) are ``category`` with sorted string
categories, so masks, takes and group-bys on a million-slice frame stay cheap, and comparing or
sorting them reads as for strings. Their values are plain ``str``; to write a value that may be
new, convert the column (``to_numpy(object)``) and call :func:`categorize` again.
* ``counters``: ``track_id``, ``name``, ``ts_ns``, ``value`` float64.
* ``flows``: ``flow_id`` uint64, ``src_slice_id``, ``dst_slice_id`` int64 (-1 when unknown).
* ``tracks``: ``track_id`` int64, ``uuid`` uint64, ``parent_id`` int64, ``name``, ``role``,
  ``pid``, ``tid``, ``device`` int64 (-1 when not applicable).
* ``decisions``: ``feature`` str, ``requested`` object (True/False/None), ``resolved`` bool,
  ``reason`` str, ``ts_ns`` int64.
* ``syncs``: ``ts_ns`` int64, ``track`` str, ``op`` str, ``where`` str, ``stack`` str, ``hot`` bool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from analysis.errors import TraceError

__all__ = [
    "TraceError",
    "TraceFrames",
    "SLICE_COLUMNS",
    "INSTANT_COLUMNS",
    "COUNTER_COLUMNS",
    "FLOW_COLUMNS",
    "TRACK_COLUMNS",
    "DECISION_COLUMNS",
    "SYNC_COLUMNS",
    "CATEGORY_COLUMNS",
    "categorical_from_codes",
    "categorize",
    "empty_frame",
    "require_columns",
    "ROLE_CPU",
    "ROLE_COMPUTE",
    "ROLE_COPY",
    "ROLE_KERNEL",
    "ROLE_REQUEST",
    "ROLE_ANNOTATION",
    "ROLE_OTHER",
]

ROLE_CPU = "cpu"
ROLE_COMPUTE = "compute"
ROLE_COPY = "copy"
# One slice per CUPTI kernel / memcpy / memset (Kineto, or a --trace-kernels window).
ROLE_KERNEL = "kernel"
ROLE_REQUEST = "request"
ROLE_ANNOTATION = "annotation"
ROLE_OTHER = "other"


SLICE_COLUMNS: dict[str, str] = {
    "slice_id": "int64",
    "track_id": "int64",
    "track": "category",
    "role": "category",
    "name": "category",
    "raw_name": "category",
    "ts_ns": "int64",
    "dur_ns": "int64",
    "end_ns": "int64",
    "depth": "int32",
    "step": "int64",
    "kind": "category",
}
INSTANT_COLUMNS: dict[str, str] = {
    "track_id": "int64",
    "track": "category",
    "scope": "category",
    "name": "category",
    "ts_ns": "int64",
}
COUNTER_COLUMNS: dict[str, str] = {
    "track_id": "int64",
    "name": "object",
    "ts_ns": "int64",
    "value": "float64",
}
FLOW_COLUMNS: dict[str, str] = {
    "flow_id": "uint64",
    "src_slice_id": "int64",
    "dst_slice_id": "int64",
}
TRACK_COLUMNS: dict[str, str] = {
    "track_id": "int64",
    "uuid": "uint64",
    "parent_id": "int64",
    "name": "object",
    "role": "object",
    "pid": "int64",
    "tid": "int64",
    "device": "int64",
}
DECISION_COLUMNS: dict[str, str] = {
    "feature": "object",
    "requested": "object",
    "resolved": "bool",
    "reason": "object",
    "shown": "bool",  # the producer showed the reason to the user (schema Arg.SHOWN)
    "ts_ns": "int64",
}
SYNC_COLUMNS: dict[str, str] = {
    "ts_ns": "int64",
    "track": "object",
    "op": "object",
    "where": "object",
    "stack": "object",
    "hot": "bool",
}


CATEGORY_COLUMNS = ("track", "role", "name", "raw_name", "kind", "scope")


def _empty_column(dtype: str) -> pd.Series:
    if dtype == "category":
        return pd.Series(pd.Categorical(np.zeros(0, dtype=object)))
    return pd.Series(np.zeros(0, dtype=dtype))


def empty_frame(columns: dict[str, str]) -> pd.DataFrame:
    """A zero-row frame with exactly ``columns`` and their dtypes."""
    return pd.DataFrame({k: _empty_column(v) for k, v in columns.items()})


def categorical_from_codes(codes: np.ndarray, labels: list[str] | np.ndarray) -> pd.Categorical:
    """``labels[codes]`` as a categorical with sorted, distinct categories, without building the
    per-row strings (``labels`` may repeat; ``codes`` index into it, all valid)."""
    labels = np.asarray(labels, dtype=object)
    used = np.bincount(codes, minlength=labels.size) > 0  # unused labels make no category
    categories, inverse = np.unique(labels[used], return_inverse=True)
    remap = np.full(labels.size, -1, dtype=np.int64)
    remap[used] = inverse
    # The codes are valid by construction: pandas' range check of every row is skipped.
    return pd.Categorical.from_codes(remap[codes], categories=categories, validate=False)


def categorize(df: pd.DataFrame, columns: tuple[str, ...] = CATEGORY_COLUMNS) -> pd.DataFrame:
    """``df`` with each of ``columns`` it holds as ``category`` (sorted categories); in place."""
    for col in columns:
        if col in df.columns and not isinstance(df[col].dtype, pd.CategoricalDtype):
            df[col] = pd.Categorical(df[col].to_numpy(object))
    return df


def require_columns(df: pd.DataFrame, columns: dict[str, str] | list[str], what: str) -> None:
    """Raise :class:`TraceError` when ``df`` lacks one of ``columns``."""
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise TraceError(f"{what}: frame lacks required column(s) {', '.join(missing)}")


@dataclass
class TraceFrames:
    """Everything a loader read from one trace file.

    ``metadata`` holds ``format`` (``perfetto``/``kineto``), ``path``, ``profile``, ``bytes_total``,
    ``bytes_dropped`` (a cut-off tail), ``unterminated_slices``, ``unmatched_ends``, the
    ``trace_metadata`` instant's args and ``output_digest`` when present. ``config`` holds the
    ``engine_config`` instant's args (the resolved engine configuration, flattened).
    """

    slices: pd.DataFrame
    instants: pd.DataFrame
    counters: pd.DataFrame
    flows: pd.DataFrame
    tracks: pd.DataFrame
    decisions: pd.DataFrame
    syncs: pd.DataFrame
    metadata: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def empty(cls) -> TraceFrames:
        """Frames of a trace with nothing in it (every frame typed, zero rows)."""
        return cls(
            slices=empty_frame(SLICE_COLUMNS),
            instants=empty_frame(INSTANT_COLUMNS),
            counters=empty_frame(COUNTER_COLUMNS),
            flows=empty_frame(FLOW_COLUMNS),
            tracks=empty_frame(TRACK_COLUMNS),
            decisions=empty_frame(DECISION_COLUMNS),
            syncs=empty_frame(SYNC_COLUMNS),
        )
