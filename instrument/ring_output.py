"""Where encoded packets go: one streamed file, or a ring of two segment files.

A ring keeps the most recent ``ring_bytes`` of the trace in two segment files ``<path>.seg0`` and
``<path>.seg1`` of up to half the ring each. Every segment starts with a *preamble*: the track
descriptors and process-scoped instants known when it was opened (part 1), then a packet that
clears the sequence's incremental state (part 2), so each segment is a loadable trace on its own:
a crashed run leaves two loadable files. When the open segment is full the writer rotates: the
older segment is truncated and reopened. At close the trace is assembled into ``<path>`` as the
older segment followed by the newer one without its part 1 (whose packets the older segment
already holds), and the segment files are removed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import IO

__all__ = ["FileOutput", "RingOutput", "Segment"]


class FileOutput:
    """A single streamed file (no ring)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: IO[bytes] | None = open(path, "wb")
        self.size = 0

    def write(self, data: bytes) -> None:
        if self._file is None:
            return
        self._file.write(data)
        self.size += len(data)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            self._file.close()
            self._file = None


@dataclass
class Segment:
    """One segment file: its size, where its preamble's part 1 ends, the steps it holds."""

    path: str
    file: IO[bytes] | None = None
    size: int = 0
    part1_len: int = 0
    num_events: int = 0
    steps: set[int] = field(default_factory=set)


class RingOutput:
    """Two segment files of ``ring_bytes // 2`` each; see the module docstring."""

    def __init__(self, path: str, ring_bytes: int) -> None:
        self.path = path
        self.segment_bytes = ring_bytes // 2
        self._segments = [Segment(f"{path}.seg0"), Segment(f"{path}.seg1")]
        self._current = 0
        self.num_rotations = 0
        self.evicted_events = 0
        self._closed = False

    @property
    def current(self) -> Segment:
        return self._segments[self._current]

    @property
    def size(self) -> int:
        return sum(s.size for s in self._segments)

    def open_segment(self, part1: bytes, part2: bytes) -> None:
        """Truncate and start the current segment with a preamble."""
        seg = self.current
        if seg.file is not None:
            seg.file.close()
        seg.file = open(seg.path, "wb")
        seg.size = 0
        seg.num_events = 0
        seg.steps = set()
        seg.part1_len = len(part1)
        self.write(part1 + part2)

    def fits(self, num_bytes: int) -> bool:
        """Whether ``num_bytes`` more fit in the open segment (an empty body always fits)."""
        seg = self.current
        body = seg.size - seg.part1_len
        return seg.size + num_bytes <= self.segment_bytes or body <= 64

    def rotate(self, part1: bytes, part2: bytes) -> None:
        """Switch to the other segment, evicting what it held."""
        self.flush()
        self._current ^= 1
        self.evicted_events += self.current.num_events
        self.num_rotations += 1
        self.open_segment(part1, part2)

    def write(self, data: bytes) -> None:
        seg = self.current
        if seg.file is None or self._closed:
            return
        seg.file.write(data)
        seg.size += len(data)

    def record(self, num_events: int, steps: set[int]) -> None:
        """Account events (and their steps) written to the open segment."""
        self.current.num_events += num_events
        self.current.steps |= steps

    def kept_steps(self) -> set[int]:
        return self._segments[0].steps | self._segments[1].steps

    def flush(self) -> None:
        for seg in self._segments:
            if seg.file is not None:
                seg.file.flush()

    def close(self) -> None:
        """Assemble ``path`` from the segments (older first) and remove them."""
        if self._closed:
            return
        self._closed = True
        for seg in self._segments:
            if seg.file is not None:
                seg.file.close()
                seg.file = None
        newer = self.current
        older = self._segments[self._current ^ 1]
        with open(self.path, "wb") as out:
            if self.num_rotations:
                with open(older.path, "rb") as f:
                    out.write(f.read())
                with open(newer.path, "rb") as f:
                    f.seek(newer.part1_len)
                    out.write(f.read())
            else:
                with open(newer.path, "rb") as f:
                    out.write(f.read())
        for seg in self._segments:
            if os.path.exists(seg.path):
                os.remove(seg.path)
