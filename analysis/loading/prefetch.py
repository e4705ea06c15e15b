"""Decode a Kineto trace in a forked child while this process imports the analysis.

``stepscope analyze`` spends about as long importing pandas and the metrics as it spends reading,
gunzipping and decoding a large Kineto trace; the two do not depend on each other. Before the
heavy imports, :meth:`TracePrefetch.start` forks a child that needs only numpy and msgspec
(``analysis.loading.kineto_columns``): it reads the file, decodes its event columns and sends
them back through a pipe (pickled arrays, a few bytes per event), while the parent imports.

Correctness does not depend on the child: when fork is unavailable, when other threads run (a
fork would copy their locks), when the file is not Kineto JSON, or when anything goes wrong in
the child (a malformed trace, the decompression limit, ...), :meth:`TracePrefetch.load` loads the
file in this process with :func:`~analysis.loading.load.load_trace`, so the frames and every
:class:`~analysis.errors.TraceError` message are exactly those of the plain path.
"""

from __future__ import annotations

import os
import pickle
import threading
from typing import TYPE_CHECKING

from analysis.loading.load import finish_frames, is_kineto_json, load_trace, read_trace_bytes

if TYPE_CHECKING:
    from analysis.frames import TraceFrames
    from analysis.loading.kineto_columns import EventColumns
    from analysis.loading.profiles import Profile

__all__ = ["TracePrefetch"]


class TracePrefetch:
    """One trace file being decoded by a child process (or, without one, loaded on demand)."""

    def __init__(
        self, path: str, max_decompressed_mb: float, pid: int | None, fd: int | None
    ) -> None:
        self.path = path
        self.max_decompressed_mb = max_decompressed_mb
        self._pid = pid
        self._fd = fd

    @classmethod
    def start(cls, path: str, max_decompressed_mb: float) -> TracePrefetch:
        """Fork the decoding child (see the module docstring for when none is started)."""
        if not hasattr(os, "fork") or threading.active_count() > 1:
            return cls(path, max_decompressed_mb, None, None)
        r, w = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            os.close(r)
            os.close(w)
            return cls(path, max_decompressed_mb, None, None)
        if pid == 0:  # the child: never returns
            os.close(r)
            _decode_and_send(path, max_decompressed_mb, w)
        os.close(w)
        return cls(path, max_decompressed_mb, pid, r)

    @property
    def forked(self) -> bool:
        """Whether a child was started."""
        return self._pid is not None

    def columns(self) -> EventColumns | None:
        """The child's columns (waits for it); None when it decoded nothing. Call once."""
        if self._pid is None or self._fd is None:
            return None
        try:
            with os.fdopen(self._fd, "rb") as f:
                cols = pickle.load(f)
        except (EOFError, OSError, pickle.UnpicklingError):
            cols = None  # the child died (killed, out of memory): load here instead
        finally:
            self._fd = None
            os.waitpid(self._pid, 0)
            self._pid = None
        return cols

    def load(self, profile: Profile | str | None = None) -> TraceFrames:
        """The trace's frames, as :func:`~analysis.loading.load.load_trace` returns them."""
        cols = self.columns()
        if cols is None:
            return load_trace(self.path, profile, self.max_decompressed_mb)
        from analysis.loading.kineto_decode import columns_frame
        from analysis.loading.load_kineto import frames_of_columns
        from analysis.loading.profiles import get_profile

        prof = get_profile(profile or "vllm")
        return finish_frames(
            frames_of_columns(columns_frame(cols), cols.num_bytes, prof), self.path
        )


def _decode_and_send(path: str, max_decompressed_mb: float, fd: int) -> None:
    """The child's whole life: decode ``path``, pickle the columns (or None) into ``fd``, exit
    without running the parent's exit handlers or flushing its copied output buffers."""
    status = 0
    try:
        payload = None
        try:
            data = read_trace_bytes(path, max_decompressed_mb)
            if is_kineto_json(data):
                from analysis.loading.kineto_columns import decode_columns

                payload = decode_columns(data)
            del data
        except Exception:  # noqa: BLE001 -- the parent loads the file again and says why
            payload = None
        with os.fdopen(fd, "wb") as f:
            pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:  # noqa: BLE001 -- a closed pipe, an interrupt: the parent copes
        status = 1
    finally:
        os._exit(status)
