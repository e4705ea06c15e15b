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

import itertools
import time
import types
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from instrument.cuda_driver import CudaDriver

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

    def keep_anchored(self) -> None:
        """Called now and then by the timeline's idle poller, under the timeline's lock: keep
        the conversion's reference recent (:class:`CudaClock`); nothing by default."""
        return None


def _record(event: Any, stream: Any) -> None:
    event.record(stream)


def _query(event: Any) -> bool:
    return bool(event.query())


class FactoryEventOps(EventOps):
    """:class:`EventOps` over a factory of :class:`TimedEvent` objects.

    When the factory is a class, ``record`` and ``query`` are that class's own functions (one
    Python frame per call, not two): the events given to them must be instances of it, as the
    ones :meth:`new` makes are (and as ``DeviceTimeline.event_after_stage``'s ``make`` must
    return)."""

    record = staticmethod(_record)
    query = staticmethod(_query)

    def __init__(self, factory: Callable[[], TimedEvent]) -> None:
        self._factory = factory
        if isinstance(factory, type):  # the class's own methods: one frame less per call
            record, query = factory.__dict__.get("record"), factory.__dict__.get("query")
            if isinstance(record, types.FunctionType):
                self.record = record  # type: ignore[method-assign]
            if isinstance(query, types.FunctionType):
                self.query = query  # type: ignore[method-assign]

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

    # ``calibrate``'s default: "auto" (the driver's calls if they pass their self-test), "driver"
    # (the same, but a failed self-test is an error), "driver-held" (as "driver", with the
    # poller's reads keeping the GIL: CudaDriver.load's ``reads_keep_gil``) or "torch" (torch's C
    # methods).
    DEFAULT_API = "auto"
    APIS = ("auto", "driver", "driver-held", "torch")
    # An elapsed time is a float32 of milliseconds: its rounding error is up to half an ulp
    # (8 us three minutes after a start-up reference, 31 us after fifteen). So the clock moves its reference
    # forward: once converted events lie ANCHOR_MS past it, it records an anchor event of its own
    # (on ``anchor_stream``), and once that completed its host time (read through the current
    # reference: <= 15 ns of rounding at 256 ms) makes it the new reference.
    ANCHOR_MS = 256.0

    def __init__(
        self,
        reference: Any,
        reference_host_ns: int,
        uncertainty_ns: int = 0,
        event_cls: type | None = None,
        driver: CudaDriver | None = None,
    ) -> None:
        if event_cls is None:
            import torch

            event_cls = torch.cuda.Event
        self.event_cls = event_cls
        self.reference = reference
        self.reference_host_ns = reference_host_ns
        # (reference, its host ns), replaced in one assignment: a reader on another thread never
        # sees a new reference with the old time.
        self._ref: tuple[Any, int] = (reference, reference_host_ns)
        self.uncertainty_ns = uncertainty_ns
        self.device: Any = None  # set by calibrate()
        self.driver = driver
        self.api = "torch" if driver is None else f"driver ({driver.name})"
        self.api_reason = ""  # why the driver's calls are not used, when they are not
        if driver is None:
            self.record = c_method(event_cls, "record")
            self.query = c_method(event_cls, "query")
        else:
            self.record = driver.record  # type: ignore[method-assign]
            self.query = driver.query  # type: ignore[method-assign]
        self._elapsed_ms = c_method(event_cls, "elapsed_time")
        self.anchor_stream: Any = None  # where anchors are recorded (None: never re-anchor)
        self._next_anchor: Any = None  # recorded, not known complete yet
        self._spare_anchor: Any = None  # the previous reference, recorded again as the next
        self.num_anchors = 0  # references taken after the start-up one
        self.num_anchor_records = 0  # anchors recorded (event calls besides the timeline's)

    @classmethod
    def calibrate(cls, device: Any = None, tries: int = 5, api: str | None = None) -> CudaClock:
        """Synchronise the device and take the reference event (start-up only). ``api``: which
        calls record, query and read events (default ``DEFAULT_API``): ``"driver"`` /
        ``"auto"`` the CUDA driver's (:class:`~instrument.cuda_driver.CudaDriver`), checked
        against torch's on the device first (``"auto"`` falls back to torch's when they are
        missing or disagree, and says why in ``api_reason``), ``"driver-held"`` the driver's
        with reads that keep the GIL, ``"torch"`` torch's."""
        import torch

        api = api or cls.DEFAULT_API
        if api not in cls.APIS:
            raise ValueError(f"api must be one of {', '.join(cls.APIS)}, got {api!r}")
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
        driver, reason = None, ""
        if api != "torch":
            driver = CudaDriver.load(reads_keep_gil=api == "driver-held")
            reason = "libcuda or an event symbol not found" if driver is None else ""
            if driver is not None:  # on this thread as it is (the engine's records run here)
                stream = torch.cuda.current_stream(device)

                def spin() -> None:
                    with torch.cuda.device(device), torch.cuda.stream(stream):
                        torch.cuda._sleep(100_000)

                failed = driver.self_test(
                    torch.cuda.Event, stream, lambda: torch.cuda.synchronize(device), spin
                )
                if failed is not None:
                    driver, reason = None, failed
            if driver is None and api != "auto":
                raise RuntimeError(f"the CUDA driver's event calls cannot be used: {reason}")
        clock = cls(best[2], best[0], best[1] - best[0], driver=driver)
        clock.api_reason = reason
        clock.anchor_stream = torch.cuda.Stream(device)  # idle: an anchor completes at once
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

    def _elapsed(self, start: Any, end: Any) -> float:
        if self.driver is not None:
            return self.driver.elapsed_ms(start, end)
        return float(self._elapsed_ms(start, end))

    def to_host_ns(self, event: Any) -> int:
        ref, base = self._ref
        return base + round(self._elapsed(ref, event) * 1e6)

    def host_ns_many(self, events: Sequence[Any]) -> list[int]:
        """Under the timeline's lock (its polls): also moves the reference forward."""
        self.keep_anchored()
        ref, base = self._ref
        if self.driver is not None:  # one driver call per event (torch's makes three)
            ms = self.driver.elapsed_ms_many(ref, list(events))
        else:
            elapsed_ms = self._elapsed_ms
            ms = [elapsed_ms(ref, event) for event in events]
        if ms and max(ms) > self.ANCHOR_MS:
            self._record_anchor()
        return [base + round(m * 1e6) for m in ms]

    def keep_anchored(self) -> None:
        """Take a completed anchor as the reference; record one if the reference is older than
        ``ANCHOR_MS`` on the host clock (the timeline's poller calls this when idle, so a long
        pause keeps the reference recent). Off the hot path: polls and the poller only."""
        anchor = self._next_anchor
        if anchor is not None:
            if not self.query(anchor):
                return
            ref, base = self._ref
            self._ref = (anchor, base + round(self._elapsed(ref, anchor) * 1e6))
            self.reference, self.reference_host_ns = self._ref
            self._spare_anchor, self._next_anchor = ref, None
            self.num_anchors += 1
        if time.monotonic_ns() - self._ref[1] > self.ANCHOR_MS * 1e6:
            self._record_anchor()

    def _record_anchor(self) -> None:
        if self._next_anchor is not None or self.anchor_stream is None:
            return
        anchor = self._spare_anchor if self._spare_anchor is not None else self.new()
        self._spare_anchor = None
        self.record(anchor, self.anchor_stream)
        self._next_anchor = anchor
        self.num_anchor_records += 1

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


STAND_IN_HANDLES: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_stand_in_handles = itertools.count(1)


def _register(obj: Any) -> int:
    """A handle for a stand-in event or stream (``STAND_IN_HANDLES`` maps it back)."""
    handle = next(_stand_in_handles)
    STAND_IN_HANDLES[handle] = obj
    return handle


class StandInStream:
    """A stream for :class:`StandInCudaEvent`: events recorded on it complete when
    :meth:`advance` moves the simulated device past them (all at once with ``auto``)."""

    def __init__(self, auto: bool = False) -> None:
        self.auto = auto
        self.num_recorded = 0
        self.num_done = 0
        self._handle = 0

    @property
    def cuda_stream(self) -> int:
        """Its handle, for :class:`~instrument.cuda_driver.StandInDriver` (given on first use)."""
        if not self._handle:
            self._handle = _register(self)
        return self._handle

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
    __slots__ = ("_stream", "_seq", "ns", "_handle", "__weakref__")

    def __init__(self, enable_timing: bool = False, **_: object) -> None:
        self.calls["create"] += 1
        self._stream: StandInStream | None = None
        self._seq = 0
        self.ns = 0
        self._handle = 0  # given on first use (the driver path only)

    @property
    def cuda_event(self) -> int:
        """Its handle, for :class:`~instrument.cuda_driver.StandInDriver`; 0 until its first
        record, like torch's (which creates CUDA events lazily)."""
        if self._stream is None:
            return 0
        if not self._handle:
            self._handle = _register(self)
        return self._handle

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
    def clock(stream: StandInStream | None = None, driver: CudaDriver | None = None) -> CudaClock:
        """A :class:`CudaClock` over stand-in events (reference recorded now); ``driver``: a
        :class:`~instrument.cuda_driver.StandInDriver` for the driver's code path."""
        reference = StandInCudaEvent()
        reference.record(stream or StandInStream(auto=True))
        clock = CudaClock(reference, reference.ns, 0, StandInCudaEvent, driver=driver)
        clock.anchor_stream = StandInStream(auto=True)
        return clock
