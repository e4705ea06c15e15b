"""Decode Kineto (torch.profiler Chrome-JSON) bytes into numpy columns: msgspec and numpy only.

msgspec decodes into typed structs that hold only the fields the loader reads (``ph``, ``cat``,
``name``, ``pid``, ``tid``, ``ts``, ``dur`` and four ``args`` keys); every other key of every
event is skipped inside the C decoder, and the columns are pulled out with C-level
``attrgetter`` maps, so no Python code runs per event. Nothing here imports pandas, so a forked
child can decode a trace while its parent imports the analysis (``analysis.loading.prefetch``);
``analysis.loading.kineto_decode`` turns the columns into the events frame.

:func:`decode_columns` raises ``msgspec.ValidationError`` for a trace that does not fit the typed
shape (a string timestamp, an event that is not an object, ...; the caller decodes it leniently),
``msgspec.DecodeError`` for invalid JSON and ``RecursionError`` for JSON nested too deeply.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import msgspec
import numpy as np

__all__ = [
    "EventColumns",
    "decode_columns",
    "text_codes",
    "NoTraceEvents",
    "METADATA_KEYS",
    "TEXT_COLUMNS",
    "NUMBER_COLUMNS",
]

METADATA_KEYS = ("schemaVersion", "distributedInfo", "deviceProperties", "baseTimeNanoseconds")
TEXT_COLUMNS = ("ph", "cat", "name", "pid", "tid")
NUMBER_COLUMNS = ("ts_us", "dur_us", "device", "stream", "correlation")
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


class NoTraceEvents(Exception):
    """A JSON object without a ``traceEvents`` list."""


@dataclass
class EventColumns:
    """One row per event, as plain arrays.

    ``text``: for each of :data:`TEXT_COLUMNS`, ``(codes, labels)``: int64 codes into the
    ``str`` labels (``cat`` lower-cased; labels may repeat); ``numbers``: for each of
    :data:`NUMBER_COLUMNS`, float64 (NaN when absent); ``thread_names``: (pid, tid) -> name;
    ``counters``: (name, ts_us, {key: value}) of ``C`` events; ``extra``: the document's
    :data:`METADATA_KEYS` that are present; ``num_bytes``: the decoded JSON's size.
    """

    num_events: int
    text: dict[str, tuple[np.ndarray, list[str]]]
    numbers: dict[str, np.ndarray]
    thread_names: dict[tuple[str, str], str]
    counters: list[tuple[str, float, dict[str, Any]]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    num_bytes: int = 0


def text_codes(values: list[Any], lower: bool = False) -> tuple[np.ndarray, list[str]]:
    """``str`` of each value as codes and labels, converting each distinct value once.

    A dict keyed by the values factorizes them in C (``map``), faster here than
    ``pd.factorize``, which first scans an object array for missing values.
    """
    index = {v: i for i, v in enumerate(dict.fromkeys(values))}
    codes = np.fromiter(map(index.__getitem__, values), dtype=np.int64, count=len(values))
    text = [str(v) for v in index]
    if lower:
        text = [t.lower() for t in text]
    return codes, text


def _ids(values: list[Any]) -> tuple[np.ndarray, list[str]]:
    """Process/thread ids as text; integer ids (the usual case) factorized in numpy."""
    try:
        ints = np.fromiter(values, dtype=np.int64, count=len(values))
    except (TypeError, ValueError, OverflowError):  # a named pid/tid ("Spans", "stream 7", ...)
        return text_codes(values)
    uniq, inverse = np.unique(ints, return_inverse=True)
    return inverse.astype(np.int64), [str(u) for u in uniq.tolist()]


def _label_code(text: tuple[np.ndarray, list[str]], value: str) -> np.ndarray:
    """True for the rows whose label is ``value``."""
    codes, labels = text
    hits = [i for i, label in enumerate(labels) if label == value]
    return np.isin(codes, hits) if hits else np.zeros(codes.shape, bool)


def decode_columns(data: bytes, keep: Callable[[Any], None] | None = None) -> EventColumns:
    """Columns of a Kineto JSON trace held in ``data`` (already decompressed); see the module
    docstring for what it raises. A JSON object without ``traceEvents`` raises
    :class:`NoTraceEvents`. ``keep``: given the decoded events before they are dropped (a forked
    child keeps them until it exits instead of freeing them, ``analysis.forked.keep_until_exit``)."""
    first = data.lstrip()[:1]
    if first == b"[":
        events, extra = _LIST.decode(data), {}
    else:
        doc = _DOC.decode(data)
        if doc.traceEvents is None:
            raise NoTraceEvents
        events = doc.traceEvents
        extra = {k: getattr(doc, k) for k in METADATA_KEYS if getattr(doc, k) is not None}
    n = len(events)
    args = list(map(attrgetter("args"), events))

    def floats(values: Any) -> np.ndarray:
        return np.fromiter(values, dtype=np.float64, count=n)

    text = {
        "ph": text_codes(list(map(attrgetter("ph"), events))),
        "cat": text_codes(list(map(attrgetter("cat"), events)), lower=True),
        "name": text_codes(list(map(attrgetter("name"), events))),
        "pid": _ids(list(map(attrgetter("pid"), events))),
        "tid": _ids(list(map(attrgetter("tid"), events))),
    }
    numbers = {
        "ts_us": floats(map(attrgetter("ts"), events)),
        "dur_us": floats(map(attrgetter("dur"), events)),
        "device": floats(map(attrgetter("device"), args)),
        "stream": floats(map(attrgetter("stream"), args)),
        "correlation": floats(map(attrgetter("correlation"), args)),
    }
    meta = _label_code(text["ph"], "M") & _label_code(text["name"], "thread_name")
    (pid_codes, pid_labels), (tid_codes, tid_labels) = text["pid"], text["tid"]
    thread_names = {
        (pid_labels[pid_codes[i]], tid_labels[tid_codes[i]]): args[i].name
        for i in np.flatnonzero(meta).tolist()
    }  # one per thread, not per event
    counters = counters_of(data) if "C" in text["ph"][1] else []
    if keep is not None:
        keep(events)
    return EventColumns(n, text, numbers, thread_names, counters, extra, len(data))


def counters_of(data: bytes) -> list[tuple[str, float, dict[str, Any]]]:
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
