"""Decode a Kineto trace in a forked child while this process imports the analysis.

``stepscope analyze`` spends about as long importing pandas and the metrics as it spends reading,
gunzipping and decoding a large Kineto trace; the two do not depend on each other. Before the
heavy imports, :meth:`TracePrefetch.start` forks a child (``analysis.forked``) that needs only
numpy and msgspec (``analysis.loading.kineto_columns``): it reads the file, decodes its event
columns and sends them back through a pipe (pickled arrays, a few bytes per event), while the
parent imports.

Correctness does not depend on the child: when fork is unavailable, when other threads run, when
the file is not Kineto JSON, or when anything goes wrong in the child (a malformed trace, the
decompression limit, ...), :meth:`TracePrefetch.load` loads the file in this process with
:func:`~analysis.loading.load.load_trace`, so the frames and every
:class:`~analysis.errors.TraceError` message are exactly those of the plain path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from analysis import forked

# numpy and msgspec (the decoder) are imported before the fork: both processes need them, and a
# module imported once, in the parent, costs the child nothing.
from analysis.loading.kineto_columns import EventColumns, decode_columns
from analysis.loading.load import finish_frames, is_kineto_json, load_trace, read_trace_bytes

if TYPE_CHECKING:
    from analysis.frames import TraceFrames
    from analysis.loading.profiles import Profile

__all__ = ["TracePrefetch"]


class TracePrefetch:
    """One trace file being decoded by a child process (or, without one, loaded on demand)."""

    def __init__(self, path: str, max_decompressed_mb: float, fork: bool = True) -> None:
        self.path = path
        self.max_decompressed_mb = max_decompressed_mb
        self._job = forked.start(_columns_or_none, path, max_decompressed_mb, fork=fork)

    @property
    def forked(self) -> bool:
        """Whether a child was started."""
        return self._job.forked

    def load(self, profile: Profile | str | None = None) -> TraceFrames:
        """The trace's frames, as :func:`~analysis.loading.load.load_trace` returns them."""
        # pandas and the Kineto loader are imported before waiting: while the child decodes.
        from analysis.loading.kineto_decode import columns_frame
        from analysis.loading.load_kineto import frames_of_columns
        from analysis.loading.profiles import get_profile

        cols = self._job.result()
        if cols is None:
            return load_trace(self.path, profile, self.max_decompressed_mb)

        prof = get_profile(profile or "vllm")
        return finish_frames(
            frames_of_columns(columns_frame(cols), cols.num_bytes, prof), self.path
        )


def _columns_or_none(path: str, max_decompressed_mb: float) -> EventColumns | None:
    """The typed columns of a Kineto JSON file; None for anything else or any error (the caller
    then loads the file the plain way, which says what is wrong)."""
    try:
        data = read_trace_bytes(path, max_decompressed_mb)
        if not is_kineto_json(data):
            return None
        return decode_columns(data, forked.keep_until_exit)
    except Exception:  # noqa: BLE001 -- load_trace reports it with its own message
        return None
