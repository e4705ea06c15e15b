"""Device times written by the forward's CUDA graphs themselves: no event record on the host.

A traced decode step brackets its ``forward`` with the end event of ``input_prep`` and an end
event of its own: two driver calls on the engine thread, ~7 µs each on the H200 (bench/README.md,
issue 15), on top of the events the runner records anyway. With graph stamps every captured
forward graph begins and ends with a one-thread kernel that reads the device's ``%globaltimer``
(ns) and writes it into a ring in pinned host memory, mapped into the device's address space:

* the begin kernel writes ``ring[i % RING].begin``; the end kernel writes ``.end``, then (after a
  system-scope fence) ``.index = i``, and advances the device-side counter ``i``;
* the host counts the stamped replays it enqueues (:meth:`GraphStamps.take`, in stream order, so
  it knows ``i`` without reading the device) and reads a stamp once its ``index`` column says the
  end kernel of replay ``i`` has run (a plain memory read, no driver call);
* device times map to the host clock through an offset calibrated at start-up against the
  timeline's own clock (:meth:`GraphStamps.calibrate`: a stamp between two events, queued behind a
  sleep so the three run back to back).

The replay's kernels run inside the graph, so the host pays nothing per step for them; the device
pays two tiny kernels per forward (a few µs). A replay the host did not count (a desync) shows as
an ``index`` column that never matches: the timeline drops that slice and counts it
(``graph_stamp_mismatch``), nothing is emitted from a wrong time. docs/design.md §4.3 "Graph
stamps".

On the CPU device (tests) the "graph" is its body run eagerly on the compute stream's worker
thread: :class:`HostStamps` writes the host clock there, in the same ring layout, so the
timeline's path is the same.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from instrument.tracer import now_ns

__all__ = ["RING", "StampEvent", "GraphStamps", "HostStamps", "StampsBase"]

RING = 4096  # stamped replays in flight at most (the timeline's pending bound is far below)
_INDEX, _BEGIN, _END = 0, 1, 2


class StampEvent:
    """One end of one stamped replay, in the device timeline's pending stages where an event
    would be (never recorded, queried or returned to an event pool)."""

    __slots__ = ("stamps", "index", "column")

    def __init__(self, stamps: StampsBase, index: int, column: int) -> None:
        self.stamps = stamps
        self.index = index
        self.column = column

    def done(self) -> bool:
        """The replay's end kernel has run (the ``index`` column holds this replay's index)."""
        return int(self.stamps.ring[self.index % RING, _INDEX]) == self.index

    def host_ns(self) -> int:
        """The stamp on the host clock. Called once a later event on the stream completed (the
        replay has run): a ring row of another replay means the host's count of stamped replays
        and the device's differ, and no time is made up for it."""
        stamps = self.stamps
        row = stamps.ring[self.index % RING]
        if int(row[_INDEX]) != self.index:
            raise RuntimeError(
                f"graph stamp of replay {self.index} not written (ring row holds replay "
                f"{int(row[_INDEX])}): the host's and the device's counts of stamped replays differ"
            )
        return int(row[self.column]) + stamps.offset_ns


class StampsBase:
    """The host side: the ring (``[RING, 3]`` int64: index, begin, end), the count of stamped
    replays enqueued, and the device-to-host clock offset."""

    on_device = False  # True: the device writes the stamps (``%globaltimer``)

    def __init__(self, ring: np.ndarray, offset_ns: int = 0) -> None:
        if ring.shape != (RING, 3) or ring.dtype != np.int64:
            raise ValueError(f"the stamp ring must be [{RING}, 3] int64, got {ring.shape}")
        ring[:, _INDEX] = -1
        self.ring = ring
        self.offset_ns = offset_ns
        self.offset_error_ns = 0  # half the calibration bracket
        self.next_index = 0  # the index of the next stamped replay enqueued
        self.num_mismatched = 0

    def take(self) -> tuple[StampEvent, StampEvent]:
        """The begin and end of the stamped replay about to be enqueued (engine thread, before
        it is: every replay of a stamped graph must take exactly one)."""
        i = self.next_index
        self.next_index = i + 1
        return StampEvent(self, i, _BEGIN), StampEvent(self, i, _END)

    def wrap(self, body: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``body`` with a begin stamp before it and an end stamp after it."""

        @functools.wraps(body)
        def stamped(shape: Any) -> Any:
            self.begin()
            out = body(shape)
            self.end()
            return out

        return stamped

    def begin(self) -> None:
        raise NotImplementedError

    def end(self) -> None:
        raise NotImplementedError

    def reset_device_counter(self) -> None:
        """After capture: the device's count and the host's restart at 0 (capture and its warm-up
        may have run the stamps)."""
        self.next_index = 0
        self.ring[:, _INDEX] = -1


class HostStamps(StampsBase):
    """The CPU device's stamps: the body runs on the compute stream's worker thread, which
    writes the host clock (offset 0) and keeps the "device" count."""

    def __init__(self) -> None:
        super().__init__(np.zeros((RING, 3), dtype=np.int64))
        self._device_index = 0

    def begin(self) -> None:
        self.ring[self._device_index % RING, _BEGIN] = now_ns()

    def end(self) -> None:
        i = self._device_index
        row = self.ring[i % RING]
        row[_END] = now_ns()
        row[_INDEX] = i
        self._device_index = i + 1

    def reset_device_counter(self) -> None:
        super().reset_device_counter()
        self._device_index = 0


class GraphStamps(StampsBase):
    """CUDA: the ring in pinned host memory the device writes through its mapping; the count in
    device memory; the stamps are Triton kernels (captured into each graph)."""

    on_device = True

    def __init__(self, torch_device: Any) -> None:
        import torch

        self._ring_t = torch.empty((RING, 3), dtype=torch.int64, pin_memory=True)
        super().__init__(self._ring_t.numpy())
        self._counter = torch.zeros(1, dtype=torch.int64, device=torch_device)
        self.torch_device = torch_device

    def begin(self) -> None:
        _launch(self._ring_t, self._counter, end=False)

    def end(self) -> None:
        _launch(self._ring_t, self._counter, end=True)

    def reset_device_counter(self) -> None:
        import torch

        torch.cuda.synchronize(self.torch_device)
        self._counter.zero_()
        torch.cuda.synchronize(self.torch_device)
        super().reset_device_counter()

    def calibrate(self, ops: Any, stream: Any, tries: int = 5) -> None:
        """The offset from ``%globaltimer`` to the timeline's host clock: on an idle ``stream``
        queue a sleep, then event A, a stamp, event B; the three then run back to back, and the
        stamp lies between A and B (``ops.host_ns_many``). Best of ``tries`` (tightest bracket);
        ``offset_error_ns`` is half of it. Start-up only (synchronises)."""
        import torch

        ring = torch.empty((1, 3), dtype=torch.int64, pin_memory=True)
        counter = torch.zeros(1, dtype=torch.int64, device=self.torch_device)
        best: tuple[int, int] | None = None
        for _ in range(tries):
            a, b = ops.new(), ops.new()
            with torch.cuda.stream(stream):
                torch.cuda._sleep(2_000_000)  # ~1 ms: the three below queue up behind it
                ops.record(a, stream)
                _launch(ring, counter, end=False)
                ops.record(b, stream)
            stream.synchronize()
            host_a, host_b = ops.host_ns_many([a, b])
            g = int(ring[0, _BEGIN])
            width = host_b - host_a
            if best is None or width < best[1]:
                best = ((host_a + host_b) // 2 - g, width)
        assert best is not None
        self.offset_ns, self.offset_error_ns = best[0], best[1] // 2


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def graph_stamp(ring_ptr, counter_ptr, RING_SLOTS: tl.constexpr, END: tl.constexpr):
        i = tl.load(counter_ptr)
        t = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
        row = ring_ptr + (i % RING_SLOTS) * 3
        if END:
            tl.store(row + 2, t)
            # the times reach host memory before the index that says they are there
            tl.inline_asm_elementwise(
                "fence.sc.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
            )
            tl.store(row, i)
            tl.store(counter_ptr, i + 1)
        else:
            tl.store(row + 1, t)
            tl.inline_asm_elementwise(
                "fence.sc.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
            )

    return graph_stamp


def _launch(ring: Any, counter: Any, *, end: bool) -> None:
    _kernel()[(1,)](ring, counter, RING_SLOTS=ring.shape[0], END=end, num_warps=1)
