"""Device slices from timed events recorded on a stream around each device stage.

The CPU records an event before and after enqueueing a stage; later, non-blocking ``query()`` calls
find the pairs that have completed and turn them into slices on ``gpu:<i> compute`` / ``copy``
tracks. Nothing here synchronises on the hot path: :meth:`DeviceTimeline.poll` only queries.

Events follow the :class:`TimedEvent` protocol. :class:`CudaTimedEvent` wraps a timing
``torch.cuda.Event`` and maps its device time onto the host clock through a calibration taken once
at start-up; the engine's CPU device provides events stamped by its worker thread.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from instrument.schema import DEVICE_COMPUTE, DEVICE_LANES, Arg, device_track_name
from instrument.tracer import Tracer, now_ns

__all__ = ["TimedEvent", "DeviceTimeline", "CudaClock", "CudaTimedEvent", "PendingStage"]


class TimedEvent(Protocol):
    """An event that can be recorded on a stream and read back as a host timestamp."""

    def record(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...

    def host_ns(self) -> int: ...


@dataclass(slots=True)
class PendingStage:
    """A stage whose end event has not completed yet."""

    name: str
    lane: str
    step: int
    begin: TimedEvent
    end: TimedEvent
    args: dict[str, object]
    host_end_ns: int  # host clock when ``end.record`` returned: the CPU finished enqueueing


class CudaClock:
    """Maps CUDA event times to the host monotonic clock.

    Calibration: with the device idle, take the host time, then record an event; the idle
    stream runs it one launch latency later. The reference is that host time (``before``), not
    the midpoint of the bracket: the wake-up from ``synchronize`` is slow and uneven (on the H200
    the midpoint put device times ~35 us early, so every stage's CPU lead read about -35 us).
    Device times are then at most one launch latency (a few us) early, so a lead is a slight
    under-estimate and a stage the device waited for reads ~0. Best of a few tries (the one with
    the tightest bracket). Later events convert through ``reference.elapsed_time(event)``.
    Taken once at start-up (a synchronisation, but not on the hot path); docs/design.md §5.14.1.
    """

    def __init__(self, device: Any = None, tries: int = 5) -> None:
        import torch

        self.device = torch.device(device if device is not None else "cuda")
        best: tuple[int, int, Any] | None = None
        with torch.cuda.device(self.device):
            for _ in range(tries):
                torch.cuda.synchronize()
                event = torch.cuda.Event(enable_timing=True)
                before = time.monotonic_ns()
                event.record()
                event.synchronize()
                after = time.monotonic_ns()
                if best is None or after - before < best[1] - best[0]:
                    best = (before, after, event)
        assert best is not None
        self.reference = best[2]
        self.reference_host_ns = best[0]
        self.uncertainty_ns = best[1] - best[0]

    def to_host_ns(self, event: Any) -> int:
        return self.reference_host_ns + int(self.reference.elapsed_time(event) * 1e6)


class CudaTimedEvent:
    """A timing ``torch.cuda.Event`` that reports host-clock times through a :class:`CudaClock`."""

    __slots__ = ("_event", "_clock")

    def __init__(self, clock: CudaClock) -> None:
        import torch

        self._event = torch.cuda.Event(enable_timing=True)
        self._clock = clock

    def record(self, stream: Any = None) -> None:
        self._event.record(stream)

    def query(self) -> bool:
        return bool(self._event.query())

    def host_ns(self) -> int:
        return self._clock.to_host_ns(self._event)


_STEP = Arg.STEP.value
_HOST_END_NS = Arg.HOST_END_NS.value


class _NullScope:
    """The stage scope of a disabled timeline: does nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> Literal[False]:
        return False


_NULL_SCOPE = _NullScope()


class _StageScope:
    """Records the begin event on enter, the end event (and the host time) on exit, then queues
    itself as the pending stage (it has :class:`PendingStage`'s fields: no second object)."""

    __slots__ = ("_timeline", "name", "step", "lane", "_stream", "args", "begin", "end",
                 "host_end_ns", "_contiguous", "end_shared")  # fmt: skip

    def __init__(
        self,
        timeline: DeviceTimeline,
        name: str,
        step: int,
        lane: str,
        stream: Any,
        args: dict[str, object],
        contiguous: bool,
    ) -> None:
        self._timeline, self.name, self.step = timeline, name, step
        self.lane, self._stream, self.args = lane, stream, args
        self._contiguous, self.end_shared = contiguous, False

    def __enter__(self) -> None:
        timeline = self._timeline
        last = timeline._last
        if self._contiguous and last is not None and last._stream is self._stream:
            # The stream reaches this stage's begin when it reaches the last stage's end.
            self.begin = last.end
            last.end_shared = True
            return
        free = timeline._free
        begin = self.begin = free.pop() if free else timeline._event_factory()
        begin.record(self._stream)

    def __exit__(
        self, exc_type: object, exc: object, tb: object, _now: Callable[[], int] = now_ns
    ) -> Literal[False]:
        if exc_type is not None:  # the stage was not enqueued whole: no slice
            return False
        timeline = self._timeline
        free = timeline._free
        end = self.end = free.pop() if free else timeline._event_factory()
        end.record(self._stream)
        # CPU lead = (when the stream reached ``end``) - (when the host recorded it): docs/design.md.
        host_end_ns = self.host_end_ns = _now()
        args = self.args  # this stage's own keyword dict: completed here, written as is
        args[_STEP] = self.step
        args[_HOST_END_NS] = host_end_ns
        timeline._last = self
        timeline.add(self)  # type: ignore[arg-type]
        return False


class DeviceTimeline:
    """Records event pairs around device stages and emits them as device-track slices.

    Args:
        tracer: where slices go; with a disabled tracer, :meth:`stage` records nothing.
        device_index: the ``<i>`` of ``gpu:<i>`` track names.
        event_factory: makes a fresh :class:`TimedEvent`.
        max_pending: pairs kept waiting before the oldest are dropped (and counted).
    """

    def __init__(
        self,
        tracer: Tracer,
        device_index: int,
        event_factory: Callable[[], TimedEvent],
        max_pending: int = 4096,
    ) -> None:
        self.tracer = tracer
        self.device_index = device_index
        self._event_factory = event_factory
        self._pending: deque[PendingStage] = deque()
        self._max_pending = max_pending
        self.num_emitted = 0
        # Events of emitted stages, recorded again by later stages (no create/destroy per stage).
        self._free: list[TimedEvent] = []
        self._last: _StageScope | None = None  # the stage recorded last (for ``contiguous``)
        self._last_read: tuple[Any, int] = (None, 0)  # (event, host_ns) of the last end read
        self._lane_tracks = {lane: device_track_name(device_index, lane) for lane in DEVICE_LANES}
        # Told (lane, name, step, start_ns, end_ns) of every slice emitted (a kernel window).
        self.observer: Callable[[str, str, int, int, int], None] | None = None

    @property
    def enabled(self) -> bool:
        return self.tracer.enabled

    def stage(
        self,
        name: str,
        *,
        step: int,
        lane: str = DEVICE_COMPUTE,
        stream: Any = None,
        contiguous: bool = False,
        **args: object,
    ) -> _StageScope | _NullScope:
        """Bracket the enqueue of one device stage with a begin and an end event (a context
        manager; a shared no-op one when tracing is off).

        ``contiguous``: the caller enqueued nothing on ``stream`` since the previous stage of this
        timeline ended on it, so this stage begins at that stage's end event (one event fewer);
        ignored when the previous stage ran on another stream.
        """
        if not self.tracer.enabled:
            return _NULL_SCOPE
        return _StageScope(self, name, step, lane, stream, args, contiguous)

    def _event(self) -> TimedEvent:
        """A timing event: one from the pool of emitted stages' events, or a fresh one."""
        free = self._free
        return free.pop() if free else self._event_factory()

    def add(self, stage: PendingStage) -> None:
        """Queue a recorded pair (for callers that record events themselves)."""
        if len(self._pending) >= self._max_pending:
            self._pending.popleft()
            self.tracer.count_dropped("device_slices")
        self._pending.append(stage)

    # stepscope: hot
    def poll(self) -> int:
        """Emit every pending stage whose end event completed, oldest first; never blocks.

        Stages complete in stream order per lane, so polling stops at the first incomplete one.
        Returns how many slices were emitted.
        """
        emitted = 0
        while self._pending and self._pending[0].end.query():
            self._emit(self._pending.popleft())
            emitted += 1
        return emitted

    def drain(self) -> int:
        """Emit what has completed, then drop (and count) what cannot complete. Off the hot path."""
        emitted = self.poll()
        # Lanes complete independently: a later stage on another lane may be done already.
        still: deque[PendingStage] = deque()
        for stage in self._pending:
            if stage.end.query():
                self._emit(stage)
                emitted += 1
            else:
                still.append(stage)
        self._pending = still
        return emitted

    def new_event(self) -> TimedEvent:
        """A fresh timing event on the timeline's host clock (for markers outside stages)."""
        return self._event_factory()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def _emit(self, stage: PendingStage) -> None:
        begin, end = stage.begin, stage.end
        last_event, last_ns = self._last_read
        start_ns = last_ns if begin is last_event else begin.host_ns()
        end_ns = end.host_ns()
        self._last_read = (end, end_ns)
        end_ns = max(end_ns, start_ns)
        # Completed and read: free to record again (a shared end once its second stage is out).
        self._free.append(begin)
        if not getattr(stage, "end_shared", False):
            self._free.append(end)
        args = stage.args
        if _HOST_END_NS not in args:  # a stage queued through add() by its caller
            args = {_STEP: stage.step, _HOST_END_NS: stage.host_end_ns, **args}
        self.tracer.slice_args(self._lane_tracks[stage.lane], stage.name, start_ns, end_ns, args)
        self.num_emitted += 1
        if self.observer is not None:
            self.observer(stage.lane, stage.name, stage.step, start_ns, end_ns)
