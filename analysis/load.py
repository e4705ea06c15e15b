"""Open any supported trace file: detect the format from its bytes, never from its name."""

from __future__ import annotations

import gzip
import os
import re
import zlib
from pathlib import Path

from analysis.frames import TraceError, TraceFrames, categorize
from analysis.profiles import Profile

__all__ = ["load_trace", "read_trace_bytes"]

_LEADING_SPACE = re.compile(rb"[ \t\n\r\x0b\x0c]*")  # what bytes.lstrip() strips


def read_trace_bytes(path: str | os.PathLike[str]) -> bytes:
    """The file's bytes, gunzipped when gzip-compressed (a cut-off gzip yields what it holds)."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise TraceError(f"no such trace file: {p}") from None
    except OSError as exc:
        raise TraceError(f"cannot read {p}: {exc.strerror}") from None
    if data[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(data)
        except (OSError, EOFError, zlib.error):
            return zlib.decompressobj(wbits=47).decompress(data)  # keep the readable prefix
    return data


def load_trace(path: str | os.PathLike[str], profile: Profile | str | None = None) -> TraceFrames:
    """Frames of a stepscope/Perfetto protobuf trace or a Kineto (torch.profiler) JSON trace.

    Raises :class:`TraceError` with a plain message for anything it cannot read.
    """
    data = read_trace_bytes(path)
    match = _LEADING_SPACE.match(data)
    first = match.end() if match else 0
    head = data[first : first + 1]  # no copy of the (possibly large) file
    if head in (b"{", b"["):
        from analysis.load_kineto import load_kineto

        frames = load_kineto(data, profile or "vllm")
    elif data[:1] == b"\x0a":
        from analysis.load_perfetto import load_perfetto

        frames = load_perfetto(data, profile or "stepscope")
    elif not data.strip():
        raise TraceError(f"{path}: the file is empty")
    else:
        raise TraceError(
            f"{path}: not a trace stepscope can read (expected Perfetto protobuf or Kineto JSON; "
            f"first bytes {data[:8]!r})"
        )
    categorize(frames.slices)
    categorize(frames.instants)
    frames.metadata["path"] = os.fspath(path)
    return frames
