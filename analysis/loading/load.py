"""Open any supported trace file: detect the format from its bytes, never from its name.

Inputs are bounded: a gzip-compressed trace is decompressed only up to ``max_decompressed_mb``
(default :data:`DEFAULT_MAX_DECOMPRESSED_MB`), so a small "gzip bomb" cannot exhaust memory;
the Kineto decoder refuses JSON nested deeper than it can hold (see ``analysis.loading.kineto_decode``).
Both end in a :class:`TraceError` that names the limit.
"""

from __future__ import annotations

import os
import re
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from analysis.errors import TraceError

if TYPE_CHECKING:  # pandas and the loaders are imported when a trace is loaded, not before
    from analysis.frames import TraceFrames
    from analysis.loading.profiles import Profile

_inflate: Any = zlib  # ISA-L inflates about twice as fast as zlib, with zlib's interface
_INFLATE_ERRORS: tuple[Any, ...] = (zlib.error,)
try:
    from isal import isal_zlib

    _inflate, _INFLATE_ERRORS = isal_zlib, (zlib.error, isal_zlib.error)
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same bytes
    pass

__all__ = [
    "load_trace",
    "read_trace_bytes",
    "gunzip_bounded",
    "is_kineto_json",
    "finish_frames",
    "DEFAULT_MAX_DECOMPRESSED_MB",
]

DEFAULT_MAX_DECOMPRESSED_MB = 2048.0
_LEADING_SPACE = re.compile(rb"[ \t\n\r\x0b\x0c]*")  # what bytes.lstrip() strips
_GZIP_MAGIC = b"\x1f\x8b"


def gunzip_bounded(data: bytes, max_bytes: int, what: str = "the trace") -> bytes:
    """``data`` (one or more gzip members) decompressed, at most ``max_bytes`` of output.

    A cut-off or corrupt member yields what it holds (the readable prefix). Raises
    :class:`TraceError` naming the limit when the output would exceed ``max_bytes``.
    """
    out: list[bytes] = []
    size = 0
    while data[:2] == _GZIP_MAGIC:
        dec = _inflate.decompressobj(wbits=47)
        try:
            chunk = dec.decompress(data, max_bytes - size + 1)
            if not dec.eof and not dec.unconsumed_tail:  # cut off: zlib's readable prefix,
                dec = zlib.decompressobj(wbits=47)  # which may hold a byte more than ISA-L's
                chunk = dec.decompress(data, max_bytes - size + 1)
        except _INFLATE_ERRORS:
            break  # corrupt: what earlier members held is kept
        size += len(chunk)
        out.append(chunk)
        if size > max_bytes or dec.unconsumed_tail:
            raise TraceError(
                f"{what} decompresses to more than {max_bytes / 2**20:.0f} MB "
                "(the --max-decompressed-mb limit); raise the limit if the trace is genuine"
            )
        if not dec.eof:
            break  # cut off: keep the readable prefix
        data = dec.unused_data
    return b"".join(out)


def read_trace_bytes(
    path: str | os.PathLike[str], max_decompressed_mb: float = DEFAULT_MAX_DECOMPRESSED_MB
) -> bytes:
    """The file's bytes, gunzipped when gzip-compressed (a cut-off gzip yields what it holds).

    Raises :class:`TraceError` when the decompressed size would exceed ``max_decompressed_mb``.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise TraceError(f"no such trace file: {p}") from None
    except OSError as exc:
        raise TraceError(f"cannot read {p}: {exc.strerror}") from None
    if data[:2] == _GZIP_MAGIC:
        if not max_decompressed_mb > 0:
            raise TraceError(f"max_decompressed_mb must be > 0, got {max_decompressed_mb}")
        return gunzip_bounded(data, int(max_decompressed_mb * 2**20), str(p))
    return data


def load_trace(
    path: str | os.PathLike[str],
    profile: Profile | str | None = None,
    max_decompressed_mb: float = DEFAULT_MAX_DECOMPRESSED_MB,
) -> TraceFrames:
    """Frames of a stepscope/Perfetto protobuf trace or a Kineto (torch.profiler) JSON trace.

    Raises :class:`TraceError` with a plain message for anything it cannot read, including a
    gzip file that decompresses to more than ``max_decompressed_mb``.
    """
    data = read_trace_bytes(path, max_decompressed_mb)
    if is_kineto_json(data):
        from analysis.loading.load_kineto import load_kineto

        frames = load_kineto(data, profile or "vllm")
    elif data[:1] == b"\x0a":
        from analysis.loading.load_perfetto import load_perfetto

        frames = load_perfetto(data, profile or "stepscope")
    elif not data.strip():
        raise TraceError(f"{path}: the file is empty")
    else:
        raise TraceError(
            f"{path}: not a trace stepscope can read (expected Perfetto protobuf or Kineto JSON; "
            f"first bytes {data[:8]!r})"
        )
    return finish_frames(frames, path)


def is_kineto_json(data: bytes) -> bool:
    """True when ``data`` starts (after JSON whitespace) like a Kineto JSON trace."""
    match = _LEADING_SPACE.match(data)
    first = match.end() if match else 0
    return data[first : first + 1] in (b"{", b"[")


def finish_frames(frames: TraceFrames, path: str | os.PathLike[str]) -> TraceFrames:
    """What every loader's frames get last: category columns and ``metadata["path"]``."""
    from analysis.frames import categorize

    categorize(frames.slices)
    categorize(frames.instants)
    frames.metadata["path"] = os.fspath(path)
    return frames
