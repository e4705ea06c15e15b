"""How the device timeline makes, records, queries and reads its timing events.

:class:`EventOps` is what the timeline's hot path calls: ``record(event, stream)``,
``query(event)``, and ``host_ns_many(events)``, which converts a whole batch of completed events
to host-clock times in one pass. Two kinds:

* :class:`CudaClock`: timing ``torch.cuda.Event`` objects, driven through the C methods of their
  base class (``torch.cuda.Event`` wraps each in a Python method: one frame less per call), and
  mapped onto the host clock by ``elapsed_time`` against a reference event taken at start-up;
* :class:`FactoryEventOps`: any factory of :class:`TimedEvent` objects (the CPU device's events,
  host-stamped stand-ins in tests and benchmarks).

Both are also factories of :class:`TimedEvent` objects (calling them returns one), for markers
outside stages (the kernel window's clock markers).
"""

from __future__ import annotations

import time
import types
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = [
    "TimedEvent",
    "EventOps",
    "FactoryEventOps",
    "CudaClock",
    "CudaTimedEvent",
    "StandInCudaEvent",
    "StandInStream",
    "as_ops",
]


class TimedEvent(Protocol):
    """An event that can be recorded on a stream and read back as a host timestamp."""

    def record(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...

    def host_ns(self) -> int: ...


class EventOps(ABC):
    """The timeline's event calls. ``record(event, stream)`` and ``query(event)`` are plain
    attributes (the fastest callables the kind has); events are whatever :meth:`new` returns."""

    record: Callable[[Any, Any], None]
    query: Callable[[Any], bool]

    @abstractmethod
    def new(self) -> Any:
        """A fresh, unrecorded event."""

    @abstractmethod
    def host_ns_many(self, events: Sequence[Any]) -> list[int]:
        """Host-clock times of completed events, in order (one pass over the batch)."""

    @abstractmethod
    def __call__(self) -> TimedEvent:
        """A :class:`TimedEvent` on the same clock (markers outside stages)."""

    def default_stream(self) -> Any:
        """The stream a stage given none is recorded on (None: the events take None)."""
        return None

    def bind_thread(self) -> None:
        """Called first on another thread that will query and read events (the timeline's
        poller): make the events' device current there (nothing for host-stamped events)."""
        return None


def _record(event: Any, stream: Any) -> None:
    event.record(stream)


def _query(event: Any) -> bool:
    return bool(event.query())


class FactoryEventOps(EventOps):
    """:class:`EventOps` over a factory of :class:`TimedEvent` objects."""

    record = staticmethod(_record)
    query = staticmethod(_query)

    def __init__(self, factory: Callable[[], TimedEvent]) -> None:
        self._factory = factory

    def new(self) -> TimedEvent:
        return self._factory()

    def host_ns_many(self, events: Sequence[Any]) -> list[int]:
        return [event.host_ns() for event in events]

    def __call__(self) -> TimedEvent:
        return self._factory()


def as_ops(event_factory: EventOps | Callable[[], TimedEvent]) -> EventOps:
    """``event_factory`` itself when it is an :class:`EventOps`, else wrapped in one."""
    if isinstance(event_factory, EventOps):
        return event_factory
    return FactoryEventOps(event_factory)


def c_method(cls: type, name: str) -> Callable[..., Any]:
    """``cls.name`` as the first implementation in the MRO that is not a Python function: the C
    method under a Python wrapper (``torch.cuda.Event.record`` wraps ``_CudaEventBase.record``).
    A class with only Python methods (a stand-in) gets its own method."""
    for klass in cls.__mro__:
        attr = klass.__dict__.get(name)
        if attr is not None and not isinstance(attr, types.FunctionType):
            return attr  # type: ignore[no-any-return]
    return getattr(cls, name)  # type: ignore[no-any-return]


class CudaClock(EventOps):
    """Maps CUDA event times to the host monotonic clock; also the timeline's :class:`EventOps`
    for timing ``torch.cuda.Event`` objects.

    Calibration (:meth:`calibrate`): with the device idle, take the host time, then record an
    event; the idle stream runs it one launch latency later. The reference is that host time
    (``before``), not the midpoint of the bracket: the wake-up from ``synchronize`` is slow and
    uneven (on the H200 the midpoint put device times ~35 us early, so every stage's CPU lead read
    about -35 us). Device times are then at most one launch latency (a few us) early, so a lead is
    a slight under-estimate and a stage the device waited for reads ~0. Best of a few tries (the
    one with the tightest bracket). Later events convert through ``reference.elapsed_time(event)``.
    Taken once at start-up (a synchronisation, but not on the hot path); docs/design.md §5.14.1.

    Args:
        reference: a completed timing event recorded at host time ``reference_host_ns``.
        event_cls: the event class (``torch.cuda.Event``; a stand-in with its interface in tests
            and the no-device benchmark). Events are ``event_cls(enable_timing=True)``; ``record``
            needs an explicit stream.
    """

    def __init__(
        self,
        reference: Any,
        reference_host_ns: int,
        uncertainty_ns: int = 0,
        event_cls: type | None = None,
    ) -> None:
        if event_cls is None:
            import torch

            event_cls = torch.cuda.Event
        self.event_cls = event_cls
        self.reference = reference
        self.reference_host_ns = reference_host_ns
        self.uncertainty_ns = uncertainty_ns
        self.device: Any = None  # set by calibrate()
        self.record = c_method(event_cls, "record")
        self.query = c_method(event_cls, "query")
        self._elapsed_ms = c_method(event_cls, "elapsed_time")

    @classmethod
    def calibrate(cls, device: Any = None, tries: int = 5) -> CudaClock:
        """Synchronise the device and take the reference event (start-up only)."""
        import torch

        device = torch.device(device if device is not None else "cuda")
        best: tuple[int, int, Any] | None = None
        with torch.cuda.device(device):
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
        clock = cls(best[2], best[0], best[1] - best[0])
        # With its index: a poller thread makes this device current (its default is device 0).
        clock.device = (
            device
            if device.index is not None
            else torch.device("cuda", torch.cuda.current_device())
        )
        return clock

    def new(self) -> Any:
        return self.event_cls(enable_timing=True)

    def default_stream(self) -> Any:
        # The C ``record`` needs a real stream (older torch does not even check its type).
        import torch

        return torch.cuda.current_stream(self.device)

    def bind_thread(self) -> None:
        if self.device is not None:
            import torch

            torch.cuda.set_device(self.device)

    def to_host_ns(self, event: Any) -> int:
        return self.reference_host_ns + int(self._elapsed_ms(self.reference, event) * 1e6)

    def host_ns_many(self, events: Sequence[Any]) -> list[int]:
        base, ref, elapsed_ms = self.reference_host_ns, self.reference, self._elapsed_ms
        return [base + int(elapsed_ms(ref, event) * 1e6) for event in events]

    def __call__(self) -> CudaTimedEvent:
        return CudaTimedEvent(self)


class CudaTimedEvent:
    """A timing ``torch.cuda.Event`` that reports host-clock times through a :class:`CudaClock`."""

    __slots__ = ("_event", "_clock")

    def __init__(self, clock: CudaClock) -> None:
        self._event = clock.new()
        self._clock = clock

    def record(self, stream: Any = None) -> None:
        if stream is None:
            import torch

            stream = torch.cuda.current_stream()
        self._clock.record(self._event, stream)

    def query(self) -> bool:
        return bool(self._clock.query(self._event))

    def host_ns(self) -> int:
        return self._clock.to_host_ns(self._event)


class StandInStream:
    """A stream for :class:`StandInCudaEvent`: events recorded on it complete when
    :meth:`advance` moves the simulated device past them (all at once with ``auto``)."""

    def __init__(self, auto: bool = False) -> None:
        self.auto = auto
        self.num_recorded = 0
        self.num_done = 0

    def advance(self, num_events: int | None = None) -> None:
        """Complete the next ``num_events`` recorded events (all of them: None)."""
        target = self.num_recorded if num_events is None else self.num_done + num_events
        self.num_done = min(self.num_recorded, target)


class StandInCudaEvent:
    """A stand-in with ``torch.cuda.Event``'s interface, stamped with the host clock when
    recorded, that counts its calls in the class-level ``calls`` (``record``, ``query``,
    ``elapsed_time``, and ``create``: events made): the no-device benchmark and tests count what the CUDA path would call.
    Like CUDA, ``elapsed_time`` on an event that has not completed raises."""

    calls: dict[str, int] = {"record": 0, "query": 0, "elapsed_time": 0, "create": 0}
    __slots__ = ("_stream", "_seq", "ns")

    def __init__(self, enable_timing: bool = False, **_: object) -> None:
        self.calls["create"] += 1
        self._stream: StandInStream | None = None
        self._seq = 0
        self.ns = 0

    @classmethod
    def reset_calls(cls) -> None:
        for name in cls.calls:
            cls.calls[name] = 0

    def record(self, stream: StandInStream) -> None:
        self.calls["record"] += 1
        stream.num_recorded += 1
        self._stream, self._seq, self.ns = stream, stream.num_recorded, time.monotonic_ns()

    def _done(self) -> bool:
        s = self._stream
        return s is None or s.auto or self._seq <= s.num_done

    def query(self) -> bool:
        self.calls["query"] += 1
        return self._done()

    def elapsed_time(self, end: StandInCudaEvent) -> float:
        self.calls["elapsed_time"] += 1
        if not (self._done() and end._done()):
            raise RuntimeError("elapsed_time on an event that has not completed")
        return (end.ns - self.ns) / 1e6

    @staticmethod
    def clock(stream: StandInStream | None = None) -> CudaClock:
        """A :class:`CudaClock` over stand-in events (reference recorded now)."""
        reference = StandInCudaEvent()
        reference.record(stream or StandInStream(auto=True))
        return CudaClock(reference, reference.ns, 0, StandInCudaEvent)
