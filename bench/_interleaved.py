"""Tracing on and off in alternating blocks of steps of one engine run (an A/B that cancels drift).

Two engines timed one after the other differ by the host's drift as much as by the tracer (the
H200 hosts' off runs alone spread 8–13 %). Here one engine runs one long workload and its tracer
is switched on and off every ``block_steps`` engine iterations (``run_step`` calls): blocks come
in pairs, traced first in even pairs and untraced first in odd ones (a linear drift cancels
within a pair), or in an order drawn from ``order_seed``, or the other way round (``invert``).
``control`` keeps the tracer off in every block (an A/A control: what the order and the workload
read with no tracing at all). Every iteration is timed on the engine thread:

* ``wall``: ``run_step``'s wall time (what output throughput follows);
* ``host``: that minus the time blocked in ``AsyncOutput.wait`` (the engine thread's own work);
* ``cpu``: the engine thread's CPU time (``time.thread_time_ns``) in ``run_step`` minus its CPU
  time inside the wait (a CUDA event's synchronize may spin).
* ``proc``: the whole process's CPU time (``time.process_time_ns``: every thread, the device
  timeline's poller and the tracer's flush thread included) in ``run_step`` minus the engine
  thread's CPU inside the wait: what tracing adds to the host wherever it runs (a poll moved to
  the poller thread leaves ``cpu`` but stays in ``proc``). Another thread's work that spills
  across a block switch counts in the block where it ran. On the CPU device the model's own
  compute threads are in it too (tens of ms a step against the tracer's tens of µs), so it says
  something only on CUDA.
* ``crit``: ``host`` less the device timeline's polls that ran on the engine thread while the
  output it was about to wait for was not ready yet (``DeviceTimeline.in_wait``, ``--poll wait``:
  time the engine would otherwise spend blocked in the wait), plus each such poll's last chunk
  when the output was ready by its end (the most that poll can have delayed the step: an upper
  bound). Equal to ``host`` under the other policies. The engine thread's time on the critical
  path; ``host``, ``cpu`` and ``proc`` keep those polls.
* ``gc``: the wall time of the cyclic garbage collections that ran on the engine thread inside
  ``run_step`` (``gc.callbacks``), reported as a mean per steady step and kind: a collection
  runs in whichever step crosses its threshold, so the median says nothing, and the tracer's
  allocations make them come sooner.

Only *steady decode* iterations count: the step this iteration scheduled and the one before it
were decode-only (one token per request), and the iteration is not among the first
``skip_steps`` of its block. Those first ones are left out because of what spills across a
switch: with async scheduling an iteration retires the step the previous one launched, and the
device timeline's poller emits a traced block's last stages a few steps into the next block.
What still spills: the tracer's flush thread (every 0.5 s) and the writer process work on the
traced blocks' events whenever they run, in either kind of block, so a block much shorter than
the flush interval splits their cost between the two kinds and the difference under-counts it
(by up to half); their whole-process cost is measured by the micro benchmark instead.

**The mean of a run is not the tracer's cost on a workload that repeats.** With every request of
one length (the H200's 1024 × (128→128)) the same expensive steps recur at the same iterations
run after run, and under the fixed order they fall into the same kind of block every time: on
the H200 the A/A control read +42 µs a step on average over six runs (session 21), more than the
traced runs did. The host also drifts by ±10 % over seconds, so one run's interval on its mean
is ±30–100 µs. ``bench/step_matched.py`` fits the cost over runs saved with their samples
(``samples_table``), step by step. ``attribute`` splits the mean by what the tracer's helper
threads did during each step, and by phase (schedule, launch, post-wait and its calls).

Switching uses ``Tracer.enabled``, as ``Tracer.muted`` does: an untraced block pays exactly the
disabled tracer's hooks, as a run without ``--trace`` does. The trace file of such a run has holes
(requests finishing in an untraced block have no track): it is a by-product, not for analysis.
"""

from __future__ import annotations

import bisect
import gc
import random
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from engine.runner.async_output import AsyncOutput

__all__ = [
    "Interleaver",
    "StepSample",
    "attribute",
    "print_attribution",
    "samples_table",
    "summarize",
]

QUANTITIES = ("host_us", "cpu_us", "wall_us", "proc_us", "crit_us")
# Post-wait calls timed on the engine thread (thread CPU), by the name ``attribute`` reports:
# reading the output (``AsyncOutput.get``, after its wait), the engine's update (``_update``:
# the scheduler's update_from_output, the request books, the counters), and inside it those two.
# Each is wrapped for the whole run, in both kinds of block alike (a Python frame and two clock
# reads a call, ~1 µs on the H200's host: they cancel in the difference).
PHASES = ("read_output", "update", "update_from_output", "counters")


@dataclass(frozen=True)
class StepSample:
    """One ``run_step`` call: its block, whether traced, steady decode or not, times in µs."""

    block: int
    traced: bool
    steady: bool
    wall_us: float
    host_us: float
    cpu_us: float
    records: int = 0  # device-timeline event records on the engine thread (``time_records``)
    record_us: float = 0.0  # their wall time
    # Of the two steps the call works on (the one it schedules, the one it retires: scheduled by
    # the call before), how many the engine skipped as a sampled trace's dropped steps (the
    # tracer paused while it scheduled them); 0 when untraced or not sampled.
    skipped_steps: int = 0
    gc_us: float = 0.0  # cyclic collections on the engine thread inside the call (wall)
    gc_runs: int = 0  # how many
    proc_us: float = 0.0  # the process's CPU (every thread) in the call, less the wait's spin
    # host_us less the engine thread's polls while its output was not ready, plus their overrun
    # bound (module docstring); None: not measured (then not summarized)
    crit_us: float | None = None
    # The engine thread's CPU in ``schedule`` and after the call's last wait (reading the output,
    # updating the requests); the rest of ``cpu_us`` is the launch side (inputs, enqueueing).
    sched_cpu_us: float = 0.0
    post_cpu_us: float = 0.0
    # The call's host windows, ``perf_counter_ns``: the call's span less its waits (see
    # ``attribute``); empty where not recorded.
    windows: tuple[tuple[int, int], ...] = ()
    # The engine thread's minor page faults and involuntary / voluntary context switches in the
    # call (``getrusage(RUSAGE_THREAD)``, Linux; 0 elsewhere).
    minflt: int = 0
    nivcsw: int = 0
    nvcsw: int = 0
    # The engine thread's CPU µs in each of ``PHASES`` in the call (nested: ``update`` holds
    # ``update_from_output`` and ``counters``); empty where not timed.
    phases: tuple[float, ...] = ()
    # What the call did, for covariates: the requests its scheduled step holds, the requests
    # that finished in the step it retired (tracing changes neither).
    num_reqs: int = 0
    finished: int = 0


@dataclass
class Interleaver:
    """Switches ``tracer`` every ``block_steps`` calls of ``engine.run_step`` and times each call
    (see the module docstring). ``install`` as a context manager; ``samples`` holds the calls."""

    engine: Any
    tracer: Any
    block_steps: int = 64
    skip_steps: int = 4
    samples: list[StepSample] = field(default_factory=list)
    # cProfile per block kind (traced, untraced), enabled around each run_step (engine thread
    # only on Python < 3.12); None: not profiled. Inflates the times: profile a separate run.
    profilers: dict[bool, Any] | None = None
    profiled_steps: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    # Time every event record the device timeline makes on the engine thread (its stages' begin
    # and end events, and the runner's sync events when untraced): wall time around each
    # ``timeline._record`` call. Adds a Python frame and two clock reads per record, in both
    # kinds of block (traced: 8 records a step, untraced: 3), so it inflates the difference a
    # little; it says how much of the tracer's added host time is the event calls themselves.
    time_records: bool = False
    # None: blocks alternate as ``traced_block`` says (traced first in even pairs). A seed:
    # each pair's order is drawn at random from it instead. A workload whose expensive steps
    # recur at fixed steps (requests of one length finish together) puts them into the same
    # kind of block run after run under the fixed order, a bias no number of runs averages
    # away; a per-run seed makes it a noise that does.
    order_seed: int | None = None
    # An A/A control: the tracer stays off in every block, the blocks still labelled traced or
    # untraced by the order. Its "difference" is what the order and the workload alone produce.
    control: bool = False
    # Every pair's order the other way round (a crossover: two runs of one deterministic
    # workload, one inverted, trace each step in exactly one of them).
    invert: bool = False
    _order: list[bool] = field(default_factory=list)
    _num_reqs: int = 0
    _calls: int = 0
    _records: int = 0
    _record_ns: int = 0
    _wait_ns: int = 0
    _wait_cpu_ns: int = 0
    _gc_ns: int = 0
    _gc_runs: int = 0
    _gc_start: int = 0
    _sched_cpu_ns: int = 0
    _phase_ns: list[int] = field(default_factory=lambda: [0] * len(PHASES))
    _last_wait_end: tuple[int, int] = (0, 0)  # (perf_counter_ns, thread CPU ns) at its end
    _waits: list[tuple[int, int]] = field(default_factory=list)
    _scheduled_decode: bool = False  # the latest schedule() was decode-only
    _scheduled_skipped: bool = False  # the engine skipped the latest scheduled step (sampled)

    def __post_init__(self) -> None:
        if self.block_steps < 2 * self.skip_steps + 4:
            raise ValueError(f"block_steps {self.block_steps} too short for skip {self.skip_steps}")

    def traced_block(self, block: int) -> bool:
        """Pair p = blocks 2p, 2p+1: traced first when p is even (or, with ``order_seed``, when
        the seeded draw for p says so)."""
        pair = block // 2
        if self.order_seed is None:
            first = pair % 2 == 0
        else:
            if len(self._order) <= pair:
                rng = random.Random(self.order_seed)
                self._order = [rng.random() < 0.5 for _ in range(max(64, 2 * (pair + 1)))]
            first = self._order[pair]
        return ((block % 2 == 0) == first) != self.invert

    @contextmanager
    def install(self) -> Iterator[Interleaver]:
        engine, scheduler = self.engine, self.engine.scheduler
        run_step, schedule, wait = engine.run_step, scheduler.schedule, AsyncOutput.wait
        clock, cpu_clock, proc_clock = (
            time.perf_counter_ns,
            time.thread_time_ns,
            time.process_time_ns,
        )
        was_enabled = self.tracer.enabled
        engine_thread = threading.get_ident()
        thread_usage = _thread_usage()
        # The device timeline's in-wait poll counters (``crit``); an engine without one: none.
        runner = getattr(engine, "runner", None)
        polls = getattr(runner, "timeline", None)

        def in_wait_ns() -> int:
            if polls is None:
                return 0
            return int(polls.wait_poll_wall_ns - polls.wait_poll_overrun_ns)

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if threading.get_ident() != engine_thread:
                return
            if phase == "start":
                self._gc_start = clock()
            elif self._gc_start:
                self._gc_ns += clock() - self._gc_start
                self._gc_runs += 1
                self._gc_start = 0

        def timed_schedule() -> Any:
            cpu0 = cpu_clock()
            try:
                so = schedule()
            finally:
                self._sched_cpu_ns += cpu_clock() - cpu0
            self._scheduled_decode = 0 < so.num_reqs == so.total_num_scheduled_tokens
            self._num_reqs = so.num_reqs
            self._scheduled_skipped = self.tracer.paused  # paused for this step: dropped
            return so

        def timed_wait(output: AsyncOutput) -> None:
            start, cpu0 = clock(), cpu_clock()
            try:
                wait(output)
            finally:
                end, cpu1 = clock(), cpu_clock()
                self._wait_cpu_ns += cpu1 - cpu0
                self._wait_ns += end - start
                self._waits.append((start, end))
                self._last_wait_end = (end, cpu1)

        def timed_step() -> Any:
            block, offset = divmod(self._calls, self.block_steps)
            traced = self.traced_block(block)
            self.tracer.enabled = traced and not self.control
            previous_decode = self._scheduled_decode
            previous_skipped = self._scheduled_skipped
            self._scheduled_decode = self._scheduled_skipped = False
            wait0, wait_cpu0 = self._wait_ns, self._wait_cpu_ns
            records0, record_ns0 = self._records, self._record_ns
            gc_ns0, gc_runs0 = self._gc_ns, self._gc_runs
            sched_cpu0 = self._sched_cpu_ns
            phase0 = list(phase_ns)
            self._waits.clear()
            profiler = None
            if self.profilers and previous_decode and offset >= self.skip_steps:
                profiler = self.profilers[traced]  # decode steps only: like for like
                self.profiled_steps[traced] += 1
                profiler.enable()
            in_wait0 = in_wait_ns()
            usage0 = thread_usage()
            start, cpu0, proc0 = clock(), cpu_clock(), proc_clock()
            self._last_wait_end = (start, cpu0)
            outputs: Any = ()
            self._num_reqs = 0
            try:
                outputs = run_step()
                return outputs
            finally:
                end = clock()
                end_cpu = cpu_clock()
                usage = thread_usage()
                wall = end - start
                in_wait = in_wait_ns() - in_wait0
                proc = proc_clock() - proc0 - (self._wait_cpu_ns - wait_cpu0)
                if profiler is not None:
                    profiler.disable()
                cpu = end_cpu - cpu0 - (self._wait_cpu_ns - wait_cpu0)
                steady = previous_decode and self._scheduled_decode and offset >= self.skip_steps
                self._calls += 1
                host = wall - (self._wait_ns - wait0)
                edges = [start, *(t for w in self._waits for t in w), end]
                windows = tuple(zip(edges[::2], edges[1::2], strict=True))
                self.samples.append(
                    StepSample(
                        block, traced, steady, wall / 1e3, host / 1e3, cpu / 1e3,
                        self._records - records0, (self._record_ns - record_ns0) / 1e3,
                        previous_skipped + self._scheduled_skipped,
                        (self._gc_ns - gc_ns0) / 1e3, self._gc_runs - gc_runs0, proc / 1e3,
                        (host - in_wait) / 1e3,
                        (self._sched_cpu_ns - sched_cpu0) / 1e3,
                        (end_cpu - self._last_wait_end[1]) / 1e3 if self._waits else 0.0,
                        windows,
                        usage[0] - usage0[0],
                        usage[1] - usage0[1],
                        usage[2] - usage0[2],
                        tuple((a - b) / 1e3 for a, b in zip(phase_ns, phase0, strict=True)),
                        self._num_reqs,
                        _finished(outputs),
                    )
                )  # fmt: skip

        timeline = engine.runner.timeline if self.time_records else None
        record = timeline._record if timeline is not None else None

        def timed_record(event: Any, stream: Any) -> None:
            start = clock()
            try:
                record(event, stream)  # type: ignore[misc]
            finally:
                self._record_ns += clock() - start
                self._records += 1

        phase_ns = self._phase_ns

        def timed(index: int, fn: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                cpu0 = cpu_clock()
                try:
                    return fn(*args, **kwargs)
                finally:
                    phase_ns[index] += cpu_clock() - cpu0

            return call

        get = AsyncOutput.get
        # (the index in PHASES, the object, the method); a stand-in engine may lack some
        wrapped = [(i, obj, attr) for i, obj, attr in ((1, engine, "_update"),
                   (2, scheduler, "update_from_output"), (3, engine, "_sample_counters"))
                   if hasattr(obj, attr)]  # fmt: skip
        originals = [getattr(obj, attr) for _, obj, attr in wrapped]
        for i, obj, attr in wrapped:
            setattr(obj, attr, timed(i, getattr(obj, attr)))
        AsyncOutput.get = timed(0, get)  # type: ignore[method-assign]
        engine.run_step, scheduler.schedule = timed_step, timed_schedule
        AsyncOutput.wait = timed_wait  # type: ignore[method-assign]
        if timeline is not None:
            timeline._record = timed_record
        gc.callbacks.append(on_gc)
        try:
            yield self
        finally:
            gc.callbacks.remove(on_gc)
            engine.run_step, scheduler.schedule = run_step, schedule
            AsyncOutput.get = get  # type: ignore[method-assign]
            for (_, obj, attr), original in zip(wrapped, originals, strict=True):
                if getattr(type(obj), attr, None) is getattr(original, "__func__", None):
                    delattr(obj, attr)  # the bound method was the class's: drop the patch
                else:
                    setattr(obj, attr, original)
            AsyncOutput.wait = wait  # type: ignore[method-assign]
            if timeline is not None:
                timeline._record = record
            self.tracer.enabled = was_enabled


def _finished(outputs: Any) -> int:
    """How many of a ``run_step``'s outputs finished (a ``StepOutputs``' columns never do)."""
    explicit = getattr(outputs, "explicit", outputs)
    return sum(1 for o in explicit if o.finished) if explicit else 0


SAMPLE_FIELDS = ("block", "traced", "steady", "wall_us", "host_us", "cpu_us", "proc_us",
                 "crit_us", "sched_cpu_us", "post_cpu_us", "minflt", "num_reqs", "finished")  # fmt: skip


def samples_table(samples: list[StepSample]) -> dict[str, list[Any]]:
    """Every call's sample as columns (``SAMPLE_FIELDS``, and each of ``PHASES``), rounded to
    0.1 µs: what ``--save-samples`` writes, for estimators tried after the run."""
    table: dict[str, list[Any]] = {}
    for f in SAMPLE_FIELDS:
        col = [getattr(s, f) for s in samples]
        table[f] = [round(v, 1) if isinstance(v, float) else v for v in col]
    for i, name in enumerate(PHASES):
        table[name] = [round(s.phases[i], 1) if s.phases else None for s in samples]
    return table


def _thread_usage() -> Any:
    """A function returning the calling thread's (minor faults, involuntary, voluntary context
    switches) so far: ``getrusage(RUSAGE_THREAD)`` where there is one (Linux), else zeros."""
    try:
        import resource

        who = resource.RUSAGE_THREAD
    except (ImportError, AttributeError):
        return lambda: (0, 0, 0)

    def usage() -> tuple[int, int, int]:
        r = resource.getrusage(who)
        return r.ru_minflt, r.ru_nivcsw, r.ru_nvcsw

    return usage


def profile_diff(
    profilers: dict[bool, Any], profiled_steps: dict[bool, int], top: int
) -> list[tuple[str, float]]:
    """The ``top`` functions whose own time per step (µs, over the profiled steps of each kind:
    those after a decode-only step, past the block's first ``skip_steps``) grew most in traced
    blocks over untraced ones: where the tracer's engine-thread time goes."""
    import pstats

    per_step: dict[bool, dict[str, float]] = {}
    for traced, prof in profilers.items():
        steps = max(1, profiled_steps[traced])
        stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        per_step[traced] = {
            f"{k[0].rsplit('/', 2)[-1]}:{k[1]}({k[2]})": v[2] / steps * 1e6
            for k, v in stats.items()
        }
    grown = {f: t - per_step[False].get(f, 0.0) for f, t in per_step[True].items()}
    return sorted(grown.items(), key=lambda kv: -kv[1])[:top]


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))]


def _bootstrap_median(values: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of the median of ``values`` (resampling pairs)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return _percentile(meds, 0.025), _percentile(meds, 0.975)


def _measured(steps: list[StepSample]) -> list[str]:
    """The ``QUANTITIES`` these steps carry (an optional one is None where not measured)."""
    return [q for q in QUANTITIES if steps and getattr(steps[0], q) is not None]


def summarize(samples: list[StepSample], min_steps: int = 8) -> dict[str, Any]:
    """Per quantity (``QUANTITIES``): the median over steady traced and untraced steps, their
    ratio, and per block pair (both blocks with ≥ ``min_steps`` steady steps) the difference
    traced − untraced of the blocks' medians: its median over pairs with a 95 % bootstrap
    interval; ``mean_diff_*`` the same with the blocks' means (a cost paid in one step of many,
    such as a poll, moves the mean, not the median). ``throughput_ratio``: per pair, untraced
    over traced mean wall per step (= traced tok/s over untraced: a steady decode step yields
    one token per request in either kind), median over pairs with its interval."""
    steady = [s for s in samples if s.steady]
    blocks: dict[int, list[StepSample]] = {}
    for s in steady:
        blocks.setdefault(s.block, []).append(s)
    pairs = [
        (blocks[2 * p], blocks[2 * p + 1])
        for p in range(max(blocks, default=-1) // 2 + 1)
        if len(blocks.get(2 * p, ())) >= min_steps and len(blocks.get(2 * p + 1, ())) >= min_steps
    ]
    pairs = [(a, b) if a[0].traced else (b, a) for a, b in pairs]  # (traced, untraced)
    out: dict[str, Any] = {
        "steps": len(samples),
        "steady_steps": {"traced": sum(s.traced for s in steady),
                         "untraced": sum(not s.traced for s in steady)},
        "pairs": len(pairs),
    }  # fmt: skip
    if not pairs:
        return out
    for q in _measured(steady):
        on = statistics.median(getattr(s, q) for s in steady if s.traced)
        off = statistics.median(getattr(s, q) for s in steady if not s.traced)
        diffs = [
            statistics.median(getattr(s, q) for s in t)
            - statistics.median(getattr(s, q) for s in u)
            for t, u in pairs
        ]
        lo, hi = _bootstrap_median(diffs)
        # The same with each block's mean: what a cost paid in a few steps of a block (a poll
        # every ~20 steps) adds per step; the median of a block misses it.
        mean_diffs = [
            statistics.fmean(getattr(s, q) for s in t) - statistics.fmean(getattr(s, q) for s in u)
            for t, u in pairs
        ]
        mlo, mhi = _bootstrap_median(mean_diffs)
        out[q] = {"traced": on, "untraced": off, "ratio": on / off if off else float("nan"),
                  "diff_median": statistics.median(diffs), "diff_ci95": [lo, hi],
                  "diff_per_pair": diffs, "mean_diff_median": statistics.median(mean_diffs),
                  "mean_diff_ci95": [mlo, mhi]}  # fmt: skip
    ratios = [
        statistics.fmean(s.wall_us for s in u) / statistics.fmean(s.wall_us for s in t)
        for t, u in pairs
    ]
    lo, hi = _bootstrap_median(ratios)
    out["throughput_ratio"] = {"median": statistics.median(ratios), "ci95": [lo, hi]}
    out["tail"] = _tails(steady)
    out["gc"] = {
        kind: {
            "us_per_step": statistics.fmean(s.gc_us for s in mine) if mine else 0.0,
            "runs_per_step": statistics.fmean(s.gc_runs for s in mine) if mine else 0.0,
        }
        for kind, mine in (
            ("traced", [s for s in steady if s.traced]),
            ("untraced", [s for s in steady if not s.traced]),
        )
    }
    if any(s.records for s in steady):  # Interleaver.time_records
        out["event_records"] = {}
        for kind, traced in (("traced", True), ("untraced", False)):
            out["event_records"][kind] = _records([s for s in steady if s.traced == traced])
    if any(s.skipped_steps for s in steady):
        out["sampled"] = _sampled(steady, pairs, min_steps)
    return out


def _merged(intervals: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """``intervals`` sorted and merged: their starts and ends, for bisection."""
    starts: list[int] = []
    ends: list[int] = []
    for s, e in sorted(intervals):
        if ends and s <= ends[-1]:
            ends[-1] = max(ends[-1], e)
        else:
            starts.append(s)
            ends.append(e)
    return starts, ends


def _overlap_ns(windows: tuple[tuple[int, int], ...], merged: tuple[list[int], list[int]]) -> int:
    """How long ``windows`` overlap the merged intervals."""
    starts, ends = merged
    total = 0
    for s, e in windows:
        i = bisect.bisect_right(ends, s)  # the first interval ending after s
        while i < len(starts) and starts[i] < e:
            total += min(e, ends[i]) - max(s, starts[i])
            i += 1
    return total


ATTRIBUTED = ("host_us", "crit_us", "cpu_us", "sched_cpu_us", "post_cpu_us")
COUNTED = ("minflt", "nivcsw", "nvcsw")


def attribute(samples: list[StepSample], busy: dict[str, list[tuple[int, int]]]) -> dict[str, Any]:
    """Where the traced steps' mean goes: the steady steps split by what the tracer's helper
    threads did during their host windows (the call less its waits). ``busy`` maps a thread
    (``poller``, ``flush``) to the intervals it worked in (``DeviceTimeline.busy_log``,
    ``Tracer.flush_log``); a step is ``clear`` when none overlaps it, else named by those that
    do (``poller+flush`` for both). Per kind of block and class: the steps, their share, the
    mean of each of ``ATTRIBUTED`` (``launch_cpu_us``: ``cpu_us`` less schedule and post), and
    the mean overlap. ``excess``: per traced class, share x (class mean − untraced mean), which
    sum to the traced − untraced difference of the means: how much of it comes with which
    threads' work. A correlation, not a cause: a step that overlaps a poll may differ in other
    ways (a poll is woken at a wait after enough stages pended)."""
    steady = [s for s in samples if s.steady and s.windows and s.crit_us is not None]
    merged = {name: _merged(iv) for name, iv in busy.items()}
    rows: dict[str, dict[str, list[tuple[StepSample, dict[str, int]]]]] = {}
    for s in steady:
        over = {name: _overlap_ns(s.windows, m) for name, m in merged.items()}
        cls = "+".join(name for name, ns in over.items() if ns) or "clear"
        kind = "traced" if s.traced else "untraced"
        rows.setdefault(kind, {}).setdefault(cls, []).append((s, over))

    def values(mine: list[StepSample], q: str) -> list[float]:
        if q in PHASES:
            return [s.phases[PHASES.index(q)] if s.phases else 0.0 for s in mine]
        if q == "launch_cpu_us":
            return [s.cpu_us - s.sched_cpu_us - s.post_cpu_us for s in mine]
        return [getattr(s, q) for s in mine]

    def mean(mine: list[StepSample], q: str) -> float:
        return statistics.fmean(values(mine, q))

    def median(mine: list[StepSample], q: str) -> float:
        return statistics.median(values(mine, q))

    quantities = (*ATTRIBUTED, "launch_cpu_us", *COUNTED, *PHASES)
    out: dict[str, Any] = {"threads": sorted(busy), "busy_intervals": {
        name: len(iv) for name, iv in busy.items()}}  # fmt: skip
    overall: dict[str, dict[str, float]] = {}
    for kind, classes in rows.items():
        n = sum(len(v) for v in classes.values())
        everything = [s for v in classes.values() for s, _ in v]
        overall[kind] = {q: mean(everything, q) for q in quantities}
        out[kind] = {"steps": n, "mean": overall[kind],
                     "median": {q: median(everything, q) for q in quantities}, "classes": {
            cls: {"steps": len(v), "share": len(v) / n,
                  "mean": {q: mean([s for s, _ in v], q) for q in quantities},
                  "median": {q: median([s for s, _ in v], q) for q in quantities},
                  "overlap_us": {name: statistics.fmean(o[name] for _, o in v) / 1e3
                                 for name in busy}}
            for cls, v in sorted(classes.items())}}  # fmt: skip
    if "traced" in out and "untraced" in out:
        base = overall["untraced"]
        out["excess"] = {
            cls: {q: c["share"] * (c["mean"][q] - base[q]) for q in quantities}
            for cls, c in out["traced"]["classes"].items()
        }
        out["difference"] = {q: overall["traced"][q] - base[q] for q in quantities}
    return out


def _cell(q: str, value: float, sign: str = "") -> str:
    """A table cell: µs to 0.1, counts (``COUNTED``) to 0.01."""
    return f"{value:>{sign}10.{2 if q in COUNTED else 1}f}"


def print_attribution(att: dict[str, Any]) -> None:
    """``attribute``'s table."""
    print("    where the traced steps' mean goes (steady steps, mean us; classes by the tracer "
          "threads working during the step's host windows):")  # fmt: skip
    head = ("host wall", "critical", "engine CPU", "schedule", "post-wait", "launch", "faults",
            "preempt", "yield")  # fmt: skip
    qs = (*ATTRIBUTED, "launch_cpu_us", *COUNTED)
    print(
        f"      {'kind / class':<24} {'steps':>6} {'share':>6} "
        + " ".join(f"{h:>10}" for h in head)
    )
    for kind in ("untraced", "traced"):
        if kind not in att:
            continue
        k = att[kind]
        print(
            f"      {kind + ' (all)':<24} {k['steps']:>6} {1:>6.2f} "
            + " ".join(_cell(q, k["mean"][q]) for q in qs)
        )
        for cls, c in k["classes"].items():
            print(
                f"      {'  ' + cls:<24} {c['steps']:>6} {c['share']:>6.2f} "
                + " ".join(_cell(q, c["mean"][q]) for q in qs)
            )
    if "traced" in att and "untraced" in att:
        on, off = att["traced"]["median"], att["untraced"]["median"]
        print(
            f"      {'medians, traced - untraced':<38} "
            + " ".join(_cell(q, on[q] - off[q], "+") for q in qs)
        )
    if "traced" in att and "untraced" in att and att["traced"]["mean"].get(PHASES[0]):
        on, off = att["traced"], att["untraced"]
        print(
            "      post-wait calls, engine CPU us, traced / untraced, mean (median): "
            + ", ".join(
                f"{q} {on['mean'][q]:.1f} / {off['mean'][q]:.1f} "
                f"({on['median'][q]:.1f} / {off['median'][q]:.1f})"
                for q in PHASES
            )
        )
    if "excess" in att:
        print("      traced - untraced mean, split by class (share x class excess):")
        for cls, ex in att["excess"].items():
            print(
                f"      {'  ' + cls:<24} {'':>6} {'':>6} "
                + " ".join(_cell(q, ex[q], "+") for q in qs)
            )
        d = att["difference"]
        print(
            f"      {'  = difference':<24} {'':>6} {'':>6} "
            + " ".join(_cell(q, d[q], "+") for q in qs)
        )


def _records(mine: list[StepSample]) -> dict[str, float]:
    """Event records per step, µs per record and per step, over ``mine``."""
    n, us = sum(s.records for s in mine), sum(s.record_us for s in mine)
    return {
        "per_step": n / len(mine) if mine else 0.0,
        "us_per_record": us / n if n else 0.0,
        "us_per_step": us / len(mine) if mine else 0.0,
    }


def _sampled(
    steady: list[StepSample],
    pairs: list[tuple[list[StepSample], list[StepSample]]],
    min_steps: int,
) -> dict[str, Any]:
    """A sampled trace's traced blocks split by what the engine did: ``kept`` steps (neither of
    the call's two steps skipped) and ``dropped`` ones (both skipped: the engine did not trace
    them). Per kind: steady steps, medians, the pair differences against the untraced block
    (pairs whose traced block has ≥ ``min_steps`` steps of the kind) and the event records."""
    out: dict[str, Any] = {}
    for kind, skipped in (("kept", 0), ("dropped", 2)):
        mine = [s for s in steady if s.traced and s.skipped_steps == skipped]
        entry: dict[str, Any] = {"steady_steps": len(mine)}
        usable = [
            ([s for s in t if s.skipped_steps == skipped], u)
            for t, u in pairs
            if sum(s.skipped_steps == skipped for s in t) >= min_steps
        ]
        entry["pairs"] = len(usable)
        for q in _measured(mine):
            diffs = [
                statistics.median(getattr(s, q) for s in t)
                - statistics.median(getattr(s, q) for s in u)
                for t, u in usable
            ]
            entry[q] = {"median": statistics.median(getattr(s, q) for s in mine)}
            if diffs:
                lo, hi = _bootstrap_median(diffs)
                entry[q] |= {"diff_median": statistics.median(diffs), "diff_ci95": [lo, hi]}
        if any(s.records for s in steady):
            entry["event_records"] = _records(mine)
        out[kind] = entry
    return out


def _tails(steady: list[StepSample]) -> dict[str, dict[str, dict[str, float]]]:
    """Per quantity and kind (traced / untraced): mean, p50, p90, p99 and max over the steady
    steps. The throughput ratio follows mean step wall, the pair differences medians: a mean
    far above the median is a tail of long steps, which this shows (e.g. the host stalled past
    its lead over the device)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for q in _measured(steady):
        out[q] = {}
        for kind, traced in (("traced", True), ("untraced", False)):
            values = sorted(getattr(s, q) for s in steady if s.traced == traced)
            if not values:
                continue
            pct = {f"p{round(f * 100)}": values[min(len(values) - 1, int(f * len(values)))]
                   for f in (0.5, 0.9, 0.99)}  # fmt: skip
            out[q][kind] = {"mean": statistics.fmean(values), **pct, "max": values[-1]}
    return out


def print_summary(name: str, result: dict[str, Any], block_steps: int, skip_steps: int) -> None:
    print(f"interleaved, {name}: one engine run, tracing switched every {block_steps} steps "
          f"(first {skip_steps} of each block left out), {result['pairs']} block pairs, steady "
          f"decode steps traced {result['steady_steps']['traced']} / untraced "
          f"{result['steady_steps']['untraced']} (of {result['steps']})")  # fmt: skip
    if not result["pairs"]:
        print("    no block pair with enough steady decode steps: run longer")
        return
    print(f"    {'per step (median)':<22} {'traced':>9} {'untraced':>9} {'diff, pairs':>11} "
          f"{'95% CI':>19} {'ratio':>6} {'mean diff':>10} {'95% CI':>19}")  # fmt: skip
    labels = {"host_us": "host wall us", "cpu_us": "engine CPU us", "wall_us": "step wall us",
              "proc_us": "process CPU us", "crit_us": "critical host us"}  # fmt: skip
    for q, label in labels.items():
        if q not in result:  # an older result (no process CPU)
            continue
        r = result[q]
        lo, hi = r["diff_ci95"]
        line = (f"    {label:<22} {r['traced']:>9.1f} {r['untraced']:>9.1f} "
                f"{r['diff_median']:>+11.1f} [{lo:>+7.1f}, {hi:>+7.1f}] {r['ratio']:>6.3f}")  # fmt: skip
        if "mean_diff_median" in r:  # older results have none
            mlo, mhi = r["mean_diff_ci95"]
            line += f" {r['mean_diff_median']:>+10.1f} [{mlo:>+7.1f}, {mhi:>+7.1f}]"
        print(line)
    print("    (a mean diff also holds which steps each kind of block got: on a workload whose "
          "steps repeat, an A/A control, --control, reads its own; bench/step_matched.py fits "
          "the cost step by step over runs)")  # fmt: skip
    t = result["throughput_ratio"]
    print(f"    throughput traced / untraced (per pair: mean step wall, median of pairs): "
          f"{t['median']:.4f} [{t['ci95'][0]:.4f}, {t['ci95'][1]:.4f}]")  # fmt: skip
    wall = result.get("tail", {}).get("wall_us", {})
    if "traced" in wall and "untraced" in wall:
        on, off = wall["traced"], wall["untraced"]
        print("    step wall us, traced / untraced: " + ", ".join(
            f"{k} {on[k]:.0f} / {off[k]:.0f}" for k in ("mean", "p50", "p90", "p99", "max")))  # fmt: skip
    gcs = result.get("gc")
    if gcs:
        on, off = gcs["traced"], gcs["untraced"]
        print(f"    garbage collection on the engine thread (mean over steady steps): traced "
              f"{on['us_per_step']:.1f} us ({on['runs_per_step']:.4f} runs) a step, untraced "
              f"{off['us_per_step']:.1f} us ({off['runs_per_step']:.4f}): "
              f"{on['us_per_step'] - off['us_per_step']:+.1f} us a step")  # fmt: skip
    for kind, r in result.get("sampled", {}).items():
        cpu = r.get("cpu_us", {})
        line = f"    sampled trace, {kind} steps: {r['steady_steps']} steady"
        if "diff_median" in cpu:
            lo, hi = cpu["diff_ci95"]
            line += (f", engine CPU {cpu['median']:.1f} us, {cpu['diff_median']:+.1f} "
                     f"[{lo:+.1f}, {hi:+.1f}] over untraced ({r['pairs']} pairs)")  # fmt: skip
        if "event_records" in r:
            line += f", {r['event_records']['per_step']:.2f} event records a step"
        print(line)
    rec = result.get("event_records")
    if rec:
        on, off = rec["traced"], rec["untraced"]
        print(f"    event records on the engine thread (wall, mean over steady steps): traced "
              f"{on['per_step']:.2f} a step x {on['us_per_record']:.2f} us = "
              f"{on['us_per_step']:.1f} us, untraced {off['per_step']:.2f} x "
              f"{off['us_per_record']:.2f} = {off['us_per_step']:.1f} us: "
              f"{on['us_per_step'] - off['us_per_step']:+.1f} us a step added")  # fmt: skip
