"""Request latency from per-request tracks: TTFT, TPOT, end-to-end (docs/design.md §5.9).

Per request: arrival = start of its first slice (``queued``, else ``prefill``); first token =
end of the last ``prefill`` slice (chunked prefill writes several); finish = end of its last
slice. TPOT = (finish - first token) / (output tokens - 1), with the token count from a
``num_output_tokens`` arg on the request's slices when present, else one token per ``decode``
slice plus the first.

A request that produced a first token is counted wherever the trace holds it. When its prefill is not in the trace (its
steps were left out: warm-up, a step range, sampling), ``prefill_hidden`` is True: its first token
time is unknown, so ``ttft_ms`` and ``tpot_ms`` are NaN (``first_token_ns`` is then the start of
its first visible slice after arrival, an upper bound), and ``e2e_ms`` is kept only when its
``queued`` slice (its arrival) is in the trace.
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
    "prefill_hidden": "bool",
}


def request_latency(slices: pd.DataFrame) -> pd.DataFrame:
    """One row per request that produced a first token and that the trace holds, its prefill in
    it or not (see the module docstring). Columns: LATENCY_COLUMNS."""
    require_columns(slices, ["role", "track", "name", "ts_ns", "end_ns"], "request_latency")
    req = slices[slices["role"] == ROLE_REQUEST]
    if req.empty:
        return pd.DataFrame({k: pd.Series(dtype=v) for k, v in LATENCY_COLUMNS.items()})
    req = req.assign(request_id=req["track"].map(lambda t: parse_request_track_name(t) or t))
    by = req.groupby("request_id")
    prefill = req[req["name"] == RequestSlice.PREFILL.value].groupby("request_id")["end_ns"].max()
    decodes = (req["name"] == RequestSlice.DECODE.value).groupby(req["request_id"]).sum()
    queued = (req["name"] == RequestSlice.QUEUED.value).groupby(req["request_id"]).any()
    not_queued = req[req["name"] != RequestSlice.QUEUED.value].groupby("request_id")["ts_ns"].min()
    df = pd.DataFrame({"arrival_ns": by["ts_ns"].min(), "finish_ns": by["end_ns"].max()})
    # Requests that produced a first token: a prefill or a decode slice in the trace.
    df = df[df.index.isin(prefill.index) | (decodes.reindex(df.index).fillna(0) > 0)].copy()
    df["prefill_hidden"] = ~df.index.isin(prefill.index)
    df["first_token_ns"] = prefill.reindex(df.index).fillna(not_queued.reindex(df.index))
    df["first_token_ns"] = df["first_token_ns"].fillna(df["finish_ns"])
    tokens = decodes.reindex(df.index).fillna(0) + 1
    if NUM_OUTPUT_TOKENS_KEY in req.columns:
        explicit = pd.to_numeric(by[NUM_OUTPUT_TOKENS_KEY].max(), errors="coerce").reindex(df.index)
        tokens = explicit.fillna(tokens)
    df["num_output_tokens"] = tokens.astype(np.int64)
    hidden = df["prefill_hidden"].to_numpy()
    df["ttft_ms"] = np.where(hidden, np.nan, (df["first_token_ns"] - df["arrival_ns"]) / 1e6)
    arrived = queued.reindex(df.index).fillna(False).to_numpy(bool) | ~hidden
    df["e2e_ms"] = np.where(arrived, (df["finish_ns"] - df["arrival_ns"]) / 1e6, np.nan)
    gen = (df["finish_ns"] - df["first_token_ns"]) / 1e6
    df["tpot_ms"] = np.where(
        (df["num_output_tokens"] > 1) & ~hidden, gen / (df["num_output_tokens"] - 1), np.nan
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
