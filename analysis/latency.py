"""Request latency from per-request tracks: TTFT, TPOT, end-to-end (docs/design.md §5.9).

Per request: arrival = start of its first slice (``queued``, else ``prefill``); first token =
end of the last ``prefill`` slice (chunked prefill writes several); finish = end of its last
slice. TPOT = (finish - first token) / (output tokens - 1), with the token count from a
``num_output_tokens`` arg on the request's slices when present, else one token per ``decode``
slice plus the first.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.frames import ROLE_REQUEST, require_columns
from instrument.schema import RequestSlice, parse_request_track_name

__all__ = ["LATENCY_COLUMNS", "request_latency", "percentiles", "NUM_OUTPUT_TOKENS_KEY"]

NUM_OUTPUT_TOKENS_KEY = "num_output_tokens"  # proposed schema Arg
LATENCY_COLUMNS = {
    "request_id": "object",
    "arrival_ns": "int64",
    "first_token_ns": "int64",
    "finish_ns": "int64",
    "num_output_tokens": "int64",
    "ttft_ms": "float64",
    "tpot_ms": "float64",
    "e2e_ms": "float64",
}


def request_latency(slices: pd.DataFrame) -> pd.DataFrame:
    """One row per request that produced a first token. Columns: LATENCY_COLUMNS."""
    require_columns(slices, ["role", "track", "name", "ts_ns", "end_ns"], "request_latency")
    req = slices[slices["role"] == ROLE_REQUEST]
    if req.empty:
        return pd.DataFrame({k: pd.Series(dtype=v) for k, v in LATENCY_COLUMNS.items()})
    req = req.assign(request_id=req["track"].map(lambda t: parse_request_track_name(t) or t))
    by = req.groupby("request_id")
    prefill = req[req["name"] == RequestSlice.PREFILL.value].groupby("request_id")["end_ns"].max()
    decodes = (req["name"] == RequestSlice.DECODE.value).groupby(req["request_id"]).sum()
    df = pd.DataFrame({"arrival_ns": by["ts_ns"].min(), "finish_ns": by["end_ns"].max()})
    df["first_token_ns"] = prefill
    df = df.dropna(subset=["first_token_ns"])
    tokens = decodes.reindex(df.index).fillna(0) + 1
    if NUM_OUTPUT_TOKENS_KEY in req.columns:
        explicit = pd.to_numeric(by[NUM_OUTPUT_TOKENS_KEY].max(), errors="coerce").reindex(df.index)
        tokens = explicit.fillna(tokens)
    df["num_output_tokens"] = tokens.astype(np.int64)
    df["ttft_ms"] = (df["first_token_ns"] - df["arrival_ns"]) / 1e6
    df["e2e_ms"] = (df["finish_ns"] - df["arrival_ns"]) / 1e6
    gen = (df["finish_ns"] - df["first_token_ns"]) / 1e6
    df["tpot_ms"] = np.where(
        df["num_output_tokens"] > 1, gen / (df["num_output_tokens"] - 1), np.nan
    )
    df = df.reset_index()
    return df[list(LATENCY_COLUMNS)].astype(LATENCY_COLUMNS)


def percentiles(values: pd.Series) -> dict[str, float | None]:
    """``{"p50", "p95", "p99", "mean", "count"}`` of the finite values (None when there are none)."""
    v = values.to_numpy(np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return {"p50": None, "p95": None, "p99": None, "mean": None, "count": 0}
    p50, p95, p99 = np.percentile(v, [50, 95, 99])
    return {
        "p50": float(p50),
        "p95": float(p95),
        "p99": float(p99),
        "mean": float(v.mean()),
        "count": int(v.size),
    }
