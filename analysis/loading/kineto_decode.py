"""Decode Kineto (torch.profiler Chrome-JSON) bytes into the events frame, fast and bounded.

The fast path is ``analysis.loading.kineto_columns`` (msgspec structs with only the fields the
loader reads, columns pulled out in C; no Python code per event); this module turns its columns
into categoricals. A trace that does not fit the typed shape (a string timestamp, an event that
is not an object, ...) is decoded again by the lenient path (any JSON value, coerced per column),
so odd traces still load, only slower.

JSON nested deeper than the decoders can follow is refused with a :class:`TraceError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pandas as pd

from analysis.frames import TraceError, categorical_from_codes
from analysis.loading.kineto_columns import (
    METADATA_KEYS,
    NUMBER_COLUMNS,
    TEXT_COLUMNS,
    EventColumns,
    NoTraceEvents,
    decode_columns,
    text_codes,
)

__all__ = ["KinetoColumns", "decode_kineto", "columns_frame", "METADATA_KEYS"]


@dataclass
class KinetoColumns:
    """One row per event. ``ph``/``cat`` (lower case)/``name``/``pid``/``tid`` str categories,
    ``ts_us``/``dur_us``/``device``/``stream``/``correlation`` float64 (NaN when absent);
    ``thread_names``: (pid, tid) -> name; ``counters``: (name, ts_us, {key: value}) of ``C``
    events; ``extra``: the document's :data:`METADATA_KEYS` that are present."""

    events: pd.DataFrame
    thread_names: dict[tuple[str, str], str]
    counters: list[tuple[str, float, dict[str, Any]]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def decode_kineto(data: bytes) -> KinetoColumns:
    """Columns of a Kineto JSON trace held in ``data`` (already decompressed)."""
    try:
        return columns_frame(decode_columns(data))
    except NoTraceEvents:
        raise TraceError("a Kineto trace needs a 'traceEvents' list") from None
    except msgspec.ValidationError:
        return _lenient(data)
    except msgspec.DecodeError as exc:
        raise TraceError(f"not valid JSON ({exc}; cut off or not a trace?)") from None
    except RecursionError:
        raise TraceError(_too_deep()) from None


def columns_frame(cols: EventColumns) -> KinetoColumns:
    """The events frame of decoded columns (text columns as sorted categoricals)."""
    df = pd.DataFrame(
        {
            **{k: categorical_from_codes(*cols.text[k]) for k in TEXT_COLUMNS},
            **{k: cols.numbers[k] for k in NUMBER_COLUMNS},
        }
    )
    return KinetoColumns(df, cols.thread_names, cols.counters, cols.extra)


def _too_deep() -> str:
    return "the JSON is nested too deeply to be a trace (refused, nothing was analysed)"


def _strings(values: list[Any], lower: bool = False) -> pd.Categorical:
    """``str`` of each value as a categorical (the lenient path)."""
    return categorical_from_codes(*text_codes(values, lower))


def _num(values: list[Any]) -> np.ndarray:
    return pd.to_numeric(pd.Series(values, dtype=object), errors="coerce").to_numpy(np.float64)


def _lenient(data: bytes) -> KinetoColumns:
    """Any JSON shape: stdlib decode, then a per-event walk that coerces what it finds."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        where = f" at byte {exc.pos}" if isinstance(exc, json.JSONDecodeError) else ""
        raise TraceError(f"not valid JSON{where} (cut off or not a trace?)") from None
    except RecursionError:
        raise TraceError(_too_deep()) from None
    raw = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(raw, list):
        raise TraceError("a Kineto trace needs a 'traceEvents' list")
    events = [e for e in raw if isinstance(e, dict)]
    extra = {k: doc[k] for k in METADATA_KEYS if k in doc} if isinstance(doc, dict) else {}
    args = [a if isinstance(a := e.get("args"), dict) else {} for e in events]
    df = pd.DataFrame(
        {
            "ph": _strings([e.get("ph", "") for e in events]),
            "cat": _strings([e.get("cat", "") for e in events], lower=True),
            "name": _strings([e.get("name", "") for e in events]),
            "pid": _strings([e.get("pid", "") for e in events]),
            "tid": _strings([e.get("tid", "") for e in events]),
            "ts_us": _num([e.get("ts") for e in events]),
            "dur_us": _num([e.get("dur") for e in events]),
            "device": _num([a.get("device") for a in args]),
            "stream": _num([a.get("stream") for a in args]),
            "correlation": _num([a.get("correlation") for a in args]),
        }
    )
    thread_names = {
        (str(e.get("pid", "")), str(e.get("tid", ""))): str(a.get("name", ""))
        for e, a in zip(events, args, strict=True)
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    counters = [
        (str(e.get("name", "")), float(t), a)
        for e, a in zip(events, args, strict=True)
        if e.get("ph") == "C" and isinstance(t := e.get("ts"), (int, float))
    ]
    return KinetoColumns(df, thread_names, counters, extra)
