"""Tracing on and off in alternating blocks of steps of one engine run (an A/B that cancels drift).

Two engines timed one after the other differ by the host's drift as much as by the tracer (the
H200 hosts' off runs alone spread 8–13 %). Here one engine runs one long workload and its tracer
is switched on and off every ``block_steps`` engine iterations (``run_step`` calls): blocks come
in pairs, traced first in even pairs and untraced first in odd ones (a linear drift cancels
within a pair). Every iteration is timed on the engine thread:

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

Switching uses ``Tracer.enabled``, as ``Tracer.muted`` does: an untraced block pays exactly the
disabled tracer's hooks, as a run without ``--trace`` does. The trace file of such a run has holes
(requests finishing in an untraced block have no track): it is a by-product, not for analysis.
"""

from __future__ import annotations

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

__all__ = ["Interleaver", "StepSample", "summarize"]

QUANTITIES = ("host_us", "cpu_us", "wall_us", "proc_us", "crit_us")


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
    _calls: int = 0
    _records: int = 0
    _record_ns: int = 0
    _wait_ns: int = 0
    _wait_cpu_ns: int = 0
    _gc_ns: int = 0
    _gc_runs: int = 0
    _gc_start: int = 0
    _scheduled_decode: bool = False  # the latest schedule() was decode-only
    _scheduled_skipped: bool = False  # the engine skipped the latest scheduled step (sampled)

    def __post_init__(self) -> None:
        if self.block_steps < 2 * self.skip_steps + 4:
            raise ValueError(f"block_steps {self.block_steps} too short for skip {self.skip_steps}")

    def traced_block(self, block: int) -> bool:
        """Pair p = blocks 2p, 2p+1: traced first when p is even."""
        return (block % 2 == 0) == ((block // 2) % 2 == 0)

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
            so = schedule()
            self._scheduled_decode = 0 < so.num_reqs == so.total_num_scheduled_tokens
            self._scheduled_skipped = self.tracer.paused  # paused for this step: dropped
            return so

        def timed_wait(output: AsyncOutput) -> None:
            start, cpu0 = clock(), cpu_clock()
            try:
                wait(output)
            finally:
                self._wait_cpu_ns += cpu_clock() - cpu0
                self._wait_ns += clock() - start

        def timed_step() -> Any:
            block, offset = divmod(self._calls, self.block_steps)
            traced = self.traced_block(block)
            self.tracer.enabled = traced
            previous_decode = self._scheduled_decode
            previous_skipped = self._scheduled_skipped
            self._scheduled_decode = self._scheduled_skipped = False
            wait0, wait_cpu0 = self._wait_ns, self._wait_cpu_ns
            records0, record_ns0 = self._records, self._record_ns
            gc_ns0, gc_runs0 = self._gc_ns, self._gc_runs
            profiler = None
            if self.profilers and previous_decode and offset >= self.skip_steps:
                profiler = self.profilers[traced]  # decode steps only: like for like
                self.profiled_steps[traced] += 1
                profiler.enable()
            in_wait0 = in_wait_ns()
            start, cpu0, proc0 = clock(), cpu_clock(), proc_clock()
            try:
                return run_step()
            finally:
                wall = clock() - start
                in_wait = in_wait_ns() - in_wait0
                proc = proc_clock() - proc0 - (self._wait_cpu_ns - wait_cpu0)
                if profiler is not None:
                    profiler.disable()
                cpu = cpu_clock() - cpu0 - (self._wait_cpu_ns - wait_cpu0)
                steady = previous_decode and self._scheduled_decode and offset >= self.skip_steps
                self._calls += 1
                host = wall - (self._wait_ns - wait0)
                self.samples.append(
                    StepSample(
                        block, traced, steady, wall / 1e3, host / 1e3, cpu / 1e3,
                        self._records - records0, (self._record_ns - record_ns0) / 1e3,
                        previous_skipped + self._scheduled_skipped,
                        (self._gc_ns - gc_ns0) / 1e3, self._gc_runs - gc_runs0, proc / 1e3,
                        (host - in_wait) / 1e3,
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
            AsyncOutput.wait = wait  # type: ignore[method-assign]
            if timeline is not None:
                timeline._record = record
            self.tracer.enabled = was_enabled


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
