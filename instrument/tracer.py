"""The tracer: cheap spans on the hot path, Perfetto protobuf written off it.

The hot path appends plain tuples to a deque (thread-safe appends under the GIL); a background
thread drains the deque every ``flush_interval_s`` and streams packets to the file through
:class:`~instrument.perfetto_writer.PerfettoWriter`. A disabled tracer returns one shared no-op
span, so instrumented code costs about a method call when tracing is off.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import FrameType
from typing import Any, Literal, TypeVar

from instrument import native
from instrument import nvtx as _nvtx
from instrument.capture import STEP_REASONS, CaptureConfig, StepRule
from instrument.events import (
    EV_COUNTER,
    EV_COUNTERS,
    EV_INSTANT,
    EV_REQUEST,
    EV_SLICE_AT,
    EV_SPAN,
    RawEvent,
)
from instrument.perfetto_writer import PerfettoWriter
from instrument.schema import SCHEMA_VERSION, Arg, Instant
from instrument.writer_process import ProcessWriter

__all__ = ["Tracer", "get_tracer", "set_tracer", "traced", "now_ns"]

now_ns = time.monotonic_ns  # the one host clock of every trace
WRITERS = ("thread", "process")

# Each thread gets a small key for its whole life (idents are reused after a thread dies); the
# registry keeps the Thread object so its name is known at flush even once it has exited.
_tls = threading.local()
_THREADS: dict[int, threading.Thread] = {}
_thread_keys = itertools.count(1)


def _register_thread() -> int:
    key = next(_thread_keys)
    _THREADS[key] = threading.current_thread()
    _tls.key = key
    return key


def _thread_key() -> int:
    try:
        return _tls.key  # type: ignore[no-any-return]
    except AttributeError:
        return _register_thread()


F = TypeVar("F", bound=Callable[..., Any])
_NO_EVENT = object()  # the sentinel of the flush's C-level drain (never buffered)
_chain = itertools.chain.from_iterable


class _NullSpan:
    """The span a disabled tracer hands out: does nothing, allocates nothing."""

    __slots__ = ()

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        return False

    def set_args(self, **args: object) -> None:
        pass


_NULL_SPAN = _NullSpan()
_new_span = object.__new__


class _Span:
    """A live span: remembers its start; appends one complete-slice tuple when it ends.

    Each enabled tracer makes a subclass with its buffer's ``extend`` bound as a class attribute,
    so constructing a span sets only two fields.
    """

    __slots__ = ("_name", "_args", "_start_ns")
    _extend: Callable[[RawEvent], None]

    def __init__(self, name: str, args: dict[str, object]) -> None:
        self._name = name
        self._args = args

    # The clock and the thread-local are default arguments: local lookups on the hot path.
    def __enter__(self, _now: Callable[[], int] = time.monotonic_ns) -> _Span:
        self._start_ns = _now()
        return self

    def set_args(self, **args: object) -> None:
        """Add args known only inside the span (written when the span ends)."""
        self._args.update(args)

    def __exit__(
        self,
        exc_type: object,
        exc: object,
        tb: object,
        _now: Callable[[], int] = time.monotonic_ns,
        _local: threading.local = _tls,
    ) -> Literal[False]:
        # The slice built inline, no locals: this runs for every span, six per engine step.
        try:
            self._extend((EV_SLICE_AT, _local.key, self._name, self._start_ns, _now(), self._args))
        except AttributeError:  # the thread's first event: give it its key, then append
            _register_thread()
            self.__exit__(exc_type, exc, tb)
        return False


class _NvtxSpan(_Span):
    """A span that also pushes/pops an NVTX range of the same name."""

    __slots__ = ()
    _nvtx: _nvtx.NvtxRanges

    def __enter__(self, _now: Callable[[], int] = time.monotonic_ns) -> _Span:
        self._nvtx.push(self._name)
        self._start_ns = _now()
        return self

    def __exit__(self, *exc: object) -> Literal[False]:  # type: ignore[override]
        super().__exit__(*exc)  # type: ignore[arg-type]
        self._nvtx.pop()
        return False


class Tracer:
    """Records spans, instants, counters and flows into a Perfetto trace file.

    Args:
        path: output ``.pftrace`` file; ``None`` with ``enabled=False``.
        enabled: when False every call is a no-op and no file is written.
        nvtx: also push/pop NVTX ranges (domain ``stepscope``) around spans.
        flush_interval_s: how often the background thread writes buffered events.
        install_signal_handlers: flush on SIGTERM/SIGINT before the previous handler runs.
        capture: which steps reach the file (step range, sampling, size budget, ring, warm-up;
            see :mod:`instrument.capture`); default: every step. What it drops is counted in the
            closing ``trace_metadata``.
        writer: ``"thread"``: the flush thread encodes the protobuf itself (sharing the GIL with
            the engine); ``"process"``: it only hands raw batches to a child process that encodes
            and writes them (:mod:`instrument.writer_process`; what ``stepscope run`` uses).
        core: :meth:`span_end` compiled (``instrument/_stagecore.c``: the compiled stage core's
            module) or Python: ``auto``, ``c`` or ``python`` as ``DeviceTimeline``'s ``core``
            (None: ``instrument.native.DEFAULT_CORE``). Not with ``nvtx``. Which one:
            :attr:`span_core`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        enabled: bool = True,
        nvtx: bool = False,
        flush_interval_s: float = 0.5,
        install_signal_handlers: bool = False,
        capture: CaptureConfig | None = None,
        writer: str = "thread",
        core: str | None = None,
    ) -> None:
        if writer not in WRITERS:
            raise ValueError(f"writer must be one of {WRITERS}, got {writer!r}")
        if enabled and path is None:
            raise ValueError("an enabled Tracer needs an output path")
        if flush_interval_s <= 0:
            raise ValueError(f"flush_interval_s must be > 0, got {flush_interval_s}")
        self.enabled = enabled
        self.path = os.fspath(path) if path is not None else None
        # Flat: each event's kind then its fields (``instrument.events``; no tuple lives on in it).
        self._buffer: deque[Any] = deque()
        self._extend = self._buffer.extend
        self._nvtx = _nvtx.NvtxRanges() if (enabled and nvtx) else None
        self.span_core = "python"
        if self._nvtx is not None:  # the hot-path span calls push and pop the range too
            self.span_begin = self._span_begin_nvtx  # type: ignore[method-assign,assignment]
            self.span_end = self._span_end_nvtx  # type: ignore[method-assign,assignment]
        else:
            # The compiled span_end (instrument/native.py: the stage core's module), the same
            # event buffered; ``core`` as DeviceTimeline's (None: native.DEFAULT_CORE).
            compiled, _ = native.resolve(core)
            if compiled is not None:
                self.span_end = compiled.SpanEnd(  # type: ignore[method-assign]
                    self, self._extend, _tls, _register_thread, EV_SPAN
                )
                self.span_core = "c"
        base = _NvtxSpan if self._nvtx is not None else _Span
        self._span_cls: type[_Span] = type(
            "_TracerSpan",
            (base,),
            # A bound builtin is no descriptor: ``self._extend`` finds it as is (no staticmethod).
            {"__slots__": (), "_extend": self._extend, "_nvtx": self._nvtx},
        )
        self._writer: PerfettoWriter | ProcessWriter | None = None
        self._flusher: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        self._close_lock = threading.Lock()
        self._flush_interval_s = flush_interval_s
        self.dropped: dict[str, int] = {}
        self.flush_cpu_ns = 0  # the flush thread's CPU time in its flushes (thread_time_ns)
        # Set to a list (a bench, bench/_interleaved.py): each flush's (start, end)
        # ``perf_counter_ns``, for matching against the engine thread's steps.
        self.flush_log: list[tuple[int, int]] | None = None
        # Rules 1-3 of the capture config on the engine thread (``trace_step``); None: they keep
        # every step. ``paused``: recording is off only for a step they drop (``pause``).
        self.step_rule: StepRule | None = None
        self.paused = False
        self.skipped_steps: dict[str, int] = dict.fromkeys(STEP_REASONS, 0)
        self.skipped_instants = 0
        if not enabled:
            return
        assert self.path is not None
        self.capture = capture or CaptureConfig()
        rule = StepRule(self.capture)
        self.step_rule = rule if rule.drops_any else None
        if writer == "process":
            self._writer = ProcessWriter(self.path, capture=self.capture)
        else:
            self._writer = PerfettoWriter(self.path, capture=self.capture)
        self.metadata(
            **{Arg.SCHEMA_VERSION.value: SCHEMA_VERSION},
            **self.capture.describe(),
            pid=os.getpid(),
            host=socket.gethostname(),
            wall_time_ns=time.time_ns(),
            clock="monotonic",
        )
        self._flusher = threading.Thread(
            target=self._flush_loop, name="stepscope-flush", daemon=True
        )
        self._flusher.start()
        atexit.register(self.close)
        if install_signal_handlers:
            self._install_signal_handlers()

    # ---- hot path -------------------------------------------------------------------------
    def span(self, name: str, **args: object) -> _Span | _NullSpan:
        """A slice on the current thread's track, as a context manager.

        ``flow_out=ID`` starts a flow at this slice, ``flow_in=ID`` ends one here; every other
        keyword becomes a debug annotation.
        """
        if not self.enabled:
            return _NULL_SPAN
        span = _new_span(self._span_cls)  # no __init__ frame: five or more per engine step
        span._name, span._args = name, args
        return span

    # The engine's per-step phases: a span as two plain calls, ``start = tracer.span_begin(NAME)``
    # then ``tracer.span_end(NAME, start, step, args)`` (in a ``finally`` where a failing phase
    # should keep its slice). No context manager, no span object, no args dict for the step: a
    # third of a ``with tracer.span(...)`` block's cost (docs/design.md §4.9).
    def span_begin(self, name: str, _now: Callable[[], int] = time.monotonic_ns) -> int:
        """The start of a span :meth:`span_end` closes: the host clock now (with ``nvtx``, the
        range ``name`` is pushed too, traced or not: NVTX ranges stay balanced)."""
        return _now()

    def span_end(
        self,
        name: str,
        start_ns: int,
        step: int | None,
        args: Mapping[str, object] | None = None,
        _now: Callable[[], int] = time.monotonic_ns,
        _local: threading.local = _tls,
    ) -> None:
        """A slice ``name`` on this thread's track from ``start_ns`` (:meth:`span_begin`) to now,
        with args ``{step: step}`` (none when None) then ``args`` (a dict the tracer keeps and
        never changes: a constant one may be shared). Nothing while off (disabled, paused)."""
        if not self.enabled:
            return
        try:
            key = _local.key
        except AttributeError:  # the thread's first event
            key = _register_thread()
        self._extend((EV_SPAN, key, name, start_ns, _now(), step, args))

    def _span_begin_nvtx(self, name: str) -> int:
        assert self._nvtx is not None
        self._nvtx.push(name)
        return now_ns()

    def _span_end_nvtx(
        self, name: str, start_ns: int, step: int | None, args: Mapping[str, object] | None = None
    ) -> None:
        assert self._nvtx is not None
        Tracer.span_end(self, name, start_ns, step, args)
        self._nvtx.pop()

    def instant(self, name: str, *, scope: str = "thread", **args: object) -> None:
        """An instant event on the current thread's track, or the process track.

        While paused for a skipped step (:meth:`pause`), a thread instant (a ``sync`` hit) is
        counted (``skipped_instants``), not written; a process instant belongs to no step."""
        if not self.enabled:
            if not self.paused:
                return
            if scope == "thread":
                self.skipped_instants += 1
                return
        track = _thread_key() if scope == "thread" else None
        self._extend((EV_INSTANT, track, name, now_ns(), args or None))

    def counter(self, name: str, value: float) -> None:
        """One sample of a process-scoped counter."""
        if self.enabled:
            self._extend((EV_COUNTER, name, now_ns(), value))

    def slice_at(self, track: str, name: str, start_ns: int, end_ns: int, **args: object) -> None:
        """A slice with explicit times on a named track (device lanes, requests).

        ``flow_in``/``flow_out`` keywords join flows as in :meth:`span`.
        """
        if not self.enabled:
            return
        if end_ns < start_ns:
            raise ValueError(f"slice {name!r} ends before it starts ({start_ns} > {end_ns})")
        self._extend((EV_SLICE_AT, track, name, start_ns, end_ns, args))

    def slice_args(
        self, track: str, name: str, start_ns: int, end_ns: int, args: dict[str, object]
    ) -> None:
        """:meth:`slice_at` with the args as a dict the tracer may keep (no copy)."""
        if not self.enabled:
            return
        if end_ns < start_ns:
            raise ValueError(f"slice {name!r} ends before it starts ({start_ns} > {end_ns})")
        self._extend((EV_SLICE_AT, track, name, start_ns, end_ns, args))

    def append_slices(self, slices: list[RawEvent]) -> None:
        """Many complete slices in one call: ``EV_SLICE_AT`` or ``EV_STAGE`` tuples
        (``instrument.events``) with ``end_ns >= start_ns`` (the device timeline's batches),
        buffered flat.

        Written while the tracer is muted too (``muted``, or switched off mid-run): the stages
        were recorded while it was on; only a disabled or closed tracer drops them."""
        if self._writer is not None and not self._closed:
            self._extend(_chain(slices))  # their fields, flat (the tuples go with the list)

    def request_slices(
        self,
        req_id: str,
        arrival_ns: int,
        scheduled_ns: int,
        first_token_ns: int | None,
        finished_ns: int,
        num_output_tokens: int,
    ) -> None:
        """A finished request's ``queued`` / ``prefill`` / ``decode`` slices on its track, as one
        buffered tuple (expanded by the writer: ``instrument.events.expand_request``). Written
        while paused (:meth:`pause`) too: a request spans many steps (capture rules 1-3 never
        drop its track)."""
        if not (self.enabled or self.paused):
            return
        if not arrival_ns <= scheduled_ns <= finished_ns or (
            first_token_ns is not None and not scheduled_ns <= first_token_ns <= finished_ns
        ):
            raise ValueError(f"request {req_id!r}: times out of order")
        self._extend(
            (EV_REQUEST, req_id, arrival_ns, scheduled_ns, first_token_ns, finished_ns,
             num_output_tokens)
        )  # fmt: skip

    def counters(self, values: dict[str, float]) -> None:
        """One sample of each process-scoped counter in ``values``, all at one timestamp."""
        if self.enabled:
            ts, extend = now_ns(), self._extend
            for name, value in values.items():
                extend((EV_COUNTER, name, ts, value))

    def counter_values(self, names: tuple[str, ...], values: tuple[float, ...]) -> None:
        """One sample of each process-scoped counter ``names[i]`` = ``values[i]``, all at one
        timestamp, buffered as one tuple (the writer expands it; the same trace as
        :meth:`counters`, one append instead of one per counter)."""
        if self.enabled:
            self._extend((EV_COUNTERS, names, now_ns(), values))

    def thread_slice(self, name: str, start_ns: int, end_ns: int, **args: object) -> None:
        """A slice with explicit times on the current thread's track (like a finished span)."""
        if not self.enabled:
            return
        if end_ns < start_ns:
            raise ValueError(f"slice {name!r} ends before it starts ({start_ns} > {end_ns})")
        self._extend((EV_SLICE_AT, _thread_key(), name, start_ns, end_ns, args))

    # ---- steps dropped on the engine thread -------------------------------------------------
    @property
    def can_skip_steps(self) -> bool:
        """True when capture rules 1-3 (warm-up, step range, sampling) drop some step: an engine
        may then ask :meth:`trace_step` once per step and skip the steps they drop."""
        return self.step_rule is not None

    def trace_step(self, step: int) -> bool:
        """Whether to trace ``step``: capture rules 1-3 (``instrument.capture.StepRule``),
        evaluated once per step on the engine thread, in step order, as it is about to be
        scheduled. False: the step is dropped; it is counted here (``skipped_steps``, written at
        close as ``engine_skipped_steps_<reason>`` and in ``dropped_steps_<reason>``) and the
        engine pauses the tracer (:meth:`pause`) around each of the step's phases, so it records
        none of its events. True while the tracer is off (nothing of the step would be traced).

        Once the rules can drop no later step (a full trace past its warm-up steps), the rule is
        let go: :attr:`can_skip_steps` turns False and the engine stops asking."""
        rule = self.step_rule
        if rule is None or not (self.enabled or self.paused):
            return True
        reason = rule.reason(step)
        if reason is None:
            if rule.settled:
                self.step_rule = None
            return True
        self.skipped_steps[reason] += 1
        return False

    def pause(self) -> None:
        """Record nothing until :meth:`resume`: the engine thread, around a phase of a step
        :meth:`trace_step` dropped. Every hot-path entry point is then the disabled tracer's
        no-op, except request tracks and process instants (no step's) and the device timeline's
        batches of stages recorded earlier (``append_slices``). No-op while off."""
        if self.enabled:
            self.enabled = False
            self.paused = True

    def resume(self) -> None:
        """Undo :meth:`pause` (no-op unless paused; a tracer closed meanwhile stays off)."""
        if self.paused:
            self.paused = False
            self.enabled = not self._closed

    # ---- metadata -------------------------------------------------------------------------
    def metadata(self, **args: object) -> None:
        """A ``trace_metadata`` instant on the process track."""
        self.instant(Instant.TRACE_METADATA.value, scope="process", **args)

    def count_dropped(self, what: str, n: int = 1) -> None:
        """Count events deliberately not recorded; written to the metadata at close."""
        self.dropped[what] = self.dropped.get(what, 0) + n

    @staticmethod
    def _thread_names() -> dict[int, tuple[str, int]]:
        """Name and native id of every thread that recorded an event (a thread registers before
        its first event is buffered): a handful, whatever the batch's size, so the flush thread
        does no per-event Python (it holds the GIL the engine thread needs: docs/design.md
        §4.3). The writer describes a thread's track the first time an event names it."""
        return {
            key: (thread.name, thread.native_id or key) for key, thread in list(_THREADS.items())
        }

    def flush(self) -> None:
        """Write everything buffered so far (to the file, once this returns)."""
        self._flush_once()
        if isinstance(self._writer, ProcessWriter):
            self._writer.sync()

    def _flush_once(self) -> None:
        """Hand everything buffered so far to the writer."""
        if self._writer is None:
            return
        buffer = self._buffer
        n = len(buffer)
        if not n:
            return
        # The n oldest items, popped in C-level loops (no bytecode: no GIL switch inside, ~20 ns
        # an item); only this thread pops, so n are there. Appends may go on meanwhile. The
        # process writer pops them a part at a time, its pipe writes releasing the GIL between
        # parts: the engine thread waits for one part at most (docs/design.md §4.9).
        taken = iter(buffer.popleft, _NO_EVENT)
        writer = self._writer
        if isinstance(writer, ProcessWriter):
            writer.write_taken(taken, n, self._thread_names())
        else:
            writer.write_flat(list(itertools.islice(taken, n)), self._thread_names())

    def _flush_loop(self) -> None:
        while not self._stop.wait(self._flush_interval_s):
            cpu_ns = time.thread_time_ns()
            busy_log, start_ns = self.flush_log, time.perf_counter_ns()
            self._flush_once()
            self.flush_cpu_ns += time.thread_time_ns() - cpu_ns
            if busy_log is not None:
                busy_log.append((start_ns, time.perf_counter_ns()))

    @contextmanager
    def muted(self) -> Iterator[None]:
        """Record nothing inside (start-up work such as the engine's warm-up, which is not part
        of any step); recording resumes after, unless the tracer was closed meanwhile."""
        was = self.enabled
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = was and not self._closed

    def close(self, blocking: bool = True) -> None:
        """Flush, record dropped counts, close the file. Idempotent.

        ``blocking=False`` (from a signal handler): return at once if a close is under way."""
        if not self._close_lock.acquire(blocking=blocking):
            return
        try:
            self._close_locked()
        finally:
            self._close_lock.release()

    def _close_locked(self) -> None:
        if self._closed or self._writer is None:
            self._closed = True
            self.paused = False
            return
        self._closed = True
        self._stop.set()
        if self._flusher is not None and self._flusher is not threading.current_thread():
            self._flusher.join(timeout=5.0)
        self._flush_once()
        self.enabled = self.paused = False
        skipped = {k: v for k, v in self.skipped_steps.items() if v}
        self._writer.finish(dict(self.dropped), now_ns(), skipped, self.skipped_instants)
        atexit.unregister(self.close)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(signum)
            if previous == signal.SIG_IGN:  # ignored by the parent (nohup, `cmd &`): the run
                continue  # goes on, so the trace must not be closed under it

            def handler(num: int, frame: FrameType | None, previous: Any = previous) -> None:
                self.close()
                if callable(previous):
                    previous(num, frame)
                elif previous == signal.SIG_DFL:
                    signal.signal(num, signal.SIG_DFL)
                    os.kill(os.getpid(), num)

            signal.signal(signum, handler)

    def __enter__(self) -> Tracer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_DISABLED = Tracer(enabled=False)
_current: Tracer = _DISABLED


def get_tracer() -> Tracer:
    """The process-global tracer (a disabled one unless :func:`set_tracer` was called)."""
    return _current


def set_tracer(tracer: Tracer | None) -> Tracer:
    """Install ``tracer`` as the process-global tracer (None restores the disabled one)."""
    global _current
    previous = _current
    _current = tracer if tracer is not None else _DISABLED
    return previous


def traced(name: str | None = None, **static_args: object) -> Callable[[F], F]:
    """Decorator: run the function inside a span of the global tracer."""

    def wrap(fn: F) -> F:
        span_name = name or fn.__name__

        @functools.wraps(fn)
        def inner(*a: Any, **kw: Any) -> Any:
            with _current.span(span_name, **static_args):
                return fn(*a, **kw)

        return inner  # type: ignore[return-value]

    return wrap
