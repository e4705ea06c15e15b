"""Kernel breakdown of a window: computation / communication / memory time, and the top kernels.

The first table HTA users open (HTA's ``get_gpu_kernel_breakdown``), over stepscope's window:

* :func:`kernel_slices` -- the device kernels of a trace: the ``kernel`` lane of a stepscope
  trace (``--trace-kernels``), or every compute/copy slice of a Kineto trace (there each one is
  a CUPTI/roctracer kernel, memcpy or memset). Stage slices (``forward``, ...) are not kernels;
  a stepscope trace without a kernel lane has none.
* :func:`kernel_breakdown` -- per kernel type and per kernel name, the time inside the window.

Kernel types: ``communication`` (NCCL/RCCL kernels), ``memory`` (memcpy and memset), and
``computation`` (everything else). Times are summed kernel durations clipped to the window;
kernels on concurrent streams add up, so the sum may exceed the window's wall time.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from analysis.frames import ROLE_COMPUTE, ROLE_COPY, ROLE_KERNEL, TraceFrames, require_columns

__all__ = [
    "kernel_slices",
    "kernel_breakdown",
    "kernel_type",
    "KERNEL_TYPES",
    "KERNEL_TYPE_COLUMNS",
    "TOP_KERNEL_COLUMNS",
]

COMPUTATION, COMMUNICATION, MEMORY = "computation", "communication", "memory"
KERNEL_TYPES = (COMPUTATION, COMMUNICATION, MEMORY)
_COMMUNICATION_RE = re.compile(r"(?:void\s+)?(?:nccl|rccl)", re.IGNORECASE)  # ncclDevKernel_*...
_MEMORY_RE = re.compile(r"memcpy|memset", re.IGNORECASE)  # "Memcpy DtoH (...)", "Memset (Device)"
KERNEL_TYPE_COLUMNS = {
    "kernel_type": "object",
    "num_kernels": "int64",
    "total_ns": "int64",
    "share": "float64",
}
TOP_KERNEL_COLUMNS = {
    "name": "object",
    "kernel_type": "object",
    "count": "int64",
    "total_ns": "int64",
    "mean_ns": "float64",
    "share": "float64",
}
_NEEDED = ["role", "raw_name", "ts_ns", "end_ns"]


def kernel_slices(frames: TraceFrames) -> pd.DataFrame:
    """The device kernels of ``frames`` (see the module docstring): ``role``, ``raw_name``,
    ``ts_ns``, ``end_ns`` of their slices."""
    s = frames.slices
    require_columns(s, _NEEDED, "kernel_slices")
    lane = (s["role"] == ROLE_KERNEL).to_numpy()
    if not lane.any() and frames.metadata.get("format") == "kineto":
        lane = s["role"].isin([ROLE_COMPUTE, ROLE_COPY]).to_numpy()
    return s.loc[lane, _NEEDED]


def _type_of(name: str, is_copy: bool) -> str:
    if _COMMUNICATION_RE.match(name):
        return COMMUNICATION
    return MEMORY if is_copy or _MEMORY_RE.match(name) else COMPUTATION


def kernel_type(names: pd.Series, roles: pd.Series) -> np.ndarray:
    """``computation`` / ``communication`` / ``memory`` for each kernel (name and role)."""
    codes, uniques = pd.factorize(names.to_numpy(object))
    is_copy = (roles == ROLE_COPY).to_numpy().astype(np.int64)
    keys, inverse = np.unique(codes * 2 + is_copy, return_inverse=True)  # per distinct pair
    labels = [_type_of(str(uniques[k // 2]), bool(k % 2)) for k in keys.tolist()]
    return np.asarray(labels, dtype=object)[inverse]


def _empty(columns: dict[str, str]) -> pd.DataFrame:
    return pd.DataFrame({k: pd.Series(dtype=v) for k, v in columns.items()})


def kernel_breakdown(
    kernels: pd.DataFrame, start_ns: int, end_ns: int, top: int = 10
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Kernel time inside ``[start_ns, end_ns)`` by type, and the ``top`` kernels by time.

    ``kernels``: kernel slices (``role``, ``raw_name``, ``ts_ns``, ``end_ns``), e.g. from
    :func:`kernel_slices`. Each kernel counts with its duration clipped to the window; kernels
    wholly outside it do not count.

    Returns ``(types, top_kernels)``:

    * ``types``: one row per kernel type present, ``kernel_type``, ``num_kernels``,
      ``total_ns``, ``share`` (of all kernel time in the window), largest first;
    * ``top_kernels``: ``name``, ``kernel_type``, ``count``, ``total_ns``, ``mean_ns``
      (``total_ns / count``), ``share``; the ``top`` names by ``total_ns``.
    """
    require_columns(kernels, _NEEDED, "kernel_breakdown")
    ts = kernels["ts_ns"].to_numpy(np.int64)
    end = kernels["end_ns"].to_numpy(np.int64)
    clipped = np.minimum(end, end_ns) - np.maximum(ts, start_ns)
    inside = (clipped > 0) | ((clipped == 0) & (ts >= start_ns) & (ts < end_ns))
    if end_ns <= start_ns or not inside.any():
        return _empty(KERNEL_TYPE_COLUMNS), _empty(TOP_KERNEL_COLUMNS)
    k = kernels[inside]
    df = pd.DataFrame(
        {
            "name": k["raw_name"].astype(object).to_numpy(object),
            "kernel_type": kernel_type(k["raw_name"], k["role"]),
            "dur": np.maximum(clipped[inside], 0),
        }
    )
    total = int(df["dur"].sum())
    types = (
        df.groupby("kernel_type", as_index=False)
        .agg(num_kernels=("dur", "size"), total_ns=("dur", "sum"))
        .sort_values(["total_ns", "kernel_type"], ascending=[False, True])
    )
    types["share"] = types["total_ns"] / total if total else np.nan
    by_name = (
        df.groupby(["name", "kernel_type"], as_index=False)
        .agg(count=("dur", "size"), total_ns=("dur", "sum"))
        .sort_values(["total_ns", "name"], ascending=[False, True])
        .head(top)
    )
    by_name["mean_ns"] = by_name["total_ns"] / by_name["count"]
    by_name["share"] = by_name["total_ns"] / total if total else np.nan
    types = types.reset_index(drop=True).astype(KERNEL_TYPE_COLUMNS)
    return types, by_name[list(TOP_KERNEL_COLUMNS)].reset_index(drop=True).astype(
        TOP_KERNEL_COLUMNS
    )
