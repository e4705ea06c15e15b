"""Device slices from timed events recorded on a stream around each device stage.

The CPU records an event before and after enqueueing a stage (:meth:`DeviceTimeline.stage`);
later, non-blocking queries find the stages that have completed and turn them into slices on
``gpu:<i> compute`` / ``copy`` tracks. Nothing here synchronises on the hot path.

What the engine thread pays per stage is kept small (docs/design.md §4.3):

* a call site that opens a stage every step makes a :class:`StageSite` once (name, lane, stream,
  the stream's queue, constant args): a stage stores its step, begin and own args only, and its
  exit appends it to the site's queue without a lookup; the poll builds each slice's args;
* events are pooled (an emitted stage's events are recorded again by later stages) and a
  ``contiguous`` stage begins at the previous stage's end event (one record fewer);
* polls are batched and placed where they cost nothing: :meth:`DeviceTimeline.poll_while_waiting`
  runs at the engine's one consumption point, just before it blocks on a step's output, and only
  while the device is still busy with it (then the host would have waited anyway) and once
  ``poll_batch`` stages are pending; :meth:`DeviceTimeline.poll_if_due`, the once-per-step hook on
  the hot path, acts only past ``max_deferred`` pending stages (an engine that never waits). With
  ``background`` both only wake the poller thread, which emits ``POLL_CHUNK`` stages per stretch
  of holding the GIL, while the engine blocks. When the engine's last wait found its output
  already there (the host is the bottleneck: it never blocks), ``poll_if_due`` polls on the
  engine thread instead: a poller would only take the GIL from it, and each handoff costs the
  engine more than the poll (on the H200, tracing a host-bound run added a median +163 µs of
  engine CPU a step with the poller, +19 µs without it; bench/README.md, session 9);
* a poll queries each stream's pending stages newest first, then galloping back (events on one
  stream complete in stream order, so one completed event vouches for every earlier one),
  converts the completed ones to host times in one pass and hands their slices to the tracer in
  one call.
* with ``begins="derived"`` a stage that is not contiguous records no begin event at all: it
  stamps the host time when its enqueue begins, and the poll places its begin at the latest of
  that time, the end of the slice before it on its stream and the end of the stage its stream was
  made to wait for (``after``): a lower bound of when the stream reached it, normally a few µs
  early (the device's reaction latency). Three records fewer per plain decode step (issue 15).
  The first stage on each stream, and the first after untraced work (which no slice covers),
  still records its begin.

Events are made, recorded, queried and read through an :class:`~instrument.device_events.EventOps`
(``CudaClock`` on CUDA; any factory of ``TimedEvent`` objects otherwise).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import MethodType
from typing import Any, Literal

from instrument import native
from instrument.cuda_driver import CudaDriverError
from instrument.device_events import (
    CudaClock,
    CudaTimedEvent,
    EventOps,
    TimedEvent,
    as_ops,
)
from instrument.events import EV_SLICE_AT, EV_STAGE, RawEvent, expand_stage
from instrument.graph_stamps import StampEvent
from instrument.schema import (
    DEVICE_COMPUTE,
    DEVICE_LANES,
    Arg,
    DeviceBegins,
    device_track_name,
)
from instrument.tracer import Tracer, now_ns

__all__ = [
    "TimedEvent",
    "DeviceTimeline",
    "StageSite",
    "CudaClock",
    "CudaTimedEvent",
    "PendingStage",
    "POLL_BATCH",
    "MAX_DEFERRED",
    "POLL_CHUNK",
    "WAIT_CHUNK",
    "POLL_SECTIONS",
    "BEGINS",
]

# Pending stages before the engine's wait polls: ~25 engine steps of 5 stages. 128, not 64:
# alternated 3 times on one H200, the poller's CPU per traced step fell in every pair (median
# 70.9 -> 64.1 us; half the end-event queries a stage) and so did the process's added CPU
# (bench/README.md session 18).
POLL_BATCH = 128
MAX_DEFERRED = 256  # pending stages before the hot-path hook polls anyway (background: wakes)
# Stages the poller thread emits per stretch before it sleeps (hands the GIL over). 256, not 16:
# alternated 5 times on H200s, the poller's CPU per traced step fell in every pair (median 71 ->
# 57 us) with the step wall unchanged; each stretch's lock, queries and sleep cost ~50 us
# (bench/README.md session 16). The price, a longer GIL hold while a stretch's slices are
# emitted, is paid where the engine waits for the device (host-bound: the engine polls inline).
POLL_CHUNK = 256
# ``in_wait`` polls: stages the engine thread emits between two checks of the output it is about
# to wait for. Once that output is ready the engine stops polling, so a step's launch is late by
# at most one chunk's emission (~30 stages x ~6 us on the H200; the chunk's wall is counted as
# ``wait_poll_overrun_ns``, an upper bound of that delay).
WAIT_CHUNK = 32
# DeviceTimeline.poll_sections_ns: thread CPU ns in the queries (finding the completed stages),
# the conversions to host times, building the slices, handing them to the tracer; then how many
# stages, events and end-event queries those covered.
POLL_SECTIONS = ("query", "convert", "build", "hand", "stages", "events", "queries")
_QUERY, _CONVERT, _BUILD, _HAND, _STAGES, _EVENTS, _QUERIES = range(len(POLL_SECTIONS))
# With the compiled core: a poll builds its slices in C too (``_stagecore.emit_stages``, the
# same loop as ``DeviceTimeline._build_slices``). On by default since session 20's H200 A/B (the
# poller's build 1.5-1.9 -> 0.6-0.8 us a stage, docs/design.md §4.3); STEPSCOPE_COMPILED_EMIT=0
# (or ``timeline.compiled_emit = False``) keeps the Python loop.
COMPILED_EMIT = os.environ.get("STEPSCOPE_COMPILED_EMIT", "1") != "0"
ANCHOR_EVERY_S = 0.2  # an idle poller lets the clock refresh its reference this often
POLL_YIELD_S = 50e-6  # the poller's sleep between chunks: hands the GIL to a waiting engine thread
# How a stage that is not contiguous gets its begin (docs/design.md §4.3): its own begin event
# (``recorded``), the lower bound of the times the timeline already has (``derived``), or both
# (the recorded begin, the derived one as the ``derived_begin_ns`` arg: to measure the bound).
BEGINS = tuple(b.value for b in DeviceBegins)


@dataclass(slots=True)
class PendingStage:
    """A stage whose end event has not completed yet (for callers that record events
    themselves: :meth:`DeviceTimeline.add`)."""

    name: str
    lane: str
    step: int
    begin: TimedEvent
    end: TimedEvent
    args: dict[str, object]
    host_end_ns: int  # host clock when ``end.record`` returned: the CPU finished enqueueing
    end_shared: bool = False
    lent: bool = False
    emitted: bool = False


_STEP = Arg.STEP.value
_HOST_END_NS = Arg.HOST_END_NS.value
_DERIVED_BEGIN_NS = Arg.DERIVED_BEGIN_NS.value
_NO_EVENT = object()  # no event is this: "no previous end" in a poll's pass over its stages


class _NullScope:
    """The stage scope of a disabled timeline: does nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> Literal[False]:
        return False


_NULL_SCOPE = _NullScope()
_new_scope = object.__new__


class _StreamQueue:
    """One stream's pending stages, oldest first (they complete in this order); ``end_ns``: the
    end of the newest slice emitted on the stream (-1: none yet; kept only for derived begins);
    ``known``: derived begins, every stage on the stream since the last untraced work is traced
    (:meth:`DeviceTimeline._bounded`)."""

    __slots__ = ("stream", "stages", "end_ns", "known")

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.stages: deque[Any] = deque()
        self.end_ns = -1
        self.known = False


class StageSite:
    """What every stage of one call site shares, decided once (:meth:`DeviceTimeline.site`):
    its name, lane, stream (with the stream's queue) and constant args. A stage then stores only
    what differs per call (docs/design.md §4.3): the runner opens five per decode step."""

    __slots__ = ("timeline", "name", "lane", "stream", "args", "queue", "stages", "track")

    def __init__(
        self, timeline: DeviceTimeline, name: str, lane: str, stream: Any, args: dict[str, object]
    ) -> None:
        self.timeline = timeline
        self.name = name
        self.lane = lane
        self.stream = stream
        self.args = args  # shared by its stages: never mutated (a slice's args are a new dict)
        self.queue = timeline._queue_of(stream)
        self.stages = self.queue.stages  # the stream's pending stages (the exit appends here)
        self.track: Any = None  # its slices' track, set by the first poll that emits one

    # stepscope: hot
    def stage(
        self,
        step: int,
        after: Any = None,
        contiguous: bool = False,
        args: dict[str, object] | None = None,
        end: Any = None,
    ) -> _StageScope | _NullScope:
        """:meth:`DeviceTimeline.stage` for this site: ``args`` (None: none) are this stage's
        args besides the site's (a dict the timeline keeps). ``end``: the stage's end is not
        recorded at exit but is this :class:`~instrument.graph_stamps.StampEvent` (a stamp the
        device writes itself, :meth:`DeviceTimeline.use_stamps`)."""
        timeline = self.timeline
        if not timeline.tracer.enabled:
            # Untraced work is enqueued now: the next traced stage cannot begin at the last
            # traced stage's end (tracing switched off and on again mid-run: Tracer.muted).
            if timeline._last is not None:  # the first untraced stage after traced ones
                timeline._untraced_gap()
            timeline._last = None
            return _NULL_SCOPE
        last = timeline._last
        if contiguous and last is not None and last.site.stream is self.stream and not last.lent:
            # The stream reaches this stage's begin when it reaches the last stage's end.
            last.end_shared = True
            if end is not None and last.end_given is not None:
                # This stage is a stamped replay and the last one ends at its begin stamp, which
                # the device reaches only once the host has enqueued this stage: the last
                # stage's host end is now (its CPU lead, §5.14.1). A stage after a stamped one
                # (sample after the forward) leaves it: that stamp was enqueued with the replay.
                last.host_end_ns = now_ns()
            scope = _new_scope(_StageScope)  # no __init__ frame: this runs 5+ times per step
            scope.site, scope.step, scope.args, scope.begin = self, step, args, last.end
            if end is not None:
                scope.end_given = end
            return scope
        if timeline._derive and (
            (last is not None and self.queue.known)  # the steady state
            or timeline._bounded(self.queue, last)  # else recorded, in ``both`` too (no arg)
        ):
            scope = _new_scope(_DerivedScope)
            scope.host_begin_ns = now_ns()  # before a begin record: never after the recorded one
            scope.site, scope.step, scope.args, scope.after = self, step, args, after
            if end is not None:
                scope.end_given = end
            if not timeline._record_begins:
                scope.begin = None  # derived at emit
                return scope
        else:
            scope = _new_scope(_StageScope)
            scope.site, scope.step, scope.args = self, step, args
            if end is not None:
                scope.end_given = end
        try:
            begin = timeline._pop_free()
        except IndexError:  # the pool is empty
            begin = timeline._new()
        scope.begin = begin
        timeline._record(begin, self.stream)
        return scope


class _StageScope:
    """One stage: :meth:`StageSite.stage` records its begin event; on exit it records the end
    event (and the host time) and queues itself as its stream's newest pending stage (it is its
    own pending record). ``with timeline.stage(...) as s`` binds it (None when not traced), for a
    later stage's ``after``."""

    __slots__ = ("site", "step", "args", "begin", "end", "host_end_ns", "end_ns", "__dict__")
    site: StageSite
    step: int
    args: dict[str, object] | None  # besides the site's
    begin: Any  # None: derived at emit
    end: Any
    host_end_ns: int
    end_ns: int  # unset until the poll emits it: its slice's end; -1: dropped (no slice)
    # Class defaults until a stage sets its own (in its ``__dict__``): two stores per stage
    # fewer on the engine thread, for flags most stages never set.
    end_shared = False  # a contiguous successor begins at this stage's end event
    lent = False  # the end event was handed to the caller (event_after_stage)
    end_given: Any = None  # a graph stamp the device writes: the end, not recorded at exit

    @property
    def emitted(self) -> bool:
        """Its slice was emitted (the poll set ``end_ns``; a dropped stage's is -1)."""
        return getattr(self, "end_ns", -1) >= 0

    @property
    def name(self) -> str:
        return self.site.name

    @property
    def lane(self) -> str:
        return self.site.lane

    @property
    def stream(self) -> Any:
        return self.site.stream

    def __enter__(self) -> _StageScope:
        return self

    def __exit__(
        self, exc_type: object, exc: object, tb: object, _now: Callable[[], int] = now_ns
    ) -> Literal[False]:
        if exc_type is not None:  # the stage was not enqueued whole: no slice
            return False
        site = self.site
        timeline = site.timeline
        end = self.end_given
        if end is None:
            try:
                end = timeline._pop_free()
            except IndexError:  # the pool is empty
                end = timeline._new()
            timeline._record(end, site.stream)
        self.end = end
        # CPU lead = (when the stream reached ``end``) - (when the host recorded it): docs/design.md.
        self.host_end_ns = _now()
        timeline._last = self
        site.stages.append(self)
        recorded = timeline.num_recorded = timeline.num_recorded + 1
        if recorded > timeline._drop_above:  # more than ``max_pending`` pending
            timeline._drop_oldest(site.queue)
        return False


class _DerivedScope(_StageScope):
    """A stage that is not contiguous, of a timeline that derives begins: it records no begin
    event (``begin`` None) unless ``both``; the poll derives its begin from ``host_begin_ns``,
    the end of the slice before it on its stream and ``after``'s end (docs/design.md §4.3).
    ``after`` is dropped once the stage is emitted (or dropped): no chain of earlier stages."""

    __slots__ = ("host_begin_ns", "after", "__weakref__")
    host_begin_ns: int  # host clock when the stage's enqueue began (stage() entry)
    after: Any  # the stage whose end the stream was made to wait for just before; or None


# The stage classes of both cores (the compiled one's when it is built: instrument/native.py).
_SCOPE_TYPES: tuple[type, ...] = (_StageScope,)
_DERIVED_TYPES: tuple[type, ...] = (_DerivedScope,)
_compiled, _ = native.load()
if _compiled is not None:
    _SCOPE_TYPES += (_compiled.Scope,)
    _DERIVED_TYPES += (_compiled.DerivedScope,)
    _compiled.set_null_scope(_NULL_SCOPE)


def _forget(stage: Any) -> None:
    """A stage that will have no slice (dropped, or still pending at the end): a stage that
    waited for it derives its begin from its other terms, and it keeps no earlier stage."""
    if isinstance(stage, _SCOPE_TYPES):  # either core's stage classes
        setattr(stage, "end_ns", -1)  # noqa: B010 -- isinstance of a tuple narrows to object
        if isinstance(stage, _DERIVED_TYPES):
            setattr(stage, "after", None)  # noqa: B010


class DeviceTimeline:
    """Records event pairs around device stages and emits them as device-track slices.

    Args:
        tracer: where slices go; with a disabled tracer, :meth:`stage` records nothing.
        device_index: the ``<i>`` of ``gpu:<i>`` track names.
        event_factory: an :class:`~instrument.device_events.EventOps` (``CudaClock``), or a
            factory of fresh :class:`TimedEvent` objects.
        max_pending: stages kept waiting before the oldest of a stream is dropped (and counted
            as ``dropped_device_slices``).
        poll_batch: pending stages at which :meth:`poll_while_waiting` polls.
        max_deferred: pending stages at which :meth:`poll_if_due` polls.
        background: :meth:`poll_while_waiting` wakes a poller thread instead of polling on the
            calling (engine) thread; see :meth:`poll_while_waiting`.
        inline_when_host_bound: with ``background``, :meth:`poll_if_due` polls on the calling
            thread when the engine's last wait found its output ready (see :meth:`poll_if_due`);
            False: it always wakes the poller (the earlier behaviour, kept for A/B benches).
        begins: ``recorded`` (a begin event per stage that is not contiguous), ``derived`` (no
            begin event: the poll derives a lower bound, see :meth:`stage`'s ``after``) or
            ``both`` (the recorded begin, plus the derived one as the slice's
            ``derived_begin_ns`` arg; to measure the bound).
            Not ``recorded``: written into the trace's metadata as ``device_begins``.
        in_wait: :meth:`poll_while_waiting` polls on the calling (engine) thread, in chunks of
            ``WAIT_CHUNK`` stages, only while the output it is about to wait for is not ready
            (time the engine would spend blocked); ``background`` is then not used for it.
        core: where the stages' hot path runs (``instrument.native.CORES``): ``auto`` (the
            compiled stage core when it is built and current, else the Python classes), ``c``
            (the compiled one, or an error saying why not), ``python``; None: ``native.DEFAULT_CORE``
            (the ``STEPSCOPE_STAGE_CORE`` environment variable, else ``auto``). Which one ran,
            and why not the compiled one, is :attr:`core` and :attr:`core_reason`, and goes
            into the trace's metadata (``stage_core``). docs/design.md §4.3.
    """

    def __new__(cls, *args: Any, core: str | None = None, **kwargs: Any) -> DeviceTimeline:
        # The compiled core keeps the hot state in a C object: a subclass reads it there.
        module, _ = native.resolve(core)
        if cls is DeviceTimeline and module is not None:
            cls = _CompiledTimeline
        return object.__new__(cls)

    def __init__(
        self,
        tracer: Tracer,
        device_index: int,
        event_factory: EventOps | Callable[[], TimedEvent],
        max_pending: int = 4096,
        poll_batch: int = POLL_BATCH,
        max_deferred: int = MAX_DEFERRED,
        background: bool = False,
        inline_when_host_bound: bool = True,
        begins: str = DeviceBegins.RECORDED.value,
        in_wait: bool = False,
        core: str | None = None,
    ) -> None:
        module, reason = native.resolve(core)
        if not isinstance(self, _CompiledTimeline):
            module = None
        elif module is None:  # an instance __new__ made compiled, re-initialised with python
            raise ValueError("a compiled timeline cannot be re-initialised with the Python core")
        self._stage_core = module
        self.compiled_emit = COMPILED_EMIT and module is not None  # polls build slices in C
        self.core = "c" if module is not None else "python"
        self.core_reason = reason  # why not the compiled core ("" when it is used)
        if module is not None:
            self._core = module.Core()  # before any attribute the subclass keeps in it
        if begins not in BEGINS:
            raise ValueError(f"begins must be one of {BEGINS}, got {begins!r}")
        if not 1 <= poll_batch <= max_deferred <= max_pending:
            raise ValueError(
                "need 1 <= poll_batch <= max_deferred <= max_pending, got "
                f"{poll_batch}, {max_deferred}, {max_pending}"
            )
        self.tracer = tracer
        self.device_index = device_index
        self.ops = as_ops(event_factory)
        # The compiled core calls the driver's cuEventRecord itself where the ops have one.
        self._record_addr = int(getattr(getattr(self.ops, "driver", None), "record_addr", 0))
        self._new, self._record, self._query = self.ops.new, self.ops.record, self.ops.query
        self._host_ns_many = self.ops.host_ns_many
        self._max_pending = max_pending
        self.poll_batch = poll_batch
        self.max_deferred = max_deferred
        # (poll_batch, max_deferred) while an untraced gap has lowered them (_untraced_gap)
        self._thresholds: tuple[int, int] | None = None
        # Background: the engine thread polls inline only this far behind (the poller is stuck).
        self._inline_limit = max(max_deferred, max_pending // 2)
        self.inline_when_host_bound = inline_when_host_bound
        self._output_was_ready = False  # the engine's last wait found its output ready
        self._queues: dict[int, _StreamQueue] = {}  # by id(stream); the stream is kept too
        self._unordered: list[Any] = []  # stages queued through add(): no stream order known
        # Pending = recorded - emitted - dropped. Each count has one writer at a time: recorded the
        # engine thread, emitted and dropped whoever holds ``_lock`` (a poll may run on the poller
        # thread while the engine thread records).
        self.num_recorded = 0  # stages queued (recorded whole, or through add())
        self.num_emitted = 0
        self.num_dropped = 0
        # A stage's exit drops the oldest pending one once ``num_recorded`` passes this
        # (= emitted + dropped + max_pending; kept by whoever changes those two counts).
        self._drop_above = max_pending
        self._lock = threading.Lock()  # one poll at a time; a drop or add() waits for it
        self.background = background
        self.in_wait = in_wait
        # ``in_wait`` polls: how many ran, their thread CPU and wall (a bench reads them), and the
        # wall of the last chunk of each that stopped because the output had become ready (the
        # most that poll can have delayed the engine past its output: an upper bound).
        self.polls_in_wait = 0
        self.wait_poll_cpu_ns = 0
        self.wait_poll_wall_ns = 0
        self.wait_poll_overrun_ns = 0
        # Where due polls ran (bench/bench_trace_overhead.py prints them): on the engine thread,
        # or handed to the poller thread.
        self.polls_inline = 0
        self.polls_woken = 0
        self.poller_cpu_ns = 0  # the poller thread's CPU time in its polls (thread_time_ns)
        # ... and their wall time: above the CPU time by its waits for the GIL (and the sleeps
        # between stretches, only when a wake-up finds over POLL_CHUNK stages done).
        self.poller_wall_ns = 0
        # Set to a list of POLL_SECTIONS zeros (a bench, bench/bench_trace_overhead.py): every
        # poll adds its thread CPU ns per section to it (a few clock reads per poll, not per stage).
        self.poll_sections_ns: list[int] | None = None
        # Set to a list (a bench, bench/_interleaved.py): the poller thread appends each wake-up's
        # (start, end) ``perf_counter_ns``, the interval it worked in, for matching against the
        # engine thread's steps.
        self.busy_log: list[tuple[int, int]] | None = None
        self._poller: threading.Thread | None = None
        self._kick = threading.Lock()  # held while the poller is idle; released: poll once
        self._stopping = False
        self.poller_error: BaseException | None = None  # raised on the engine thread at drain
        # Events of emitted stages, recorded again by later stages (no create/destroy per stage).
        self._free: list[Any] = []
        self._pop_free = self._free.pop  # the stages' one call per event (IndexError: empty)
        self._last: Any = None  # the stage recorded last (for ``contiguous``)
        self._held: Any = None  # an emitted stage whose end the next stage may still share
        # Emitted ends a later stage begins (or may begin) at, by id(event): that stage starts at
        # exactly this time, whatever poll emits it (two conversions of one event may differ by a
        # nanosecond once the clock moved its reference, and abutting slices must not overlap).
        self._end_ns: dict[int, int] = {}
        # Lent end events by id (-> their stage), and those the caller gave back (give_back: the
        # engine thread appends, the poll takes them back into the pool).
        self._lent: dict[int, Any] = {}
        self._returned: deque[Any] = deque()
        # Untraced, the caller's sync events are recorded again rather than made per call: one
        # per stream for ``wait_only`` (a stream wait takes the event's state when enqueued), and
        # the others once given back (engine thread only: no lock).
        self._sync_events: dict[int, Any] = {}
        self._spare: list[Any] = []
        self._lane_tracks = {lane: device_track_name(device_index, lane) for lane in DEVICE_LANES}
        # A track per (lane, stream): the copy lane's h2d and d2h streams run at once, and two
        # slices that overlap on one track would pair their begin and end packets wrongly. The
        # lane's first stream writes to ``gpu:<i> <lane>``, the n-th further one to a track of the
        # same name (the writer's ``(name, n)``); docs/design.md §4.3.
        self._stream_tracks: dict[tuple[str, int], Any] = {}
        # Told (lane, name, step, start_ns, end_ns) of every slice emitted (a kernel window).
        self.observer: Callable[[str, str, int, int, int], None] | None = None
        self.begins = begins
        self._derive = begins != DeviceBegins.RECORDED.value  # stamp and derive begins
        self._record_begins = begins != DeviceBegins.DERIVED.value  # record begin events
        if self._derive:  # a recorded-begins trace stays as it was (absent: recorded)
            tracer.metadata(**{Arg.DEVICE_BEGINS.value: begins})
        if isinstance(self, _CompiledTimeline):
            self._fill_core()
        tracer.metadata(**{Arg.STAGE_CORE.value: self.core + (f" ({reason})" if reason else "")})

    @property
    def enabled(self) -> bool:
        return self.tracer.enabled

    def use_stamps(self, stamps: Any) -> None:
        """Some stages end at graph stamps (``StageSite.stage(end=...)``,
        :mod:`instrument.graph_stamps`): the device writes those times itself, so they are
        queried and converted through ``stamps``, never recorded nor pooled. Written into the
        trace's metadata as ``graph_stamps`` with the clock offset's calibration error."""
        query, convert = self.ops.query, self.ops.host_ns_many

        def query_any(event: Any) -> bool:
            if type(event) is StampEvent:
                return event.done()
            return bool(query(event))

        def host_ns_many(events: Sequence[Any]) -> list[int]:
            if not any(type(e) is StampEvent for e in events):
                return convert(events)
            real = [e for e in events if type(e) is not StampEvent]
            times = iter(convert(real) if real else ())
            return [e.host_ns() if type(e) is StampEvent else next(times) for e in events]

        self._query = query_any
        self._host_ns_many = host_ns_many
        self.tracer.metadata(
            **{
                Arg.GRAPH_STAMPS.value: "globaltimer" if stamps.on_device else "host",
                Arg.GRAPH_STAMP_ERROR_NS.value: stamps.offset_error_ns,
            }
        )

    @property
    def num_pending(self) -> int:
        """Stages recorded and neither emitted nor dropped yet."""
        return self.num_recorded - self.num_emitted - self.num_dropped

    def site(
        self, name: str, *, lane: str = DEVICE_COMPUTE, stream: Any = None, **args: object
    ) -> StageSite:
        """The shared part of the stages one call site opens (the runner makes one per site at
        start-up): ``site.stage(step, after, contiguous, args)`` is :meth:`stage` with this
        ``name``, ``lane``, ``stream`` (None: the ops' default stream, taken now) and constant
        ``args``, decided once instead of at every stage."""
        if stream is None:
            stream = self.ops.default_stream()
        if self._stage_core is not None:
            return self._stage_core.Site(  # type: ignore[no-any-return]
                self._core, self, name, lane, stream, args, self._queue_of(stream)
            )
        return StageSite(self, name, lane, stream, args)

    def stage(
        self,
        name: str,
        *,
        step: int,
        lane: str = DEVICE_COMPUTE,
        stream: Any = None,
        contiguous: bool = False,
        after: Any = None,
        **args: object,
    ) -> _StageScope | _NullScope:
        """Bracket the enqueue of one device stage with a begin and an end event: the begin is
        recorded here, the end when the returned context manager exits (use it as ``with
        timeline.stage(...) as s:`` around the enqueue; a shared no-op one, binding None, when
        tracing is off). ``stream``: where the stage's work is enqueued (required on CUDA).

        ``contiguous``: the caller enqueued nothing on ``stream`` since the previous stage of this
        timeline ended on it, so this stage begins at that stage's end event (one event fewer);
        ignored when the previous stage ran on another stream.

        ``after``: the stage (what ``with timeline.stage(...) as s`` bound; None: none) whose end
        ``stream`` was last made to wait for (``event_after_stage``'s event, or one recorded
        right after that stage on its stream) before this stage. Only read with derived begins:
        the stream cannot begin this stage before that stage ended (docs/design.md §4.3).

        A call site that opens a stage per step uses a :meth:`site` instead (the same stages,
        less work per call).
        """
        if not self.tracer.enabled:
            if self._last is not None:  # as StageSite.stage: untraced work is enqueued now
                self._untraced_gap()
            self._last = None
            return _NULL_SCOPE
        site = self.site(name, lane=lane, stream=stream)
        return site.stage(step, after, contiguous, args)

    def _queue_of(self, stream: Any) -> _StreamQueue:
        """The pending queue of ``stream`` (made on first use)."""
        queue = self._queues.get(id(stream))
        if queue is None or queue.stream is not stream:  # an id reused after a stream died
            queue = self._queues[id(stream)] = _StreamQueue(stream)
        return queue

    def _bounded(self, queue: _StreamQueue, last: Any) -> bool:
        """Derived begins: does the timeline know what ``queue``'s stream runs before a stage
        enqueued now? Not for the first stage on a stream, nor for the first one on each stream
        after untraced work (warm-up, a sampled trace's dropped steps, a muted stretch: ``_last``
        is None then): the stream may still be busy with work no slice covers, so that stage
        records its begin, and the ones after it on the stream derive theirs from its end."""
        if last is None:  # nothing traced yet, or untraced work since the last traced stage
            for other in list(self._queues.values()):
                other.known = False
        if queue.known:
            return True
        queue.known = True
        return False

    def add(self, stage: PendingStage) -> None:
        """Queue a recorded pair (for callers that record events themselves); such stages are
        queried one by one (their stream order is not known)."""
        with self._lock:
            self._unordered.append(stage)
            self.num_recorded += 1

    def event_after_stage(
        self, stream: Any, make: Callable[[], Any], *, wait_only: bool = False
    ) -> Any:
        """An event on ``stream`` right after the stage that just closed on it, for the caller to
        make another stream wait on or to synchronise with: when tracing, that stage's end event
        (lent to the caller: never recorded again, nor shared by a contiguous stage; one record
        fewer per call), else ``make()`` (an event of the kind the timeline's ``EventOps``
        records) recorded on ``stream`` now. The caller must not have enqueued anything on
        ``stream`` since the stage closed.

        ``wait_only``: the caller only makes another stream wait on the event, at once, and keeps
        no reference to it (a stream wait takes the event's state when it is enqueued, in CUDA
        and on the CPU device). The end event is then not lent: it returns to the pool once the
        stage is emitted, like any other (no event made and destroyed per call).

        Untraced (or after a stage that lent its end, or a graph-stamped one), the event is
        ``make()``'s, made once and recorded again: a ``wait_only`` one per stream, the others
        back from :meth:`give_back` (in steady steps no event is made or destroyed either)."""
        if stream is None:
            stream = self.ops.default_stream()
        last = self._last
        if (
            last is not None
            and last.site.stream is stream
            and not last.lent
            and last.end_given is None  # a graph stamp is no event to wait for
            and self.tracer.enabled
        ):
            if not wait_only:
                last.lent = True
                self._lent[id(last.end)] = last
            return last.end
        if wait_only:
            event = self._sync_events.get(id(stream))
            if event is None:
                event = self._sync_events[id(stream)] = make()
        else:
            spare = self._spare
            event = spare.pop() if spare else make()
        self._record(event, stream)
        return event

    def give_back(self, event: Any) -> None:
        """The caller is done with an event :meth:`event_after_stage` gave it (it will not query,
        synchronise on or wait for it again): a lent stage end returns to the pool once its
        stage is emitted (taken back by the next poll); an event ``make()`` made is recorded
        again by a later untraced call. One append on the calling (engine) thread."""
        if id(event) in self._lent:
            self._returned.append(event)
        else:
            self._spare.append(event)

    def _take_back(self) -> None:
        """Under ``_lock``: events given back become the timeline's again (freed now if their
        stage was emitted, else when it is)."""
        returned, lent = self._returned, self._lent
        while returned:
            event = returned.popleft()
            stage = lent.pop(id(event), None)
            if stage is None or stage.end is not event:
                continue
            stage.lent = False
            if stage.emitted and not stage.end_shared:
                if stage is self._last:  # the next stage may still begin at it
                    self._resolve_held()
                    self._held = stage
                else:
                    self._end_ns.pop(id(event), None)
                    self._free.append(event)

    def _resolve_held(self) -> None:
        """Free the held stage's end once a later stage exists that did not share it."""
        held = self._held
        if held is not None and held is not self._last:
            self._held = None  # its successor did not share its end: the event is free
            if not (held.end_shared or held.lent):
                self._end_ns.pop(id(held.end), None)
                if type(held.end) is not StampEvent:
                    self._free.append(held.end)

    def new_event(self) -> TimedEvent:
        """A fresh timing event on the timeline's host clock (for markers outside stages)."""
        return self.ops()

    def _drop_oldest(self, queue: _StreamQueue) -> None:
        """Over ``max_pending``: drop the stream's oldest stage (its events are not reused)."""
        with self._lock:
            if not queue.stages:  # a poll emitted them meanwhile
                return
            _forget(queue.stages.popleft())
            self.num_dropped += 1
            self._drop_above += 1
            self.tracer.count_dropped("device_slices")

    # stepscope: hot
    def poll_if_due(self) -> int:
        """The once-per-step hook on the hot path: nothing until ``max_deferred`` stages are
        pending (the engine did not wait for the device meanwhile); then, with ``background``,
        wake the poller thread (one C-level lock release; inline only past ``max_pending // 2``,
        a poller that cannot keep up), else :meth:`poll`. Returns how many slices were emitted
        on this thread.

        Inline too when the engine's last wait found its output ready (host-bound: the engine
        thread never blocks, so a poller thread could run only by taking the GIL from it, and
        every handoff costs the engine more than the poll itself; ``inline_when_host_bound``)."""
        pending = self.num_recorded - self.num_emitted - self.num_dropped
        if pending < self.max_deferred:
            return 0
        if (
            self.background
            and self.observer is None
            and pending < self._inline_limit
            and not (self._output_was_ready and self.inline_when_host_bound)
        ):
            self._wake()
            self.polls_woken += 1
            return 0
        self.polls_inline += 1
        return self.poll()

    def poll_while_waiting(self, done: Callable[[], bool]) -> int:
        """The engine is about to block until ``done()`` (a step's output): once ``poll_batch``
        stages are pending and ``done()`` is still False, :meth:`poll` on time the host would
        spend waiting anyway. Returns how many slices were emitted (0 when polling elsewhere).

        With ``background``, the poll runs on the timeline's poller thread instead (started on
        first use; a C-level lock release wakes it): the engine thread only checks and wakes,
        then blocks in its wait, which releases the GIL, while the poller queries, converts and
        emits, ``POLL_CHUNK`` stages per stretch of holding the GIL. With ``in_wait``, on this
        thread in chunks of ``WAIT_CHUNK`` stages, asking ``done()`` after each and stopping once
        it is True (:meth:`_poll_in_wait`). Inline, whole, when an ``observer`` is set (a kernel
        window reads its stages on the engine thread). docs/design.md §4.3."""
        pending = self.num_recorded - self.num_emitted - self.num_dropped
        if pending < self.poll_batch:  # no poll due (untraced: none pending): no query either
            return 0
        # Asked only when a poll is due (one step in ~13 at the default batch): an event query
        # costs the engine thread µs. ``poll_if_due`` reads the answer only past
        # ``max_deferred`` >= ``poll_batch`` pending, so it is this step's or the last one's.
        ready = self._output_was_ready = done()
        if ready:
            return 0
        if self.observer is None:  # a kernel window reads its stages on this thread: inline
            if self.in_wait:
                return self._poll_in_wait(done)
            if self.background:
                self._wake()
                self.polls_woken += 1
                return 0
        self.polls_inline += 1
        return self.poll()

    def _poll_in_wait(self, done: Callable[[], bool]) -> int:
        """``in_wait``: emit completed stages ``WAIT_CHUNK`` at a time on this thread until none
        is left or ``done()`` (the output the engine is about to block on is ready). The poller
        thread is started too, idle: it only keeps the clock's reference recent when the engine
        pauses (its polls are never woken)."""
        if self._poller is None:
            self._start_poller()
        self.polls_in_wait += 1
        wall0, cpu0 = time.monotonic_ns(), time.thread_time_ns()
        emitted = 0
        chunk_start = wall0
        while True:
            n = self.poll(WAIT_CHUNK)
            emitted += n
            if done():  # the output is ready: its step goes on; the rest waits for a later wait
                # It became ready during this chunk (or the query after it): the most it waited.
                self.wait_poll_overrun_ns += time.monotonic_ns() - chunk_start
                break
            if n < WAIT_CHUNK:  # nothing completed is left: block in the wait
                break
            chunk_start = time.monotonic_ns()
        self.wait_poll_cpu_ns += time.thread_time_ns() - cpu0
        self.wait_poll_wall_ns += time.monotonic_ns() - wall0
        return emitted

    def _wake(self) -> None:
        """Wake the poller thread (start it on first use); raise what it failed with."""
        if self.poller_error is not None:
            raise RuntimeError("the device timeline's poller failed") from self.poller_error
        if self._poller is None:
            self._start_poller()
        kick = self._kick
        if kick.locked():  # released: the poller polls (again) once it is back at its acquire
            kick.release()

    def _start_poller(self) -> None:
        self._stopping = False
        if not self._kick.locked():
            self._kick.acquire()
        self._poller = threading.Thread(
            target=self._poll_in_background, name="stepscope-device-poll", daemon=True
        )
        self._poller.start()

    def _poll_in_background(self) -> None:
        self.ops.bind_thread()
        kick = self._kick
        while True:
            if not kick.acquire(timeout=ANCHOR_EVERY_S):  # idle: keep the clock's reference recent
                try:
                    with self._lock:
                        self.ops.keep_anchored()
                except BaseException as exc:  # kept for the engine thread: never lost
                    self.poller_error = exc
                    return
                continue
            if self._stopping:
                kick.release()
                return
            wall_ns = time.monotonic_ns()  # the wall interval encloses the CPU one
            cpu_ns = time.thread_time_ns()
            busy_log, start_ns = self.busy_log, time.perf_counter_ns()
            try:
                # Chunks, with a sleep between them: a query or an elapsed_time keeps the GIL
                # (torch's C methods do not release it), so one long poll would stall an engine
                # thread that wants the GIL back for up to the whole poll (docs/design.md §4.3).
                while self.poll(POLL_CHUNK) >= POLL_CHUNK and not self._stopping:
                    time.sleep(POLL_YIELD_S)
            except BaseException as exc:  # kept for the engine thread: never lost
                self.poller_error = exc
                return
            finally:
                self.poller_cpu_ns += time.thread_time_ns() - cpu_ns
                self.poller_wall_ns += time.monotonic_ns() - wall_ns
                if busy_log is not None:
                    busy_log.append((start_ns, time.perf_counter_ns()))

    def _stop_poller(self) -> None:
        """Stop and join the poller thread (a poll it is running finishes first)."""
        poller = self._poller
        if poller is None:
            return
        self._stopping = True
        if self._kick.locked():
            self._kick.release()
        poller.join()
        self._poller = None

    def poll(self, limit: int | None = None) -> int:
        """Emit every pending stage whose end event has completed (at most ``limit`` of them);
        never blocks (but for another poll in progress).

        Per stream, the newest pending end event is queried first (complete: so is every earlier
        one), else the boundary is found galloping back from it. Returns how many slices were
        emitted.
        """
        with self._lock:
            return self._poll_locked(limit)

    def _untraced_gap(self) -> None:
        """The first untraced stage after traced ones (tracing muted or paused, a sampled
        trace's dropped steps, a step range that ended). The stages still pending would wait
        for ``poll_batch`` of them, which untraced steps never add, and meanwhile the device
        goes on: a graph stamp's ring row is written again ``RING`` replays later, traced or
        not, and its stage could then never be read. So until a poll finds none pending, or
        tracing back on, every wait and every step polls while any stage is pending (both
        thresholds 1; :meth:`_poll_locked` puts them back). Once per gap: the engine thread
        calls it only where the last stage was traced."""
        with self._lock:  # not while a poll may put them back
            if self._thresholds is None and self.num_recorded > self.num_emitted + self.num_dropped:
                self._thresholds = (self.poll_batch, self.max_deferred)
                self.poll_batch = self.max_deferred = 1

    def _end_gap(self) -> None:
        """The usual thresholds again once an untraced gap's stages are out, or tracing is back
        on (under the lock, from a poll)."""
        if self._thresholds is not None and (
            self.tracer.enabled or self.num_recorded == self.num_emitted + self.num_dropped
        ):
            self.poll_batch, self.max_deferred = self._thresholds
            self._thresholds = None

    def _poll_locked(self, limit: int | None = None) -> int:
        if self._thresholds is not None:
            self._end_gap()
        if self._returned:
            self._take_back()
        if self.num_recorded == self.num_emitted + self.num_dropped:
            return 0
        sections = self.poll_sections_ns
        if sections is not None:
            sections[_QUERY] -= time.thread_time_ns()
        done: list[Any] = []
        for queue in list(self._queues.values()):  # the engine thread may add a stream
            stages = queue.stages
            left = len(stages) if limit is None else limit - len(done)
            # The completed ones popped in one C-level loop (only polls pop, under the lock).
            done.extend(
                itertools.islice(iter(stages.popleft, _NO_EVENT), self._completed(stages, left))
            )
        if self._unordered:
            query = self._query
            still: list[Any] = []
            for stage in self._unordered:
                (done if query(stage.end) else still).append(stage)
            self._unordered = still
        if sections is not None:
            sections[_QUERY] += time.thread_time_ns()
            sections[_STAGES] += len(done)
        if done:
            self._emit(done)
        if self._thresholds is not None:
            self._end_gap()
        return len(done)

    def _completed(self, stages: deque[Any], limit: int) -> int:
        """How many of a stream's oldest ``limit`` pending stages have completed (stream order:
        a completed end event vouches for every earlier one).

        Searched from the newest back, in steps of 1, 2, 4, ... then by bisection: a poll runs
        while the device works on the newest step or two, so the first incomplete stage is
        usually among the last few (2-4 queries, against ~log2(n) + 1 for a bisection of all n).
        """
        n = min(len(stages), limit)  # the engine thread may append meanwhile: these n only
        if n == 0:
            return 0
        query = self._query
        sections = self.poll_sections_ns
        queries = 1
        if query(stages[n - 1].end):
            if sections is not None:
                sections[_QUERIES] += queries
            return n
        lo, hi = -1, n - 1  # stages[hi] is incomplete; stages[lo] complete (or none, at -1)
        back = 1
        while hi - back > lo:  # gallop back from the newest
            i = hi - back
            queries += 1
            if query(stages[i].end):
                lo = i
                break
            hi, back = i, back * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            queries += 1
            if query(stages[mid].end):
                lo = mid
            else:
                hi = mid
        if sections is not None:
            sections[_QUERIES] += queries
        return lo + 1

    def drain(self) -> int:
        """Emit what has completed; count what is still pending as dropped (end of a run, off
        the hot path: a stage that never completes is counted, not lost silently). Stops the
        poller thread first, and raises what it failed with."""
        self._stop_poller()
        if self.poller_error is not None:
            error, self.poller_error = self.poller_error, None
            raise RuntimeError("the device timeline's poller failed") from error
        with self._lock:
            emitted = self._poll_locked()
            left = self.num_pending
            if left:
                for queue in self._queues.values():
                    for stage in queue.stages:
                        _forget(stage)
                    queue.stages.clear()
                self._unordered = []
                self._end_ns.clear()
                self._lent.clear()
                self._returned.clear()
                self.num_dropped += left
                self._drop_above += left
                self.tracer.count_dropped("device_slices", left)
        return emitted

    def _emit(self, stages: list[Any]) -> None:
        """Completed stages (each stream's in stream order) as slices: their distinct events
        converted in one pass, the slices handed to the tracer in one call."""
        emit_c = self._stage_core if self.compiled_emit else None
        events: list[Any] | None = None if emit_c is None else emit_c.collect_events(stages)
        if events is None:
            events = []
            prev_end: Any = _NO_EVENT
            for stage in stages:
                begin = stage.begin
                if begin is not prev_end and begin is not None:  # a contiguous begin: read once
                    events.append(begin)  # (None: a derived begin, no event)
                events.append(stage.end)
                prev_end = stage.end
        sections = self.poll_sections_ns
        if sections is not None:
            sections[_CONVERT] -= time.thread_time_ns()
        times = self._host_ns_many(events)
        if sections is not None:
            now = time.thread_time_ns()
            sections[_CONVERT] += now
            sections[_BUILD] -= now
            sections[_EVENTS] += len(events)
        self._resolve_held()
        free, last, observer = self._free, self._last, self.observer
        derive = self._derive
        both = derive and self._record_begins
        shared_ns = self._end_ns
        built = None
        if emit_c is not None and not both:  # the same loop, compiled (an A/B lever)
            built = emit_c.emit_stages(stages, times, free, last, shared_ns, derive, EV_STAGE,
                                       StampEvent, self._track_of, self._pending_end_ns)  # fmt: skip
        if built is not None:
            out, held = built
            if held is not None:
                self._held = held
        else:
            out = self._build_slices(stages, times, free, last, shared_ns, derive, both)
        if observer is not None:
            for stage, event in zip(stages, out, strict=True):
                observer(stage.lane, event[2], stage.step, event[3], event[4])
        self.num_emitted += len(stages)
        self._drop_above += len(stages)
        if sections is None:
            self.tracer.append_slices(out)
            return
        now = time.thread_time_ns()
        sections[_BUILD] += now
        self.tracer.append_slices(out)
        sections[_HAND] += time.thread_time_ns() - now

    def _build_slices(
        self,
        stages: list[Any],
        times: list[int],
        free: list[Any],
        last: Any,
        shared_ns: dict[int, int],
        derive: bool,
        both: bool,
    ) -> list[RawEvent]:
        """:meth:`_emit`'s slices of ``stages`` from their events' host ``times`` (in
        :meth:`_emit`'s order), with the pool, shared-end and derived-begin bookkeeping."""
        out: list[RawEvent] = []
        emit = out.append
        i = 0
        prev_end = _NO_EVENT
        end_ns = 0
        for stage in stages:
            begin, end = stage.begin, stage.end
            if begin is None:
                start_ns = -1  # derived below, once its end is known
            elif begin is prev_end:
                start_ns = end_ns
                shared_ns.pop(id(begin), None)  # stored just now, with its predecessor
            else:
                start_ns = times[i]
                i += 1
                if shared_ns:  # begins at an end an earlier poll emitted: at that very time
                    start_ns = shared_ns.pop(id(begin), start_ns)
            end_ns = times[i]
            if end_ns < start_ns:
                end_ns = start_ns
            i += 1
            prev_end = end
            # Read: free to record again; a shared end goes with the stage that shares it, a lent
            # one stays with the caller, and the newest stage's end waits for the next stage
            # (which may share it).
            if begin is not None and type(begin) is not StampEvent:
                free.append(begin)
            if stage.end_shared:
                shared_ns[id(end)] = end_ns
            elif stage is last:  # the next stage may still begin at its end
                shared_ns[id(end)] = end_ns
                if not stage.lent:
                    self._held = stage
            elif not stage.lent and type(end) is not StampEvent:
                free.append(end)
            if isinstance(stage, PendingStage):
                stage.emitted = True
                name, track = stage.name, self._track_of(stage.lane, None)
                args = {_STEP: stage.step, _HOST_END_NS: stage.host_end_ns, **stage.args}
                emit((EV_SLICE_AT, track, name, start_ns, end_ns, args))
                continue
            site = stage.site
            track = site.track
            if track is None:  # the site's first slice
                track = site.track = self._track_of(site.lane, site.stream)
            stage.end_ns = end_ns  # a later stage that waited for it reads it here
            # Derived begins (docs/design.md §4.3), in the same pass: the latest of the host time
            # the stage's enqueue began, the end of the slice before it on its stream and the end
            # of its ``after`` stage; never after its own end. The stream could not reach the
            # stage earlier, so this is a lower bound of its recorded begin, and it keeps one
            # stream's slices from overlapping. The runner's sites are made in stream order
            # (h2d, compute, d2h), so an ``after`` stage of this batch was emitted above; one
            # that is not (a poll's limit left it pending) is read from its own end event.
            derived = None
            if derive:
                queue = site.queue
                if type(stage) in _DERIVED_TYPES:
                    derived = stage.host_begin_ns
                    if queue.end_ns > derived:
                        derived = queue.end_ns
                    dep = stage.after
                    if dep is not None:
                        stage.after = None  # resolved: keep no earlier stage
                        dep_end = getattr(dep, "end_ns", None)
                        if dep_end is None:  # not emitted yet
                            dep_end = self._pending_end_ns(dep)
                        if dep_end > derived:
                            derived = dep_end
                    if derived > end_ns:
                        derived = end_ns
                    if not both:
                        start_ns = derived
                queue.end_ns = end_ns
            event = (EV_STAGE, track, site.name, start_ns, end_ns, site.args, stage.args,
                     stage.step, stage.host_end_ns)  # fmt: skip
            if both:  # the recorded begin stays; a derived one is an arg of the slice's own dict
                event = expand_stage(event)
                if derived is not None:
                    event[5][_DERIVED_BEGIN_NS] = derived
            emit(event)
        return out

    def _track_of(self, lane: str, stream: Any) -> Any:
        """The track of a (lane, stream), made on first use (a stage queued through :meth:`add`
        has no stream: the lane's own track)."""
        name = self._lane_tracks[lane]
        if stream is None:
            return name
        tracks = self._stream_tracks
        track = tracks.get((lane, id(stream)))
        if track is not None:
            return track
        others = sum(1 for other, _ in tracks if other == lane)
        track = tracks[(lane, id(stream))] = name if others == 0 else (name, others)
        return track

    def _pending_end_ns(self, stage: Any) -> int:
        """The end time of an ``after`` stage no poll has emitted yet (its stream's queue was cut
        by a poll's limit), read from its end event, which is still its own (events return to the
        pool only once emitted); -1 when it has none or it has not completed."""
        end = getattr(stage, "end", None)
        if end is None or not self._query(end):
            return -1
        return self._host_ns_many([end])[0]


def _core_attr(name: str, doc: str) -> property:
    """A timeline attribute kept in the compiled core (the C stage code reads it there)."""

    def get(self: _CompiledTimeline) -> Any:
        return getattr(self._core, name)

    def set_(self: _CompiledTimeline, value: Any) -> None:
        setattr(self._core, name, value)

    return property(get, set_, doc=doc)


class _CompiledTimeline(DeviceTimeline):
    """A :class:`DeviceTimeline` whose stages run in the compiled stage core
    (``instrument/_stagecore.c``): the state its C code reads and writes per stage lives in a
    ``Core`` object, and these properties read it there for the Python code (the polls, the
    caller's sync events). Made by ``DeviceTimeline(...)`` itself when the core is used."""

    _last = _core_attr("last", "the stage recorded last (for ``contiguous``)")
    num_recorded = _core_attr("num_recorded", "stages queued")
    _drop_above = _core_attr("drop_above", "a stage's exit drops the oldest pending one past this")
    _new = _core_attr("new_event", "makes a fresh event")
    num_emitted = _core_attr("num_emitted", "stages emitted as slices")
    num_dropped = _core_attr("num_dropped", "stages dropped (counted, no slice)")
    poll_batch = _core_attr("poll_batch", "pending stages at which the engine's wait polls")
    max_deferred = _core_attr("max_deferred", "pending stages at which the hot-path hook polls")

    @property
    def _record(self) -> Any:
        return self._core.record

    @_record.setter
    def _record(self, record: Any) -> None:
        # A caller's own ``record`` (a bench or test counting the calls) must see every record:
        # the direct driver call is used only while ``record`` is the ops' own.
        core = self._core
        core.record = record
        core.record_fn = self._record_addr if record is self.ops.record else 0

    @property
    def direct_records(self) -> int:
        """Records the compiled core made through the driver's ``cuEventRecord`` directly."""
        return int(self._core.direct_records)

    def _fill_core(self) -> None:
        core = self._core
        core.tracer = self.tracer
        core.derive, core.record_begins = self._derive, self._record_begins
        core.free = self._free
        core.bounded, core.drop_oldest = self._bounded, self._drop_oldest
        core.error_cls = CudaDriverError
        self._record = self._record  # sets record_fn too
        core.lent = self._lent
        core.returned_append, core.spare_append = self._returned.append, self._spare.append
        # The once-per-step hooks: the core's methods (their common case in C) shadow the
        # class's, which stay their slow paths.
        for name in ("poll_if_due", "poll_while_waiting", "event_after_stage"):
            setattr(core, "slow_" + name, MethodType(getattr(DeviceTimeline, name), self))
            setattr(self, name, getattr(core, name))
        self.give_back = core.give_back  # type: ignore[method-assign]
        # The polls' conversions in one C loop too, where the clock has the driver's calls.
        driver = getattr(self.ops, "driver", None)
        if driver is not None and hasattr(driver, "use_compiled"):
            driver.use_compiled(self._stage_core)
