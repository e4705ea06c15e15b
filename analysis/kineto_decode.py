"""Decode Kineto (torch.profiler Chrome-JSON) bytes into columns, fast and bounded.

The fast path decodes with msgspec into typed structs that hold only the fields the loader
reads (``ph``, ``cat``, ``name``, ``pid``, ``tid``, ``ts``, ``dur`` and four ``args`` keys);
every other key of every event is skipped inside the C decoder, and the columns are pulled out
with C-level ``attrgetter`` maps, so no Python code runs per event. A trace that does not fit
the typed shape (a string timestamp, an event that is not an object, ...) is decoded again by
the lenient path (any JSON value, coerced per column), so odd traces still load, only slower.

JSON nested deeper than the decoders can follow is refused with a :class:`TraceError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import msgspec
import numpy as np
import pandas as pd

from analysis.frames import TraceError, categorical_from_codes

__all__ = ["KinetoColumns", "decode_kineto", "METADATA_KEYS"]

METADATA_KEYS = ("schemaVersion", "distributedInfo", "deviceProperties", "baseTimeNanoseconds")
_NAN = float("nan")


class _Args(msgspec.Struct, frozen=True, gc=False):
    device: float = _NAN
    stream: float = _NAN
    correlation: float = _NAN
    name: str = ""  # a thread_name / process_name metadata event's name


_NO_ARGS = _Args()


class _Event(msgspec.Struct, gc=False):
    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: int | str = ""
    tid: int | str = ""
    ts: float = _NAN
    dur: float = _NAN
    args: _Args = _NO_ARGS


class _Doc(msgspec.Struct, gc=False):
    traceEvents: list[_Event] | None = None
    schemaVersion: Any = None
    distributedInfo: Any = None
    deviceProperties: Any = None
    baseTimeNanoseconds: Any = None


_DOC = msgspec.json.Decoder(_Doc)
_LIST = msgspec.json.Decoder(list[_Event])


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
        return _typed(data)
    except msgspec.ValidationError:
        return _lenient(data)
    except msgspec.DecodeError as exc:
        raise TraceError(f"not valid JSON ({exc}; cut off or not a trace?)") from None
    except RecursionError:
        raise TraceError(_too_deep()) from None


def _too_deep() -> str:
    return "the JSON is nested too deeply to be a trace (refused, nothing was analysed)"


def _strings(values: list[Any], lower: bool = False) -> pd.Categorical:
    """``str`` of each value as a categorical, converting each distinct value once.

    A dict keyed by the values factorizes them in C (``map``), faster here than
    ``pd.factorize``, which first scans an object array for missing values.
    """
    index = {v: i for i, v in enumerate(dict.fromkeys(values))}
    codes = np.fromiter(map(index.__getitem__, values), dtype=np.int64, count=len(values))
    text = [str(v) for v in index]
    if lower:
        text = [t.lower() for t in text]
    return categorical_from_codes(codes, text)


def _ids(values: list[Any]) -> pd.Categorical:
    """Process/thread ids as text categories; integer ids (the usual case) factorized in numpy."""
    try:
        ints = np.fromiter(values, dtype=np.int64, count=len(values))
    except (TypeError, ValueError, OverflowError):  # a named pid/tid ("Spans", "stream 7", ...)
        return _strings(values)
    uniq, inverse = np.unique(ints, return_inverse=True)
    return categorical_from_codes(inverse.astype(np.int64), [str(u) for u in uniq.tolist()])


def _typed(data: bytes) -> KinetoColumns:
    first = data.lstrip()[:1]
    if first == b"[":
        events, extra = _LIST.decode(data), {}
    else:
        doc = _DOC.decode(data)
        if doc.traceEvents is None:
            raise TraceError("a Kineto trace needs a 'traceEvents' list")
        events = doc.traceEvents
        extra = {k: getattr(doc, k) for k in METADATA_KEYS if getattr(doc, k) is not None}
    n = len(events)
    args = list(map(attrgetter("args"), events))

    def floats(values: Any) -> np.ndarray:
        return np.fromiter(values, dtype=np.float64, count=n)

    df = pd.DataFrame(
        {
            "ph": _strings(list(map(attrgetter("ph"), events))),
            "cat": _strings(list(map(attrgetter("cat"), events)), lower=True),
            "name": _strings(list(map(attrgetter("name"), events))),
            "pid": _ids(list(map(attrgetter("pid"), events))),
            "tid": _ids(list(map(attrgetter("tid"), events))),
            "ts_us": floats(map(attrgetter("ts"), events)),
            "dur_us": floats(map(attrgetter("dur"), events)),
            "device": floats(map(attrgetter("device"), args)),
            "stream": floats(map(attrgetter("stream"), args)),
            "correlation": floats(map(attrgetter("correlation"), args)),
        }
    )
    meta = np.nonzero((df["ph"] == "M").to_numpy() & (df["name"] == "thread_name").to_numpy())[0]
    thread_names = {
        (df["pid"].iat[i], df["tid"].iat[i]): args[i].name for i in meta.tolist()
    }  # one per thread, not per event
    counters = _counters_of(data) if (df["ph"] == "C").any() else []
    return KinetoColumns(df, thread_names, counters, extra)


def _counters_of(data: bytes) -> list[tuple[str, float, dict[str, Any]]]:
    """``C`` events with their full args (rare in Kineto traces: decoded a second time)."""
    doc = msgspec.json.decode(data)
    events = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
    return [
        (str(e.get("name", "")), float(e["ts"]), e["args"])
        for e in events
        if isinstance(e, dict)
        and e.get("ph") == "C"
        and isinstance(e.get("ts"), (int, float))
        and isinstance(e.get("args"), dict)
    ]


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
