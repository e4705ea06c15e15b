"""The CUDA driver's event calls, made on raw handles: what the device timeline calls per stage.

``torch.cuda.Event``'s C methods wrap more than the driver call: ``record`` takes a device guard,
asks whether the current stream is capturing (a second driver call) and releases and re-takes
the GIL; ``elapsed_time`` queries both events first (three driver calls per conversion) and keeps
the GIL throughout. :class:`CudaDriver` calls ``cuEventRecord``, ``cuEventQuery`` and
``cuEventElapsedTime`` of ``libcuda`` directly on the handles torch exposes (``Event.cuda_event``,
``Stream.cuda_stream``): one driver call each. ``record`` keeps the GIL (it runs on the engine
thread: a driver call of a microsecond or two is cheaper than handing the GIL over and waiting
to get it back); ``query`` and ``elapsed_ms`` release it (they run on the timeline's poller
thread, and the engine thread may take the GIL meanwhile). docs/design.md §4.3.

With the compiled stage core (``instrument/_stagecore.c``) the records go through
``cuEventRecord``'s C address (``record_addr``) and a poll's conversions through one C loop
(:meth:`CudaDriver.use_compiled`), which hands the GIL over once per poll.

:meth:`CudaDriver.load` returns None where ``libcuda`` or a symbol is missing;
``instrument.device_events.CudaClock`` then checks it against torch's calls on the device once
at start-up (:meth:`CudaDriver.self_test`) and falls back to torch's calls if anything differs.
:class:`StandInDriver` is the same interface over
:class:`~instrument.device_events.StandInCudaEvent` handles (tests, the no-device benchmark).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

__all__ = ["CudaDriver", "CudaDriverError", "StandInDriver", "CUDA_SUCCESS", "CUDA_ERROR_NOT_READY"]

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600


# cuEventRecord's C signature: CUresult (CUevent, CUstream).
_RECORD_FN_TYPE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
# cuEventElapsedTime's: CUresult (float *ms, CUevent start, CUevent end).
_ELAPSED_FN_TYPE = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p
)


class CudaDriverError(RuntimeError):
    """A driver call returned an error code."""


class CudaDriver:
    """``record(event, stream)``, ``query(event)`` and ``elapsed_ms(start, end)`` on
    ``torch.cuda.Event`` / ``torch.cuda.Stream`` objects, through their raw handles.

    An event torch has not created yet (handle 0: torch creates events lazily, at their first
    record) is recorded through torch once (``torch_record``), which creates it.

    Args:
        record_fn, query_fn, elapsed_fn: ``cuEventRecord(event, stream)``,
            ``cuEventQuery(event)``, ``cuEventElapsedTime(float *ms, start, end)``; each returns
            a ``CUresult``.
        torch_record: records an event that has no handle yet.
        name: where the calls come from (``libcuda``, a stand-in).
        record_addr: the C address of ``record_fn`` (0: none), which the compiled stage core
            (``instrument/_stagecore.c``) calls directly, the GIL kept, as ``record`` does.
        elapsed_addr: the C address of ``elapsed_fn`` (0: none): with :meth:`use_compiled`,
            :meth:`elapsed_ms_many` makes a poll's conversions in one C loop.
        reads_release_gil: that loop runs without the GIL (as ``elapsed_fn`` from ``CDLL``
            does per call); False: it keeps it (``driver-held``).
    """

    def __init__(
        self,
        record_fn: Callable[[int, int], int],
        query_fn: Callable[[int], int],
        elapsed_fn: Callable[[Any, int, int], int],
        torch_record: Callable[[Any, Any], None],
        name: str = "libcuda",
        record_addr: int = 0,
        elapsed_addr: int = 0,
        reads_release_gil: bool = True,
    ) -> None:
        self.name = name
        self.record_addr = record_addr
        self.elapsed_addr = elapsed_addr
        self.reads_release_gil = reads_release_gil
        self._elapsed_many_c: Callable[..., list[float]] | None = None
        self._elapsed_fn = elapsed_fn
        self._ms = ctypes.c_float()
        self._ms_ref = ctypes.byref(self._ms)

        def record(event: Any, stream: Any) -> None:
            handle = event.cuda_event
            if not handle:
                torch_record(event, stream)
            elif record_fn(handle, stream.cuda_stream):
                raise CudaDriverError(f"cuEventRecord failed: {record_fn(handle, 0)}")

        def query(event: Any) -> bool:
            handle = event.cuda_event
            if not handle:  # never recorded: as torch says, complete
                return True
            code = query_fn(handle)
            if code == CUDA_SUCCESS:
                return True
            if code == CUDA_ERROR_NOT_READY:
                return False
            raise CudaDriverError(f"cuEventQuery failed with CUresult {code}")

        self.record = record
        self.query = query

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds from ``start`` to ``end`` (both completed), as ``cuEventElapsedTime``
        gives them (a float32)."""
        code = self._elapsed_fn(self._ms_ref, start.cuda_event, end.cuda_event)
        if code:
            raise CudaDriverError(f"cuEventElapsedTime failed with CUresult {code}")
        return self._ms.value

    def use_compiled(self, module: Any) -> bool:
        """Convert through the compiled stage core's ``elapsed_ms_many`` from now on (when
        ``elapsed_addr`` is known): one C loop per poll, the GIL handed over once for all its
        events instead of once per event; None: through ``elapsed_fn`` again, one call at a
        time. Returns whether the C loop is used."""
        self._elapsed_many_c = (
            module.elapsed_ms_many if module is not None and self.elapsed_addr else None
        )
        return self._elapsed_many_c is not None

    def elapsed_ms_many(self, start: Any, events: list[Any]) -> list[float]:
        """:meth:`elapsed_ms` from ``start`` to each of ``events``, in order (one pass)."""
        if self._elapsed_many_c is not None:
            return self._elapsed_many_c(
                self.elapsed_addr, start, events, self.reads_release_gil, CudaDriverError
            )
        fn, ms, ref, start_handle = self._elapsed_fn, self._ms, self._ms_ref, start.cuda_event
        out = []
        for event in events:
            code = fn(ref, start_handle, event.cuda_event)
            if code:
                raise CudaDriverError(f"cuEventElapsedTime failed with CUresult {code}")
            out.append(ms.value)
        return out

    @classmethod
    def load(cls, library: str = "libcuda.so.1", reads_keep_gil: bool = False) -> CudaDriver | None:
        """The driver's calls from ``library``; None where it or a symbol is missing.

        ``reads_keep_gil``: ``query`` and ``elapsed_ms`` keep the GIL too (as ``record`` does),
        so the poller's reads never run inside the driver while the engine thread records or
        launches (which hold the GIL): no driver-lock contention between the two threads, at
        the price of the poller holding the GIL through its reads. An A/B lever for
        ``bench_trace_overhead.py --event-api driver-held``; docs/design.md §4.3."""
        try:
            held = ctypes.PyDLL(library)  # keeps the GIL during the call
            free = held if reads_keep_gil else ctypes.CDLL(library)  # releases it
            record_fn = held.cuEventRecord
            query_fn = free.cuEventQuery
            elapsed_fn = free.cuEventElapsedTime
        except (OSError, AttributeError):
            return None
        record_fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        query_fn.argtypes = [ctypes.c_void_p]
        elapsed_fn.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]
        for fn in (record_fn, query_fn, elapsed_fn):
            fn.restype = ctypes.c_int

        def torch_record(event: Any, stream: Any) -> None:
            event.record(stream)

        name = "libcuda, reads keep the GIL" if reads_keep_gil else "libcuda"
        address = ctypes.cast(record_fn, ctypes.c_void_p).value or 0
        elapsed_address = ctypes.cast(elapsed_fn, ctypes.c_void_p).value or 0
        return cls(
            record_fn, query_fn, elapsed_fn, torch_record, name=name, record_addr=address,
            elapsed_addr=elapsed_address, reads_release_gil=not reads_keep_gil,
        )  # fmt: skip

    def self_test(
        self,
        event_cls: type,
        stream: Any,
        synchronize: Callable[[], None],
        spin: Callable[[], None] | None = None,
    ) -> str | None:
        """Check these calls against torch's on the device (start-up only: synchronises): two
        timing events recorded through :meth:`record` around ``spin`` (some device work) must
        read complete and give the same elapsed time as ``event_cls.elapsed_time``. Returns
        None when they agree, else why not."""
        try:
            a, b = event_cls(enable_timing=True), event_cls(enable_timing=True)
            for event in (a, b):  # created by torch (a first record), then recorded here
                event.record(stream)
            synchronize()
            self.record(a, stream)
            if spin is not None:
                spin()
            self.record(b, stream)
            synchronize()
            if not (self.query(a) and self.query(b)):
                return "cuEventQuery reports a completed event as not ready"
            mine, theirs = self.elapsed_ms(a, b), a.elapsed_time(b)
            if abs(mine - theirs) > 1e-3 or mine < 0:
                return f"cuEventElapsedTime {mine} ms, torch {theirs} ms"
            if self.elapsed_ms_many(a, [b, a]) != [mine, 0.0]:
                return "cuEventElapsedTime differs between calls"
        except Exception as exc:  # noqa: BLE001 -- any failure: fall back to torch's calls
            return f"{type(exc).__name__}: {exc}"
        return None


class StandInDriver(CudaDriver):
    """:class:`CudaDriver` over the handles of :class:`~instrument.device_events.StandInCudaEvent`
    and :class:`~instrument.device_events.StandInStream`: the same code path, no device (the
    elapsed time goes through a float32, as the driver's does). Counts its calls in ``calls``
    (``record``, ``query``, ``elapsed_time``; ``torch_record``: events recorded before they had a
    handle)."""

    def __init__(self) -> None:
        from instrument.device_events import STAND_IN_HANDLES as objects

        self.calls = {"record": 0, "query": 0, "elapsed_time": 0, "torch_record": 0}
        calls = self.calls

        def record_fn(handle: int, stream: int) -> int:
            calls["record"] += 1
            event = objects[handle]
            type(event).record(event, objects[stream])
            return CUDA_SUCCESS

        def query_fn(handle: int) -> int:
            calls["query"] += 1
            return CUDA_SUCCESS if objects[handle]._done() else CUDA_ERROR_NOT_READY

        def elapsed(start: int, end: int) -> float | None:
            calls["elapsed_time"] += 1
            a, b = objects[start], objects[end]
            if not (a._done() and b._done()):
                return None
            return (b.ns - a.ns) / 1e6

        def elapsed_fn(ms: Any, start: int, end: int) -> int:
            value = elapsed(start, end)
            if value is None:
                return CUDA_ERROR_NOT_READY
            ms._obj.value = value  # a float32, as cuEventElapsedTime writes
            return CUDA_SUCCESS

        def elapsed_c(ms: Any, start: int | None, end: int | None) -> int:
            value = elapsed(start or 0, end or 0)
            if value is None:
                return CUDA_ERROR_NOT_READY
            ms[0] = value  # through the float pointer the compiled loop passes
            return CUDA_SUCCESS

        def torch_record(event: Any, stream: Any) -> None:
            calls["torch_record"] += 1
            event.record(stream)

        # ``record_fn`` as a C function pointer too (a ctypes callback; handles arrive as ints,
        # 0 as None): the compiled stage core's direct call reaches the same stand-in.
        self._record_c = _RECORD_FN_TYPE(lambda handle, stream: record_fn(handle, stream or 0))
        self._elapsed_c = _ELAPSED_FN_TYPE(elapsed_c)
        super().__init__(
            record_fn, query_fn, elapsed_fn, torch_record, name="stand-in",
            record_addr=ctypes.cast(self._record_c, ctypes.c_void_p).value or 0,
            elapsed_addr=ctypes.cast(self._elapsed_c, ctypes.c_void_p).value or 0,
        )  # fmt: skip
