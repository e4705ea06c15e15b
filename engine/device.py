"""Where device work runs: CUDA streams and events, or CPU worker threads that behave like them.

The runner has one code path for both. It enqueues device work with ``device.submit(stream, fn)``
and orders streams with events:

* :class:`CudaDevice` -- ``submit`` calls ``fn`` at once under ``torch.cuda.stream(stream)``, so
  the kernels ``fn`` launches are queued on that stream; events are ``torch.cuda.Event``.
* :class:`CpuDevice` -- every stream is a :class:`CpuStream`, a FIFO of closures drained by one
  dedicated worker thread in enqueue order; ``submit`` appends ``fn`` and returns. A
  :class:`CpuEvent` recorded on a stream is a marker in that FIFO that stamps
  ``time.monotonic_ns()`` when the worker reaches it. The overlap this gives is real (torch
  releases the GIL inside each op) but bounded by the GIL, and nothing pretends otherwise.

Errors on a CPU worker poison the stream like a CUDA error poisons a context: later closures on
that stream are skipped, markers still complete (so nobody waits forever), and the original
exception, with its original traceback, is raised by the next ``synchronize`` of an event
recorded after it (or by a stream that waited on such an event).

Streams: ``compute`` (input prep, forward, sample), ``h2d`` (staged writes and step inputs,
host->device) and ``d2h`` (sampled tokens, device->host). Copies have their own streams so that
the output copy of step N never queues in front of the input copy of step N+1.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

_allocate_lock = threading.Lock  # the C lock type: no Python frame to make one

__all__ = [
    "DeviceEvent",
    "Device",
    "CpuStream",
    "CpuEvent",
    "CpuDevice",
    "CudaDevice",
    "create_device",
]


class DeviceEvent(Protocol):
    """A completion marker recorded on a stream (the subset of ``torch.cuda.Event`` we use)."""

    def record(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Device(ABC):
    """Streams, events and host buffers of one accelerator (or of the CPU standing in for one)."""

    torch_device: torch.device
    index: int
    compute_stream: Any
    h2d_stream: Any
    d2h_stream: Any

    @property
    @abstractmethod
    def is_cuda(self) -> bool:
        """True for a real CUDA device."""

    @abstractmethod
    def submit(self, stream: Any, fn: Callable[[], None]) -> None:
        """Enqueue ``fn`` on ``stream``; returns before the device work has run."""

    @abstractmethod
    def new_event(self) -> DeviceEvent:
        """A fresh, unrecorded event (no timing)."""

    @abstractmethod
    def timed_event_factory(self) -> Callable[[], Any]:
        """Factory of ``TimedEvent`` objects for ``instrument.device_timeline.DeviceTimeline``
        (on CUDA a ``CudaClock``: also the timeline's ``EventOps``, see
        ``instrument/device_events.py``)."""

    @abstractmethod
    def wait_event(self, stream: Any, event: DeviceEvent) -> None:
        """Make later work on ``stream`` wait for ``event`` (the device waits, not the host)."""

    @abstractmethod
    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor that async copies may read from or write into (pinned on CUDA)."""

    @abstractmethod
    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the allocator ``tensor`` is in use on ``stream`` (CUDA ``record_stream``)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all streams (start-up and shutdown only; never on the hot path)."""

    @abstractmethod
    def close(self) -> None:
        """Release worker threads; the device is unusable afterwards."""

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# CPU: one worker thread per stream.


class _Stamp:
    """The outcome of one ``CpuEvent.record``, and its marker in the stream's queue: ``finished``
    turns True when the worker reaches it, after ``ns`` and ``error`` are set; ``done`` is a lock
    held until then (the worker releases it), which waiters acquire and release in turn.

    A lock made and taken in C, not a ``threading.Event`` (a Condition and its locks built in
    Python: several µs per record, paid on the engine thread for every event of every step)."""

    __slots__ = ("done", "ns", "error", "finished")

    def __init__(self) -> None:
        self.done = _allocate_lock()
        self.done.acquire()
        self.ns = 0
        self.error: BaseException | None = None
        self.finished = False

    def wait(self) -> None:
        if not self.finished:
            self.done.acquire()  # released by the worker at the marker
            self.done.release()  # for the next waiter


class _Wait:
    __slots__ = ("stamp",)

    def __init__(self, stamp: _Stamp) -> None:
        self.stamp = stamp


_STOP = object()
# Every CPU stream not yet closed: at interpreter exit they are stopped and joined, since a
# worker thread still alive there (an LLM never closed) aborted the process with SIGABRT
# ("terminate called without an active exception") after the script's last line.
_OPEN_STREAMS: weakref.WeakSet[CpuStream] = weakref.WeakSet()


@atexit.register
def _close_open_streams() -> None:
    for stream in list(_OPEN_STREAMS):
        stream.close()


class CpuStream:
    """A CPU 'stream': closures run one at a time, in enqueue order, on a dedicated thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._closed = False  # only close() ends the worker (_step keeps every error)
        self._thread = threading.Thread(target=self._run, name=f"cpu-stream-{name}", daemon=True)
        self._thread.start()
        _OPEN_STREAMS.add(self)

    def enqueue(self, item: Any) -> None:
        if self._closed:  # a flag, not Thread.is_alive (Python frames, on every enqueue)
            raise RuntimeError(f"CPU stream {self.name!r} is closed")
        self._queue.put(item)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
            self._thread.join()

    def _run(self) -> None:
        # Grad mode is thread-local: device work never builds autograd graphs.
        with torch.no_grad():
            while True:
                item = self._queue.get()
                if item is _STOP:
                    return
                self._step(item)

    def _step(self, item: Any) -> None:
        if isinstance(item, _Stamp):  # a marker
            item.error = self._error
            item.ns = time.monotonic_ns()
            item.finished = True
            item.done.release()
        elif isinstance(item, _Wait):
            item.stamp.wait()
            if item.stamp.error is not None and self._error is None:
                self._error = item.stamp.error
        elif self._error is None:
            try:
                item()
            except BaseException as exc:  # noqa: BLE001 -- kept and re-raised on the next wait
                self._error = exc


class CpuEvent:
    """A marker in a :class:`CpuStream`; also a ``TimedEvent`` for the device timeline."""

    def __init__(self) -> None:
        self._stamp: _Stamp | None = None

    # One frame: the stamp is built and enqueued inline (the device timeline records five of
    # these per traced step on the engine thread; docs/design.md §4.3).
    def record(
        self,
        stream: Any = None,
        _new: Callable[..., Any] = object.__new__,
        _lock: Any = _allocate_lock,
    ) -> None:
        if not isinstance(stream, CpuStream):
            raise TypeError(f"CpuEvent.record needs a CpuStream, got {type(stream).__name__}")
        if stream._closed:
            raise RuntimeError(f"CPU stream {stream.name!r} is closed")
        stamp = _new(_Stamp)  # as _Stamp(), without its __init__ frame
        done = stamp.done = _lock()
        done.acquire()
        stamp.ns, stamp.error, stamp.finished = 0, None, False
        self._stamp = stamp
        stream._queue.put(stamp)

    def query(self) -> bool:
        """Non-blocking: has the worker passed the marker? (True if never recorded, as CUDA.)"""
        return self._stamp is None or self._stamp.finished

    def synchronize(self) -> None:
        """Block until the marker is reached; re-raise an error the stream hit before it."""
        if self._stamp is None:
            return
        self._stamp.wait()
        if self._stamp.error is not None:
            raise self._stamp.error

    def host_ns(self) -> int:
        """``time.monotonic_ns()`` at which the worker reached the marker (once ``query()``)."""
        if self._stamp is None or not self._stamp.finished:
            raise RuntimeError("CpuEvent.host_ns() before the event completed")
        return self._stamp.ns

    def _current_stamp(self) -> _Stamp | None:
        return self._stamp


class CpuDevice(Device):
    """Runs device work on worker threads, one per stream, in enqueue order."""

    def __init__(self) -> None:
        self.torch_device = torch.device("cpu")
        self.index = 0
        self.compute_stream = CpuStream("compute")
        self.h2d_stream = CpuStream("h2d")
        self.d2h_stream = CpuStream("d2h")
        self._streams = (self.compute_stream, self.h2d_stream, self.d2h_stream)

    @property
    def is_cuda(self) -> bool:
        return False

    def submit(self, stream: Any, fn: Callable[[], None]) -> None:
        stream.enqueue(fn)

    def new_event(self) -> CpuEvent:
        return CpuEvent()

    def timed_event_factory(self) -> Callable[[], CpuEvent]:
        return CpuEvent

    def wait_event(self, stream: Any, event: DeviceEvent) -> None:
        if not isinstance(event, CpuEvent):
            raise TypeError(f"CpuDevice.wait_event needs a CpuEvent, got {type(event).__name__}")
        stamp = event._current_stamp()
        if stamp is not None:  # waiting on a never-recorded event is a no-op, as in CUDA
            stream.enqueue(_Wait(stamp))

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype)

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        pass  # CPU tensors are kept alive by the closures that use them

    def synchronize(self) -> None:
        for stream in self._streams:
            event = CpuEvent()
            event.record(stream)
            event.synchronize()

    def close(self) -> None:
        for stream in self._streams:
            stream.close()


# ---------------------------------------------------------------------------------------------
# CUDA: real streams and events.


class CudaDevice(Device):
    """One CUDA device with a compute stream and two side copy streams."""

    def __init__(self, index: int = 0) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaDevice needs a CUDA device, and torch sees none")
        self.torch_device = torch.device("cuda", index)
        self.index = index
        self.compute_stream = torch.cuda.Stream(self.torch_device)
        self.h2d_stream = torch.cuda.Stream(self.torch_device)
        self.d2h_stream = torch.cuda.Stream(self.torch_device)

    @property
    def is_cuda(self) -> bool:
        return True

    def submit(self, stream: Any, fn: Callable[[], None]) -> None:
        # no_grad: device work never builds autograd graphs (the CPU workers do the same).
        with torch.cuda.device(self.torch_device), torch.cuda.stream(stream), torch.no_grad():
            fn()

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def timed_event_factory(self) -> Callable[[], Any]:
        # Calibrating the clock synchronises the device once: start-up only.
        # The clock is also the timeline's EventOps: C-level event calls, batched conversion.
        from instrument.device_events import CudaClock

        return CudaClock.calibrate(self.torch_device)

    def wait_event(self, stream: Any, event: DeviceEvent) -> None:
        stream.wait_event(event)

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def close(self) -> None:
        pass  # streams and events are released with the objects


def create_device(kind: str = "auto", index: int = 0) -> Device:
    """``"cuda"``, ``"cpu"`` or ``"auto"`` (CUDA when torch sees one)."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        return CudaDevice(index)
    if kind == "cpu":
        return CpuDevice()
    raise ValueError(f"device kind must be 'auto', 'cuda' or 'cpu', got {kind!r}")
