"""Host time the tracer takes on the engine thread, measured directly around its calls.

End-to-end differences (traced minus untraced run) are dominated by run-to-run noise when the
effect is tens of µs in a 4–5 ms step. This measures the tracer's own share instead: every entry
point the engine thread calls (tracer spans and their ``__enter__``/``__exit__``, instants,
counters, slices, request tracks; the device timeline's stages, polls and drain; the engine's
counter sampling, which reads scheduler stats only when tracing) is wrapped with a wall clock
(``perf_counter_ns``: GIL waits inside a call count), the outermost call only (calls nested in
another wrapped call are not counted twice). The wrapper's own cost inside the timed region is
calibrated on an empty function and subtracted. With the compiled stage core the runner's stage
sites and their scopes are C objects, whose methods cannot be patched: the runner's sites are
swapped for proxies that time the same calls (``_MeteredSite``), so both cores are measured
alike. The device timeline's poll just before the
engine blocks on a step's output is reported apart (``in_wait``): while the device is still busy
with that step the host would have waited anyway.

A second, untimed pass counts the CUDA event calls the device timeline makes per step (record,
query, elapsed_time), which the timed pass leaves unwrapped.
"""

from __future__ import annotations

import gc
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from instrument import device_timeline as _dt
from instrument import tracer as _tr
from instrument.graph_stamps import StampEvent

_TRACER_METHODS = ("span", "span_begin", "span_end", "trace_step", "pause", "resume", "instant", "counter", "counters", "counter_values", "slice_at",
                   "slice_args",
                   "append_slices", "request_slices", "thread_slice", "metadata")  # fmt: skip
_TIMELINE_METHODS = ("stage", "poll_if_due", "poll", "drain", "event_after_stage", "give_back")
_IN_WAIT = "timeline.poll_while_waiting"


class CostMeter:
    """Wall ns and calls per wrapped entry point, engine thread only, outermost calls only."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = defaultdict(int)  # wall
        self.cpu_ns: dict[str, int] = defaultdict(int)  # the engine thread's CPU time
        self.calls: dict[str, int] = defaultdict(int)
        self._depth = 0
        self._thread: int | None = None
        self.bias_ns = self.bias_cpu_ns = 0.0  # the wrapper's own cost inside its region, per call
        self.gc_ns = 0  # cyclic collections on the engine thread (wall)
        self.gc_in_calls_ns = 0  # of which inside a wrapped call (its allocation set it off)
        self.gc_runs = [0, 0, 0]  # collections per generation
        self._gc_start = 0

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        """``gc.callbacks`` hook: time the collections that run on the engine thread."""
        if threading.get_ident() != self._thread:
            return
        if phase == "start":
            self._gc_start = time.perf_counter_ns()
        elif self._gc_start:
            took = time.perf_counter_ns() - self._gc_start
            self.gc_ns += took
            if self._depth:
                self.gc_in_calls_ns += took
            self.gc_runs[info["generation"]] += 1
            self._gc_start = 0

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
        ns, cpu_ns, calls, get_ident = self.ns, self.cpu_ns, self.calls, threading.get_ident

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth or get_ident() != self._thread:
                return fn(*args, **kwargs)
            self._depth = 1
            cpu0, start = cpu_clock(), clock()
            try:
                return fn(*args, **kwargs)
            finally:
                end = clock()
                cpu_ns[label] += cpu_clock() - cpu0
                ns[label] += end - start
                calls[label] += 1
                self._depth = 0

        return timed

    def calibrate(self, n: int = 20000) -> None:
        """The wrapper's cost inside its own timed regions, per call (an empty function called
        with a keyword, as most entry points are); the minimum of five batches."""
        biases = []
        for _ in range(5):
            probe = CostMeter()
            probe._thread = threading.get_ident()
            empty = probe.wrap("empty", lambda step=0: None)
            for _ in range(n):
                empty(step=1)
            biases.append((probe.ns["empty"] / n, probe.cpu_ns["empty"] / n))
        self.bias_ns = min(b[0] for b in biases)
        self.bias_cpu_ns = min(b[1] for b in biases)

    def per_step(self, steps: int) -> dict[str, Any]:
        """Wall and CPU µs per step, the wrapper's bias subtracted per call."""
        steps = max(steps, 1)
        wall = {k: max(v - self.bias_ns * self.calls[k], 0.0) for k, v in self.ns.items()}
        cpu = {k: max(v - self.bias_cpu_ns * self.calls[k], 0.0) for k, v in self.cpu_ns.items()}
        tracer_us = (sum(wall.values()) - wall.get(_IN_WAIT, 0.0)) / steps / 1e3
        return {
            "tracer_us_per_step": tracer_us,
            # The same without the collections that ran inside those calls: which calls a
            # collection falls in is chance, so the traced-minus-untraced collection time is
            # the number for the tracer's share of them (an estimate, gc_us_per_step's).
            "tracer_us_per_step_no_gc": tracer_us - self.gc_in_calls_ns / steps / 1e3,
            "gc_in_calls_us_per_step": self.gc_in_calls_ns / steps / 1e3,
            "in_wait_us_per_step": wall.get(_IN_WAIT, 0.0) / steps / 1e3,
            "tracer_cpu_us_per_step": (sum(cpu.values()) - cpu.get(_IN_WAIT, 0.0)) / steps / 1e3,
            "in_wait_cpu_us_per_step": cpu.get(_IN_WAIT, 0.0) / steps / 1e3,
            "wrapper_bias_ns_per_call": self.bias_ns,
            "wrapper_bias_cpu_ns_per_call": self.bias_cpu_ns,
            "by_call_us_per_step": {
                k: round(v / steps / 1e3, 2) for k, v in sorted(wall.items(), key=lambda kv: -kv[1])
            },
            "by_call_cpu_us_per_step": {
                k: round(v / steps / 1e3, 2) for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])
            },
            "calls_per_step": {k: round(v / steps, 2) for k, v in sorted(self.calls.items())},
            "gc_us_per_step": self.gc_ns / steps / 1e3,
            "gc_collections_per_step": [round(n / steps, 4) for n in self.gc_runs],
        }  # fmt: skip


@contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    # A property (the compiled timeline's ``_record``) is set back to what it read.
    had = name in vars(obj) or isinstance(getattr(type(obj), name, None), property)
    old = vars(obj)[name] if name in vars(obj) else getattr(obj, name, None)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


@contextmanager
def metered(engine: Any, meter: CostMeter) -> Iterator[None]:
    """Wrap the tracer entry points the engine's thread calls (see the module docstring)."""
    from contextlib import ExitStack

    tracer, timeline = engine.tracer, engine.runner.timeline
    meter._thread = threading.get_ident()
    with ExitStack() as stack:
        for name in _TRACER_METHODS:
            stack.enter_context(
                _patched(tracer, name, meter.wrap(f"tracer.{name}", getattr(tracer, name)))
            )
        # The live classes and the disabled tracer's no-op ones alike (see the module docstring).
        for span_cls in (tracer._span_cls, _tr._NullSpan):
            for name in ("__enter__", "__exit__", "set_args"):
                fn = vars(span_cls).get(name) or getattr(span_cls, name)
                stack.enter_context(_patched(span_cls, name, meter.wrap(f"span.{name}", fn)))
        for name in _TIMELINE_METHODS:
            fn = getattr(timeline, name)
            stack.enter_context(_patched(timeline, name, meter.wrap(f"timeline.{name}", fn)))
        # The runner opens its stages through stage sites (the same work as timeline.stage).
        fn = vars(_dt.StageSite)["stage"]
        stack.enter_context(_patched(_dt.StageSite, "stage", meter.wrap("timeline.stage", fn)))
        if timeline.core != "python":
            # The compiled core's sites and scopes are C types, whose methods cannot be
            # patched: the runner's sites are swapped for timing proxies instead.
            stack.enter_context(_metered_sites(engine.runner._sites, meter))
        fn = timeline.poll_while_waiting
        stack.enter_context(_patched(timeline, "poll_while_waiting", meter.wrap(_IN_WAIT, fn)))
        for scope in (_dt._StageScope, _dt._NullScope):
            for name in ("__enter__", "__exit__"):
                fn = vars(scope)[name]
                stack.enter_context(_patched(scope, name, meter.wrap(f"stage.{name}", fn)))
        fn = engine._sample_counters  # scheduler stats read only for the trace
        stack.enter_context(_patched(engine, "_sample_counters", meter.wrap("counters", fn)))
        requests = engine.requests
        fn = requests._write_track
        stack.enter_context(_patched(requests, "_write_track", meter.wrap("request_track", fn)))
        gc.callbacks.append(meter.on_gc)
        try:
            yield
        finally:
            gc.callbacks.remove(meter.on_gc)


class _MeteredScope:
    """A compiled stage scope whose ``__enter__`` and ``__exit__`` are timed (by the meter's
    wrappers ``enter`` and ``exit_``); what ``with ... as s`` binds is the scope's own."""

    __slots__ = ("_enter", "_exit", "_scope")

    def __init__(self, scope: Any, enter: Callable[..., Any], exit_: Callable[..., Any]) -> None:
        self._scope, self._enter, self._exit = scope, enter, exit_

    def __enter__(self) -> Any:
        return self._enter(self._scope)

    def __exit__(self, *exc: object) -> Any:
        return self._exit(self._scope, *exc)


class _MeteredSite:
    """A stand-in for one of the runner's compiled stage sites: ``stage`` is the site's, timed,
    and returns its scope inside a :class:`_MeteredScope`. The proxies' own work (an object per
    stage) is outside the timed regions; each timed region holds one lambda frame around the C
    call, as the calibration's empty function does."""

    def __init__(self, site: Any, meter: CostMeter, wrapped: dict[str, Callable[..., Any]]) -> None:
        stage, enter, exit_ = wrapped["stage"], wrapped["enter"], wrapped["exit"]

        def opened(*args: Any, **kwargs: Any) -> _MeteredScope:
            return _MeteredScope(stage(site, *args, **kwargs), enter, exit_)

        self.site = site
        self.stage = opened


@contextmanager
def _metered_sites(sites: Any, meter: CostMeter) -> Iterator[None]:
    """Every stage site of the runner's ``_StageSites`` timed through a :class:`_MeteredSite`
    (the compiled core; its calls count as ``timeline.stage`` and ``stage.__enter__`` /
    ``stage.__exit__``, as the Python core's patched methods do)."""
    from contextlib import ExitStack

    wrapped = {
        "stage": meter.wrap("timeline.stage", lambda site, *a, **k: site.stage(*a, **k)),
        "enter": meter.wrap("stage.__enter__", lambda scope: scope.__enter__()),
        "exit": meter.wrap("stage.__exit__", lambda scope, *exc: scope.__exit__(*exc)),
    }
    with ExitStack() as stack:
        for name, site in list(vars(sites).items()):
            stack.enter_context(_patched(sites, name, _MeteredSite(site, meter, wrapped)))
        yield


@contextmanager
def counted_event_calls(engine: Any, counts: dict[str, int]) -> Iterator[None]:
    """Count the device timeline's event calls (``record``, ``query``, ``elapsed_time``), and
    time the records made on the engine thread (``counts["record_engine_ns"]`` over
    ``counts["record_engine"]`` calls; wall, the counting wrapper's clock reads included)."""
    from contextlib import ExitStack

    timeline = engine.runner.timeline
    engine_thread = threading.get_ident()
    clock = time.perf_counter_ns

    record = timeline._record

    def timed_record(event: Any, stream: Any) -> None:
        counts["record"] += 1
        if threading.get_ident() != engine_thread:
            record(event, stream)
            return
        start = clock()
        record(event, stream)
        counts["record_engine_ns"] += clock() - start
        counts["record_engine"] += 1

    with ExitStack() as stack:
        # The timeline caches record, query and the conversion (through graph stamps, when it
        # has them: a stamp is read from host memory, not converted by an event call).
        stack.enter_context(_patched(timeline, "_record", timed_record))
        query = timeline._query

        def querying(event: Any) -> Any:
            if type(event) is not StampEvent:
                counts["query"] += 1
            return query(event)

        stack.enter_context(_patched(timeline, "_query", querying))
        host_ns_many = timeline._host_ns_many

        def converting(events: Any) -> list[int]:
            counts["elapsed_time"] += sum(1 for e in events if type(e) is not StampEvent)
            return host_ns_many(events)  # type: ignore[no-any-return]

        stack.enter_context(_patched(timeline, "_host_ns_many", converting))
        yield
