"""What tracing costs: output throughput and host time per step, tracing off / on / on + requests.

Runs one workload through ``stepscope run``'s code path (its argument parser, ``EngineConfig``,
capture settings, ``Tracer`` and ``LLM``), one engine per mode built once, then alternates the
modes round by round (``off``, ``--trace``, ``--trace --trace-requests``), after one warm-up run
per mode. A timed run repeats the workload (fresh prompts each time: no prefix-cache hits) until
it lasts ``--min-run-s``; every mode runs the same prompts. Per mode it prints the median output
tok/s, the spread (min..max), the ratio to ``off``, and per engine step:

* ``host us/step``: wall time of ``run_step`` minus the time blocked in ``wait_output`` (the
  engine thread's own work; includes waiting for the GIL the tracer's flush thread holds);
* ``median step``: the median over steps of that same host time (robust to steps preempted by
  other processes on a shared machine);
* ``cpu us/step``: process CPU time (all threads) per step; ``+eng``: the engine thread's CPU.

These end-to-end numbers (``ratio``, ``paired``: the median of per-round ratios; ``+host``,
``+med``, ``+eng``, ``+cpu``: a mode's median minus off's) are differences between noisy runs:
below the off runs' own spread they are noise. So the bench also measures the tracer's cost
**directly**: after the rounds, one workload per mode with every tracer entry point the engine
thread calls timed around the call (``bench/_tracer_cost.py``; wall and CPU, the timing wrapper's
own cost subtracted), reported as ``added`` µs per step over off's, with the device timeline's
batched poll at the engine's wait apart (``in wait``: on a device still busy with the step the
host waits for, it costs no throughput), and the CUDA event calls per step. ``--no-direct``
skips it. A no-device micro benchmark runs first (the tracer calls of one engine step, CUDA path
over stand-in events that count their calls). ``--modes`` can add ``trace-thread`` /
``trace+requests-thread``: the same with ``--trace-writer thread`` (encoding on a thread of the
engine's process), and ``trace-every4`` (``--trace --trace-every 4``). The output digest of
every run must match (tracing changes no tokens).

``--trace-begins recorded|derived|both`` is passed to every traced mode's engine (and the micro
benchmark's timeline): how device slices that do not begin at the previous slice's end get their
begin (docs/design.md §4.3). An A/B of recorded vs derived begins is two runs of the bench, one
with each (derived: 3 event records fewer per decode step); ``both`` writes the traces that
``bench/bench_derived_begins.py`` measures the derived begins' error on.

``--interleaved`` replaces all of that with an A/B inside one engine run, which cancels the
host's drift between runs: per traced mode, tracing is switched on and off every
``--block-steps`` engine iterations for ``--min-run-s``, and the traced and untraced steady decode
iterations are compared (host wall, engine-thread CPU, step wall, throughput ratio; per block
pair differences with a bootstrap interval; ``bench/_interleaved.py``). ``--profile N`` then adds
a cProfile of one more workload per block kind.

CPU (default, small model, short):
    python bench/bench_trace_overhead.py --out /tmp/overhead.json
H200 (the issue's workload):
    python bench/bench_trace_overhead.py --device cuda --dtype bfloat16 \\
        --model-config qwen3-0.6b --random-weights --tokenizer samples/models/pycoder-14m \\
        --num-requests 1024 --in-len 128 --out-len 128 --num-kv-blocks 16384 \\
        --max-num-seqs 256 --max-num-batched-tokens 8192 --min-run-s 10 \\
        --out bench/results/h200/trace_overhead.json
    (the same with --interleaved --min-run-s 75 --block-steps 256: bash bench/h200_session.sh
    overhead-il)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.cli import build_parser, capture_from_args, config_from_args, tracer_from_args
from engine.llm import LLM, outputs_digest
from engine.workload import load_workload
from instrument.tracer import Tracer, set_tracer

MODES: dict[str, list[str]] = {
    "off": [],
    "trace": ["--trace", "{dir}/trace.pftrace"],
    "trace+requests": ["--trace", "{dir}/trace_req.pftrace", "--trace-requests"],
    # Not run by default: the encoding on a thread of the engine's process (the old writer).
    "trace-thread": ["--trace", "{dir}/trace_thread.pftrace", "--trace-writer", "thread"],
    "trace+requests-thread": [
        "--trace", "{dir}/trace_req_thread.pftrace", "--trace-requests", "--trace-writer", "thread"
    ],
    # Not run by default: a sampled trace (one run of 16 steps in 4 kept). The engine thread
    # skips the tracer's work on the steps it drops (docs/design.md §4.9): --interleaved reports
    # kept and dropped steps apart (``sampled``) and what each costs over untraced.
    "trace-every4": ["--trace", "{dir}/trace_every4.pftrace", "--trace-every", "4"],
    # Not run by default: both begins modes in one process (the A/B of --trace-begins, with
    # --direct-rounds alternating their direct measurements); --trace-begins does not apply.
    "trace-recorded": ["--trace", "{dir}/trace_rec.pftrace", "--trace-begins", "recorded"],
    "trace-derived": ["--trace", "{dir}/trace_der.pftrace", "--trace-begins", "derived"],
    "trace-derived+requests": ["--trace", "{dir}/trace_der_req.pftrace", "--trace-begins",
                               "derived", "--trace-requests"],
    # The same without graph stamps (the forward stages end at recorded events, as before them).
    "trace-recorded-events": ["--trace", "{dir}/trace_rec_ev.pftrace", "--trace-begins",
                              "recorded", "--trace-graph-stamps", "off"],
    "trace-derived-events": ["--trace", "{dir}/trace_der_ev.pftrace", "--trace-begins",
                             "derived", "--trace-graph-stamps", "off"],
}  # fmt: skip
DEFAULT_MODES = "off,trace,trace+requests"


@dataclass
class StepTimer:
    """Wall time of ``run_step`` and of the ``wait_output`` inside it, summed over steps."""

    steps: int = 0
    step_ns: int = 0
    wait_ns: int = 0
    thread_cpu_ns: int = 0  # the engine thread's CPU time in run_step
    host_ns: list[int] = field(default_factory=list)  # per step: run_step minus its waits

    def install(self, engine: Any) -> None:
        run_step, wait = engine.run_step, engine._wait
        clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns

        def timed_step() -> Any:
            start, wait0, cpu0 = clock(), self.wait_ns, cpu_clock()
            try:
                return run_step()
            finally:
                took = clock() - start
                self.thread_cpu_ns += cpu_clock() - cpu0
                self.step_ns += took
                self.steps += 1
                self.host_ns.append(took - (self.wait_ns - wait0))

        def timed_wait(*args: Any) -> Any:
            start = clock()
            try:
                return wait(*args)
            finally:
                self.wait_ns += clock() - start

        engine.run_step, engine._wait = timed_step, timed_wait


@dataclass
class Mode:
    name: str
    llm: LLM
    tracer: Tracer | None
    timer: StepTimer = field(default_factory=StepTimer)
    runs: list[dict[str, float]] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)
    tokens: dict[str, list[int]] = field(default_factory=dict)  # the latest timed run's, by id


def token_differences(
    base: dict[str, list[int]], got: dict[str, list[int]]
) -> list[dict[str, Any]]:
    """Requests whose output tokens in ``got`` differ from ``base``'s (by request id): the first
    differing position, the length expected, and up to 4 tokens from there on each side."""
    out = []
    for req_id, want in base.items():
        have = got.get(req_id)
        if have == want:
            continue
        have = have or []
        pos = next(
            (i for i, (a, b) in enumerate(zip(want, have, strict=False)) if a != b),
            min(len(want), len(have)),
        )
        out.append(
            {
                "req": req_id,
                "pos": pos,
                "len": len(want),
                "want": want[pos : pos + 4],
                "have": have[pos : pos + 4],
            }
        )
    return out


def _engine_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--workload", "synthetic:n=1", "--device", args.device, "--dtype", args.dtype]
    argv += ["--model", args.model] if args.model else ["--model-config", args.model_config]
    if args.random_weights:
        argv.append("--random-weights")
    if args.tokenizer:
        argv += ["--tokenizer", args.tokenizer]
    for flag in ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks"):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return argv + args.engine_args


def build_mode(name: str, args: argparse.Namespace, trace_dir: str) -> Mode:
    """The engine (and tracer) of one mode, made as ``stepscope run`` makes them."""
    argv = _engine_argv(args) + [a.format(dir=trace_dir) for a in MODES[name]]
    if MODES[name] and "--trace-begins" not in MODES[name]:  # a traced mode
        argv += ["--trace-begins", args.trace_begins]
    run_args = build_parser().parse_args(argv)
    config = config_from_args(run_args)
    tracer = None
    if run_args.trace:
        tracer = tracer_from_args(run_args, run_args.trace, capture_from_args(run_args))
    set_tracer(tracer)
    llm = LLM(config, tracer=tracer, trace_requests=run_args.trace_requests)
    set_tracer(None)
    mode = Mode(name, llm, tracer)
    mode.timer.install(llm.engine)
    return mode


def workload(args: argparse.Namespace, seed: int) -> list[Any]:
    spec = (
        f"synthetic:n={args.num_requests},in={args.in_len}-{args.in_len},"
        f"out={args.out_len}-{args.out_len},vocab={args.vocab},seed={seed}"
    )
    return [dataclasses.replace(w, id=f"s{seed}-{w.id}") for w in load_workload(spec)]


def timed_run(mode: Mode, workloads: list[list[Any]]) -> dict[str, float]:
    """Run the workloads back to back; throughput and per-step host/CPU time."""
    timer = mode.timer
    timer.steps = timer.step_ns = timer.wait_ns = timer.thread_cpu_ns = 0
    timer.host_ns = []
    cpu0, start = time.process_time_ns(), time.perf_counter_ns()
    outputs = []
    for w in workloads:
        outputs.extend(mode.llm.run_workload(w))
    elapsed_ns = time.perf_counter_ns() - start
    cpu_ns = time.process_time_ns() - cpu0
    mode.digests.append(outputs_digest(outputs))
    mode.tokens = {o.id: list(o.output_token_ids) for o in outputs}
    steps = max(timer.steps, 1)
    return {
        "elapsed_s": elapsed_ns / 1e9,
        "output_tokens": sum(len(o.output_token_ids) for o in outputs),
        "tok_s": sum(len(o.output_token_ids) for o in outputs) / (elapsed_ns / 1e9),
        "steps": timer.steps,
        "host_us_per_step": (timer.step_ns - timer.wait_ns) / steps / 1e3,
        # The median step: robust to a step preempted by another process on a shared machine.
        "host_us_median_step": statistics.median(timer.host_ns) / 1e3 if timer.host_ns else 0.0,
        "wait_us_per_step": timer.wait_ns / steps / 1e3,
        "cpu_us_per_step": cpu_ns / steps / 1e3,
        "engine_cpu_us_per_step": timer.thread_cpu_ns / steps / 1e3,
    }


def _summary(runs: list[dict[str, float]], key: str) -> dict[str, float]:
    values = [r[key] for r in runs]
    med = statistics.median(values)
    return {"median": med, "min": min(values), "max": max(values),
            "spread": (max(values) - min(values)) / med if med else 0.0}  # fmt: skip


def report(modes: list[Mode]) -> dict[str, Any]:
    """End-to-end, per mode: medians over the rounds and their spread; ``ratio`` = median tok/s
    over off's; ``paired`` = median over rounds of (tok/s / off's tok/s in the same round), less
    sensitive to drift across rounds. ``+host``, ``+med``, ``+eng``: added host µs per step
    (mean; median step; engine-thread CPU) as differences of medians, dominated by run-to-run
    noise when the effect is small (compare ``spread``)."""
    off = modes[0]
    base = {k: statistics.median(r[k] for r in off.runs)
            for k in ("tok_s", "host_us_per_step", "host_us_median_step", "cpu_us_per_step",
                      "engine_cpu_us_per_step")}  # fmt: skip
    out: dict[str, Any] = {"modes": {}}
    print("end to end (noise-dominated for effects below the off runs' spread):")
    print(f"{'mode':<16} {'tok/s median':>12} {'min..max':>19} {'spread':>7} {'ratio':>6} "
          f"{'paired':>6} {'host us/step':>12} {'+host':>7} {'+med':>7} {'+eng':>7} "
          f"{'+cpu':>7}")  # fmt: skip
    for m in modes:
        keys = ("tok_s", "host_us_per_step", "cpu_us_per_step", "host_us_median_step",
                "engine_cpu_us_per_step")  # fmt: skip
        tok, host, cpu, med, eng = (_summary(m.runs, k) for k in keys)
        paired = statistics.median(
            r["tok_s"] / o["tok_s"] for r, o in zip(m.runs, off.runs, strict=True)
        )
        entry = {
            "runs": m.runs, "tok_s": tok, "host_us_per_step": host, "cpu_us_per_step": cpu,
            "ratio_to_off": tok["median"] / base["tok_s"],
            "paired_ratio_to_off": paired,
            "added_host_us_per_step": host["median"] - base["host_us_per_step"],
            "host_us_median_step": med,
            "added_host_us_median_step": med["median"] - base["host_us_median_step"],
            "engine_cpu_us_per_step": eng,
            "added_engine_cpu_us_per_step": eng["median"] - base["engine_cpu_us_per_step"],
            "added_cpu_us_per_step": cpu["median"] - base["cpu_us_per_step"],
            "digests": m.digests,
        }  # fmt: skip
        out["modes"][m.name] = entry
        print(f"{m.name:<16} {tok['median']:>12.1f} {tok['min']:>9.1f}..{tok['max']:<9.1f} "
              f"{tok['spread']:>7.3f} {entry['ratio_to_off']:>6.3f} {paired:>6.3f} "
              f"{host['median']:>12.1f} {entry['added_host_us_per_step']:>+7.1f} "
              f"{entry['added_host_us_median_step']:>+7.1f} "
              f"{entry['added_engine_cpu_us_per_step']:>+7.1f} "
              f"{entry['added_cpu_us_per_step']:>+7.1f}")  # fmt: skip
    # Each round runs the same prompts in every mode: its digests must all agree.
    out["same_tokens"] = all(
        len(set(round_)) == 1 for round_ in zip(*(m.digests for m in modes), strict=True)
    )
    print(f"same tokens in every run: {out['same_tokens']}")
    return out


def direct(modes: list[Mode], work: list[Any], rounds: int = 1) -> dict[str, Any]:
    """Per mode, one more workload with the tracer's entry points timed directly on the engine
    thread (``bench/_tracer_cost.py``: wall and CPU time), then one with the device timeline's
    event calls counted; the tracer's host µs per step is each mode's minus off's (off: the
    disabled tracer's calls). Stages pending from earlier runs are emitted first (untimed).
    ``rounds`` > 1 repeats that, the modes alternated, and reports each mode's median added µs
    (and every round's): the host's speed drifts between rounds by more than the differences
    between traced modes."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _tracer_cost import CostMeter, counted_event_calls, metered

    def settle(m: Mode) -> None:
        m.llm.engine.device.synchronize()
        m.llm.engine.runner.timeline.poll()

    def measure(m: Mode, tag: str) -> dict[str, Any]:
        engine = m.llm.engine
        meter = CostMeter()
        meter.calibrate()
        settle(m)
        m.timer.steps = 0
        with metered(engine, meter):
            m.llm.run_workload([dataclasses.replace(w, id=f"d{tag}-{m.name}-{w.id}") for w in work])
        entry = meter.per_step(m.timer.steps)
        counts: dict[str, int] = {"record": 0, "query": 0, "elapsed_time": 0,
                                  "record_engine": 0, "record_engine_ns": 0}  # fmt: skip
        settle(m)
        m.timer.steps = 0
        with counted_event_calls(engine, counts):
            m.llm.run_workload([dataclasses.replace(w, id=f"c{tag}-{m.name}-{w.id}") for w in work])
            settle(m)
        timed, timed_ns = counts.pop("record_engine"), counts.pop("record_engine_ns")
        entry["event_calls_per_step"] = {k: v / max(m.timer.steps, 1) for k, v in counts.items()}
        # One engine-thread record (wall, the event call alone): how much of the stages' time
        # is the device API's, not the timeline's Python.
        entry["record_us_per_call"] = timed_ns / timed / 1e3 if timed else 0.0
        return entry

    per_round: list[dict[str, Any]] = []
    for r in range(rounds):
        results = {m.name: measure(m, f"{r}") for m in modes}
        off = results[modes[0].name]
        for entry in results.values():
            entry["added_tracer_us_per_step"] = (
                entry["tracer_us_per_step"] - off["tracer_us_per_step"]
            )
            entry["added_tracer_cpu_us_per_step"] = (
                entry["tracer_cpu_us_per_step"] - off["tracer_cpu_us_per_step"]
            )
            entry["added_tracer_us_per_step_no_gc"] = (
                entry["tracer_us_per_step_no_gc"] - off["tracer_us_per_step_no_gc"]
            )
            entry["added_gc_us_per_step"] = entry["gc_us_per_step"] - off["gc_us_per_step"]
        per_round.append(results)
        _print_direct(results, off, f" (round {r + 1} of {rounds})" if rounds > 1 else "")
    results = per_round[-1] if rounds == 1 else _direct_medians(per_round, modes)
    return results


def _print_direct(results: dict[str, Any], off: dict[str, Any], title: str) -> None:
    print("measured directly around the tracer's calls on the engine thread (µs per step; "
          f"wrapper cost {off['wrapper_bias_ns_per_call']:.0f} ns wall, "
          f"{off['wrapper_bias_cpu_ns_per_call']:.0f} ns CPU per call subtracted; "
          "'in wait': the device timeline's poll just before the engine blocks on a busy "
          f"device, not counted in the others){title}:")  # fmt: skip
    print(f"{'mode':<16} {'wall us/step':>12} {'added':>7} {'cpu us/step':>11} {'added':>7} "
          f"{'in wait':>7}  event calls per step")  # fmt: skip
    for name, entry in results.items():
        calls = ", ".join(f"{k} {v:.2f}" for k, v in entry["event_calls_per_step"].items())
        print(f"{name:<16} {entry['tracer_us_per_step']:>12.1f} "
              f"{entry['added_tracer_us_per_step']:>+7.1f} {entry['tracer_cpu_us_per_step']:>11.1f} "
              f"{entry['added_tracer_cpu_us_per_step']:>+7.1f} {entry['in_wait_us_per_step']:>7.1f}"
              f"  {calls}; {entry['record_us_per_call']:.2f} us per record")  # fmt: skip
        top = list(entry["by_call_cpu_us_per_step"].items())[:7]
        print("    CPU: " + ", ".join(f"{k} {v:.1f}" for k, v in top))
        top = list(entry["by_call_us_per_step"].items())[:7]
        print("    wall: " + ", ".join(f"{k} {v:.1f}" for k, v in top))
        runs = entry["gc_collections_per_step"]
        print(f"    gc on the engine thread (inside the calls above or not): "
              f"{entry['gc_us_per_step']:.1f} us per step ({entry['added_gc_us_per_step']:+.1f}), "
              f"{entry['gc_in_calls_us_per_step']:.1f} of it inside them; without it the calls "
              f"add {entry['added_tracer_us_per_step_no_gc']:+.1f} us per step; collections per "
              f"step by generation {runs[0]:.3f} / {runs[1]:.3f} / {runs[2]:.4f}")  # fmt: skip


_DIRECT_KEYS = ("added_tracer_us_per_step", "added_tracer_cpu_us_per_step",
                "tracer_us_per_step", "tracer_cpu_us_per_step", "record_us_per_call",
                "gc_us_per_step", "added_gc_us_per_step", "gc_in_calls_us_per_step",
                "added_tracer_us_per_step_no_gc")  # fmt: skip


def _direct_medians(per_round: list[dict[str, Any]], modes: list[Mode]) -> dict[str, Any]:
    """Each mode's median over the rounds of the direct measurement's numbers (every round's
    kept under ``rounds``), printed as one table."""
    out: dict[str, Any] = {}
    print(f"measured directly, median of {len(per_round)} alternated rounds (min..max):")
    print(f"{'mode':<16} {'added wall us/step':>28} {'added cpu us/step':>28}  per round (wall; "
          "then without the collections inside the calls; collections added, all of the "
          "engine thread's)")  # fmt: skip
    for m in modes:
        rounds = [r[m.name] for r in per_round]
        entry: dict[str, Any] = {k: statistics.median(e[k] for e in rounds) for k in _DIRECT_KEYS}
        entry["rounds"] = rounds
        out[m.name] = entry
        wall = [e["added_tracer_us_per_step"] for e in rounds]
        cpu = [e["added_tracer_cpu_us_per_step"] for e in rounds]
        print(f"{m.name:<16} {statistics.median(wall):>+9.1f} ({min(wall):+.1f}..{max(wall):+.1f})"
              f"{'':>4} {statistics.median(cpu):>+9.1f} ({min(cpu):+.1f}..{max(cpu):+.1f})"
              f"{'':>4}  " + " / ".join(f"{w:+.1f}" for w in wall) + "; "
              + " / ".join(f"{e['added_tracer_us_per_step_no_gc']:+.1f}" for e in rounds) + "; "
              + " / ".join(f"{e['added_gc_us_per_step']:+.1f}" for e in rounds))  # fmt: skip
    return out


# (name, lane, stream, contiguous, followed by a sync event), as the runner records them
_STAGES = [("h2d_inputs", "copy", "h2d", False, True),
           ("input_prep", "compute", "compute", False, False),
           ("forward", "compute", "compute", True, False),
           ("sample", "compute", "compute", True, True),
           ("d2h_output", "copy", "d2h", False, True)]  # fmt: skip


def _micro_steps(
    tracer: Tracer,
    num_steps: int,
    finished_per_step: int,
    clock: Callable[[], int] = time.thread_time_ns,
    wait_s: float = 1e-4,
    output_ready: bool = False,
    inline_when_host_bound: bool = True,
    begins: str = "recorded",
) -> tuple[float, float]:
    """The tracer calls of ``num_steps`` engine steps (five CPU spans with the engine's args,
    the runner's once-per-step device-timeline hook and five device stages on three streams as
    the runner records them, the counters, and ``finished_per_step`` requests starting and ending
    per step); returns (ns per step, of which ns in the device timeline's poll just before the
    wait for the previous step's output) by ``clock`` (default: this thread's CPU time). Request bookkeeping runs whether tracing is on or not,
    as in the engine. The device stages run the CUDA path (``CudaClock``) over stand-in events
    (:class:`~instrument.device_events.StandInCudaEvent`, host-stamped, counting their calls);
    the simulated device completes step N-1 while step N is launched (async scheduling). The
    engine's wait for the previous step's output is a ``wait_s`` sleep (it releases the GIL, as
    the engine's blocking wait does; the timeline's background poller runs there, as in the
    runner), the same in every mode and not counted by ``clock``. ``output_ready`` (with
    ``wait_s=0``: a host-bound engine): every step's output is ready when the engine reaches
    its wait, so the wait never polls; ``inline_when_host_bound``: the timeline's policy then
    (False: wake the poller thread, the earlier policy); ``begins``: the timeline's ``begins``
    (the stages name what their stream waited for, as the runner's do)."""
    from engine.request_timeline import RequestTimeline
    from instrument.device_events import StandInCudaEvent, StandInStream
    from instrument.device_timeline import DeviceTimeline
    from instrument.schema import Counter

    streams = {name: StandInStream() for name in ("h2d", "compute", "d2h")}
    timeline = DeviceTimeline(
        tracer, 0, StandInCudaEvent.clock(), background=True,
        inline_when_host_bound=inline_when_host_bound, begins=begins,
    )  # fmt: skip
    requests = RequestTimeline(tracer, write_tracks=True)
    counters = tuple(c.value for c in Counter)
    values = tuple(0.5 for _ in counters)
    rid = 0
    launched: dict[str, int] = {}
    in_wait_ns = 0
    ready: deque[Any] = deque()  # the outputs' ready events, lent until their step is waited for

    def busy() -> bool:
        return output_ready

    start = clock()
    for step in range(num_steps):
        with tracer.span("schedule") as span:
            span.set_args(step=step, num_reqs=256, num_tokens=256, num_prefill=0,
                          num_decode=256, num_spec_tokens=0)  # fmt: skip
        timeline.poll_if_due()
        with tracer.span("prepare_inputs", step=step):
            pass
        with tracer.span("launch", step=step, flow_out=(1 << 32) + step):
            waited = None  # the stage the next stage's stream waits for (its after=)
            for name, lane, stream, contiguous, sync in _STAGES:
                with timeline.stage(
                    name,
                    step=step,
                    lane=lane,
                    stream=streams[stream],
                    contiguous=contiguous,
                    after=waited,
                ) as scope:
                    pass
                waited = scope if sync else None
                if sync:  # the runner's sync event after the stage (recorded when tracing is off)
                    event = timeline.event_after_stage(
                        streams[stream], StandInCudaEvent, wait_only=name != "d2h_output"
                    )
                    if name == "d2h_output":
                        ready.append(event)
        # The engine waits for the previous step, which the device is still running.
        wait0 = clock()
        timeline.poll_while_waiting(busy)
        in_wait_ns += clock() - wait0
        if wait_s:
            time.sleep(wait_s)  # blocked on the output: the GIL is free
        for name, s in streams.items():  # the device finishes the previous step
            s.num_done = launched.get(name, 0)
            launched[name] = s.num_recorded
        if len(ready) > 1:  # the previous step's output was waited for (AsyncOutput.get)
            timeline.give_back(ready.popleft())
        with tracer.span("wait_output", step=step, kind="sampled"):
            pass
        with tracer.span("update_from_output", step=step) as span:
            for _ in range(finished_per_step):
                req = f"r{rid}"
                rid += 1
                requests.arrived(req)
                requests.scheduled([req])
                requests.tokens(req, 128)
                requests.finished(req)
            span.set_args(num_accepted=0, num_rejected=0, num_finished=finished_per_step)
        if tracer.enabled:
            tracer.counter_values(counters, values)
    took = clock() - start
    for s in streams.values():
        s.advance()
    timeline.drain()
    if tracer.enabled and timeline.num_emitted != len(_STAGES) * num_steps:
        raise AssertionError(f"{timeline.num_emitted} device slices of {5 * num_steps}")
    return took / num_steps, in_wait_ns / num_steps


def event_calls_per_step(
    num_steps: int = 2000, begins: str = "recorded"
) -> dict[str, dict[str, float]]:
    """CUDA event API calls per engine step (stand-in events: the same calls a real
    ``torch.cuda.Event`` gets) in the micro benchmark's step loop, tracing off (the runner's own
    three sync events) and on (with the timeline's ``begins``)."""
    from instrument.device_events import StandInCudaEvent

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, tracer in (
            ("off", Tracer(enabled=False)),
            ("on", Tracer(os.path.join(tmp, "calls.pftrace"))),
        ):
            StandInCudaEvent.reset_calls()
            _micro_steps(tracer, num_steps, 0, begins=begins)
            out[name] = {k: v / num_steps for k, v in StandInCudaEvent.calls.items()}
            tracer.close()
    return out


def micro(
    writers: list[str], num_steps: int, rounds: int, trace_dir: str, begins: str = "recorded"
) -> dict[str, Any]:
    """CPU time per step the tracer adds, with no device and no model: the same step loop with
    tracing off and on (per writer, without and with two finished requests per step), alternated
    ``rounds`` times, minimum per configuration. ``engine_us``: CPU time of the looping (engine)
    thread; ``in_wait_us``: the part of it spent in the device timeline's poll just before the
    engine blocks on a step's output (on a device still busy with that step it costs no
    throughput); ``process_us``: CPU time of the whole process until the tracer has closed (the
    engine thread plus the flush thread: what competes for the GIL; a writer child process runs
    on another core). CPU time, not wall time: other processes on a shared machine do not count.
    Also the CUDA event calls per step (``event_calls``). ``begins``: the timeline's."""
    configs = [(f"off{'+requests' if fin else ''}", None, fin) for fin in (0, 2)] + [
        (f"{w}{'+requests' if fin else ''}", w, fin) for w in writers for fin in (0, 2)
    ]
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _, _ in configs}
    for r in range(rounds):
        for name, writer, finished in configs:
            if writer is None:
                tracer = Tracer(enabled=False)
            else:
                tracer = Tracer(os.path.join(trace_dir, f"micro_{name}_{r}.pftrace"), writer=writer)
            process0 = time.process_time_ns()
            loop_ns, in_wait_ns = _micro_steps(tracer, num_steps, finished, begins=begins)
            tracer.close()
            process1 = time.process_time_ns()
            times[name].append((loop_ns, in_wait_ns, (process1 - process0) / num_steps))
    out: dict[str, Any] = {}
    for name, _, finished in configs:
        base = times[f"off{'+requests' if finished else ''}"]
        mine = times[name]
        out[name] = {
            "engine_us_per_step": min(t[0] for t in mine) / 1e3,
            "added_engine_us_per_step": (min(t[0] for t in mine) - min(b[0] for b in base)) / 1e3,
            "in_wait_us_per_step": min(t[1] for t in mine) / 1e3,
            "added_process_us_per_step": (min(t[2] for t in mine) - min(b[2] for b in base)) / 1e3,
        }  # fmt: skip
    calls = event_calls_per_step(begins=begins)
    out["event_calls_per_step"] = calls
    print(f"tracer CPU cost per step (no device; {num_steps} steps, min of {rounds}; added "
          "engine-thread us (of which in the pre-wait poll) / whole-process us):")  # fmt: skip
    for name, v in out.items():
        if name != "event_calls_per_step" and not name.startswith("off"):
            print(f"    {name:<18} {v['added_engine_us_per_step']:+7.1f} "
                  f"({v['in_wait_us_per_step']:5.1f}) / {v['added_process_us_per_step']:+7.1f}")  # fmt: skip
    for name, c in calls.items():
        print(f"CUDA event calls per step, tracing {name} (stand-in events, the CUDA path): "
              + ", ".join(f"{k} {v:.2f}" for k, v in c.items()))  # fmt: skip
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _args import add_model_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--in-len", type=int, default=16)
    p.add_argument("--out-len", type=int, default=16)
    p.add_argument("--vocab", type=int, default=1000, help="prompt token ids below this")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3,
                   help="timed runs per mode (alternated); 0: none, only the direct measurement "
                   "(and the micro bench)")  # fmt: skip
    p.add_argument("--min-run-s", type=float, default=2.0, help="each timed run lasts this long")
    p.add_argument("--modes", default=DEFAULT_MODES, help="comma list of " + ",".join(MODES))
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument(
        "--micro-steps", type=int, default=5000, help="steps of the no-device micro benchmark"
    )
    p.add_argument(
        "--no-direct",
        dest="direct",
        action="store_false",
        help="skip the per-mode workloads that time the tracer's calls directly",
    )
    p.add_argument(
        "--direct-rounds",
        type=int,
        default=1,
        help="repeat the direct measurement this many times, the modes alternated (median and "
        "every round reported)",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after the rounds, one cProfile'd workload per mode: the N functions whose own time "
        "grew most over off (where the tracer's host time goes)",
    )
    p.add_argument(
        "--event-api",
        choices=("auto", "driver", "driver-held", "torch"),
        default="auto",
        help="CUDA: which calls the device timeline records, queries and reads its events with "
        "(CudaClock.calibrate's api; auto = the driver's if they pass their start-up self-test; "
        "driver-held = the driver's, the poller's queries and conversions keeping the GIL: "
        "no driver-lock contention with the engine thread's records and launches)",
    )
    p.add_argument("--poll-chunk", type=int, default=None, metavar="N",
                   help="--interleaved: stages the poller thread emits per stretch before it "
                   "sleeps (instrument.device_timeline.POLL_CHUNK; default: the engine's)")  # fmt: skip
    p.add_argument("--poll-batch", type=int, default=None, metavar="N",
                   help="--interleaved: pending stages at which the engine's wait polls "
                   "(DeviceTimeline.poll_batch, at most its max_deferred; default: the engine's, "
                   "instrument.device_timeline.POLL_BATCH)")  # fmt: skip
    p.add_argument("--max-deferred", type=int, default=None, metavar="N",
                   help="--interleaved: pending stages at which the engine's once-a-step hook "
                   "polls (or wakes the poller) without waiting (DeviceTimeline.max_deferred, at "
                   "least --poll-batch; default: the engine's, MAX_DEFERRED)")  # fmt: skip
    p.add_argument("--poll", choices=("auto", "background", "inline", "wait"), default="auto",
                   help="--interleaved: where the device timeline's polls run: auto = the "
                   "engine's policy (the poller thread while the engine waits, the engine thread "
                   "when its outputs are ready: host-bound); background = always the poller "
                   "thread (the earlier policy); inline = always the engine thread; wait = the "
                   "engine thread at its wait, in chunks, only while the output is not ready "
                   "(DeviceTimeline.in_wait)")  # fmt: skip
    p.add_argument("--flush-interval", type=float, default=None, metavar="S",
                   help="--interleaved: the tracer's flush thread wakes every S seconds from the "
                   "timed run on (default: the tracer's 0.5); a long one keeps the flush thread "
                   "quiet through the run (its events are buffered and written at close)")  # fmt: skip
    p.add_argument("--order-seed", type=int, default=None, metavar="N",
                   help="--interleaved: draw each block pair's order (traced or untraced first) "
                   "at random from seed N instead of alternating; vary N between runs so that "
                   "a workload's recurring expensive steps do not land in the same kind of block "
                   "every run")  # fmt: skip
    p.add_argument("--order-invert", action="store_true",
                   help="--interleaved: every block pair's order the other way round (a "
                   "crossover: with a deterministic workload, two runs, one inverted, trace each "
                   "step in exactly one of them)")  # fmt: skip
    p.add_argument("--save-samples", action="store_true",
                   help="--interleaved: write every call's sample (times, phases, faults, "
                   "requests, finished) to the JSON as columns, for estimators tried later")  # fmt: skip
    p.add_argument("--control", action="store_true",
                   help="--interleaved: an A/A control, the tracer off in every block (blocks "
                   "still labelled by the order): the difference the order and the workload "
                   "make without any tracing")  # fmt: skip
    p.add_argument(
        "--interleaved",
        action="store_true",
        help="instead of the rounds: per traced mode, one engine run with tracing switched on "
        "and off every --block-steps steps for --min-run-s (bench/_interleaved.py): traced vs "
        "untraced host / CPU / wall us per step of the same run, with per-pair spread",
    )
    p.add_argument("--block-steps", type=int, default=64, help="--interleaved: steps per block")
    p.add_argument(
        "--skip-steps",
        type=int,
        default=4,
        help="--interleaved: first steps of each block left out (spill across a switch)",
    )
    p.add_argument(
        "--time-records",
        action="store_true",
        help="--interleaved: also time every device-timeline event record on the engine thread "
        "(wall; records a step and us per record, traced vs untraced: how much of the added "
        "host time is the event calls; adds a frame and two clock reads per record)",
    )
    p.add_argument(
        "--time-driver-reads",
        action="store_true",
        help="--interleaved, CUDA: also time the device timeline's reads, on whichever thread "
        "polls: each cuEventElapsedTime call (the ctypes call alone) and each end-event query "
        "(its Python too, ~0.3 us); wall time, so with --event-api driver it includes waiting "
        "for the GIL after the call and with driver-held it does not",
    )
    p.add_argument(
        "--trace-begins",
        choices=("recorded", "derived", "both"),
        default="derived",
        help="the traced modes' `stepscope run --trace-begins` (and the micro benchmark's "
        "timeline): device slice begins recorded as events, derived (no begin event: a lower "
        "bound) or both (to measure the bound with bench/bench_derived_begins.py)",
    )
    p.add_argument("engine_args", nargs="*", help="more `stepscope run` flags, after --")
    args = p.parse_args(argv)
    if (args.model is None) == (args.model_config is None):
        args.model = "samples/models/pycoder-14m"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    names = args.modes.split(",")
    if names[0] != "off" or any(n not in MODES for n in names):
        raise SystemExit(f"--modes must start with off and name only {list(MODES)}")
    trace_dir = tempfile.mkdtemp(prefix="stepscope-overhead-")
    if args.interleaved:
        return interleaved(args, names[1:], trace_dir)
    micro_result = micro(["thread", "process"], args.micro_steps, 3, trace_dir, args.trace_begins)
    event_costs: dict[str, Any] = {}
    if args.device.startswith("cuda"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _event_cost import event_call_costs, print_costs

        from instrument.device_events import CudaClock

        CudaClock.DEFAULT_API = args.event_api
        try:  # a side measurement: its failure must not cost the run
            event_costs = event_call_costs()
            print_costs(event_costs)
        except Exception as exc:  # noqa: BLE001 -- printed and kept in the JSON
            event_costs = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"CUDA event call costs not measured: {event_costs['error']}")
    modes = [build_mode(n, args, trace_dir) for n in names]
    event_api = {}
    for m in modes:
        tl = m.llm.engine.runner.timeline
        ops = tl.ops
        event_api[m.name] = (
            f"{getattr(ops, 'api', type(ops).__name__)} {getattr(ops, 'api_reason', '')}; "
            f"stage core {tl.core} {tl.core_reason}"
            + ("; polls build slices in C" if tl.compiled_emit else "")
        )
        print(f"{m.name}: device timeline event calls: {event_api[m.name]}")
    seeds = iter(range(1, 1 << 30))
    # Warm-up: one workload per mode; it also sizes a timed run (workload repeats per run).
    warm = workload(args, next(seeds))
    warm_s = []
    for m in modes:
        start = time.perf_counter()
        m.llm.run_workload(warm)
        warm_s.append(time.perf_counter() - start)
    repeats = max(1, -(-args.min_run_s // max(min(warm_s), 1e-3)))
    print(f"warm-up {min(warm_s):.2f} s per workload: {int(repeats)} workload(s) per timed run")
    mismatches: list[dict[str, Any]] = []
    for r in range(args.rounds):
        round_workloads = [workload(args, next(seeds)) for _ in range(int(repeats))]
        for m in modes:
            m.runs.append(timed_run(m, round_workloads))
        _sync(args.device)
        # Which requests differ, where (the digests only say that some do).
        for m in modes[1:]:
            diff = token_differences(modes[0].tokens, m.tokens)
            if diff:
                mismatches.append({"round": r + 1, "mode": m.name, "num_differ": len(diff),
                                   "first": diff[:5]})  # fmt: skip
                print(f"round {r + 1}: {m.name} differs from {modes[0].name} in {len(diff)} "
                      f"requests, first: {diff[:3]}")  # fmt: skip
        for m in modes:
            m.tokens = {}
    direct_result = (
        direct(modes, workload(args, next(seeds)), args.direct_rounds) if args.direct else {}
    )
    profiles = (
        profile_modes(modes, workload(args, next(seeds)), args.profile) if args.profile else {}
    )
    for m in modes:
        m.llm.close()
        if m.tracer is not None:
            m.tracer.close()
    if args.out:  # the raw runs first: a failing report loses nothing
        with open(args.out, "w") as f:
            json.dump({m.name: m.runs for m in modes}, f, indent=2)
    # --rounds 0: the direct measurement (and the micro bench) alone, no end-to-end runs.
    result = report(modes) if args.rounds else {"modes": {}}
    result["token_mismatches"] = mismatches
    result["direct"] = direct_result
    result["micro"] = micro_result
    result["profile"] = profiles
    result["event_costs"] = event_costs
    result["event_api"] = event_api
    result["config"] = vars(args) | {"repeats_per_run": int(repeats), "trace_dir": trace_dir}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _helper_threads(timeline: Any, tracer: Any, inter: Any) -> dict[str, float]:
    """The CPU time of the tracer's own threads (the device timeline's poller, the flush thread)
    over the run, per traced step: what a traced step costs the process besides the engine
    thread (each thread counts its own time: ``thread_time_ns`` around its polls, its flushes)."""
    from instrument.device_timeline import POLL_SECTIONS

    traced = sum(1 for s in inter.samples if s.traced)
    row: dict[str, Any] = {
        "traced_steps": traced,
        "poller_us_per_traced_step": timeline.poller_cpu_ns / 1e3 / max(1, traced),
        "poller_wall_us_per_traced_step": timeline.poller_wall_ns / 1e3 / max(1, traced),
        "flush_us_per_traced_step": tracer.flush_cpu_ns / 1e3 / max(1, traced),
    }
    print(f"tracer threads' CPU per traced step (all {traced} traced steps): poller "
          f"{row['poller_us_per_traced_step']:.1f} us (wall "
          f"{row['poller_wall_us_per_traced_step']:.1f}), flush thread "
          f"{row['flush_us_per_traced_step']:.1f} us")  # fmt: skip
    sections = timeline.poll_sections_ns
    if sections is not None:  # every poll, on whichever thread it ran
        named = dict(zip(POLL_SECTIONS, sections, strict=True))
        stages, events, queries = named.pop("stages"), named.pop("events"), named.pop("queries")
        row["poll_sections"] = named | {"stages": stages, "events": events, "queries": queries}
        print(f"the polls' CPU per stage ({stages} stages, {events / max(1, stages):.2f} events "
              f"converted and {queries / max(1, stages):.2f} end events queried a stage): "
              + ", ".join(
                  f"{k} {v / 1e3 / max(1, stages):.2f} us" for k, v in named.items()))  # fmt: skip
    return row


def _time_driver_reads(timeline: Any) -> dict[str, int]:
    """``--time-driver-reads``: wrap the timeline's end-event query and its driver's
    ``cuEventElapsedTime`` with wall clocks (left wrapped: the engine is closed after its run).
    Graph stamps' queries are memory reads, not driver calls: counted apart, untimed."""
    from instrument.graph_stamps import StampEvent

    driver = getattr(timeline.ops, "driver", None)
    if driver is None:
        raise SystemExit("--time-driver-reads needs the CUDA driver's event calls (--event-api)")
    totals = {"elapsed_calls": 0, "elapsed_ns": 0, "query_calls": 0, "query_ns": 0,
              "stamp_queries": 0}  # fmt: skip
    clock, elapsed, query = time.perf_counter_ns, driver._elapsed_fn, timeline._query

    def timed_elapsed(ref: Any, start: int, end: int) -> int:
        t0 = clock()
        code = elapsed(ref, start, end)
        totals["elapsed_ns"] += clock() - t0
        totals["elapsed_calls"] += 1
        return int(code)

    def timed_query(event: Any) -> bool:
        if type(event) is StampEvent:
            totals["stamp_queries"] += 1
            return bool(query(event))
        t0 = clock()
        done = query(event)
        totals["query_ns"] += clock() - t0
        totals["query_calls"] += 1
        return bool(done)

    driver._elapsed_fn, timeline._query = timed_elapsed, timed_query
    # One call at a time through the wrapper: the compiled core's loop (one C call per poll)
    # would go around it.
    driver.use_compiled(None)
    return totals


def _print_driver_reads(totals: dict[str, int]) -> dict[str, float]:
    """The per-call wall times ``_time_driver_reads`` summed, printed and returned."""
    row = {
        "elapsed_calls": totals["elapsed_calls"],
        "elapsed_us_per_call": totals["elapsed_ns"] / 1e3 / max(1, totals["elapsed_calls"]),
        "query_calls": totals["query_calls"],
        "query_us_per_call": totals["query_ns"] / 1e3 / max(1, totals["query_calls"]),
        "stamp_queries": totals["stamp_queries"],
    }
    print(f"driver reads (wall, every poll of the run): {row['elapsed_calls']} "
          f"cuEventElapsedTime calls, {row['elapsed_us_per_call']:.2f} us each; "
          f"{row['query_calls']} end-event queries, {row['query_us_per_call']:.2f} us each "
          f"({row['stamp_queries']} graph-stamp queries apart)")  # fmt: skip
    return row


def interleaved(args: argparse.Namespace, names: list[str], trace_dir: str) -> dict[str, Any]:
    """``--interleaved``: per traced mode, one engine warmed up, then run for ``--min-run-s`` with
    tracing switched every ``--block-steps`` steps (``bench/_interleaved.py``); one table per
    mode, and the JSON (every step's sample left out; per-pair differences kept) to ``--out``."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _interleaved import (
        Interleaver,
        attribute,
        print_attribution,
        print_summary,
        profile_diff,
        samples_table,
        summarize,
    )

    from instrument import device_timeline

    if not names:
        raise SystemExit("--interleaved needs a traced mode in --modes (e.g. off,trace)")
    if args.device.startswith("cuda"):
        from instrument.device_events import CudaClock

        CudaClock.DEFAULT_API = args.event_api
    seeds = iter(range(1, 1 << 30))
    results: dict[str, Any] = {}
    out: dict[str, Any] = {}
    for name in names:
        mode = build_mode(name, args, trace_dir)
        assert mode.tracer is not None
        timeline = mode.llm.engine.runner.timeline
        if args.poll_chunk is not None:
            if args.poll_chunk < 1:
                raise SystemExit("--poll-chunk must be >= 1")
            device_timeline.POLL_CHUNK = args.poll_chunk  # read by the poller at each stretch
        batch = timeline.poll_batch if args.poll_batch is None else args.poll_batch
        deferred = timeline.max_deferred if args.max_deferred is None else args.max_deferred
        if not 1 <= batch <= deferred <= timeline._max_pending:
            raise SystemExit(f"need 1 <= --poll-batch ({batch}) <= --max-deferred ({deferred}) "
                             f"<= {timeline._max_pending}")  # fmt: skip
        timeline.poll_batch, timeline.max_deferred = batch, deferred
        timeline._inline_limit = max(deferred, timeline._max_pending // 2)  # as __init__ sets it
        print(f"{name}: poller chunk {device_timeline.POLL_CHUNK} stages, polls at "
              f"{timeline.poll_batch} pending at a wait, {timeline.max_deferred} otherwise")  # fmt: skip
        if args.poll == "wait":
            timeline.in_wait = True
        elif args.poll != "auto":  # auto: the engine's own policy
            timeline.background = args.poll == "background"
            timeline.inline_when_host_bound = False
        timeline.poll_sections_ns = [0] * len(device_timeline.POLL_SECTIONS)
        ops = timeline.ops
        print(f"{name}: device timeline event calls: {getattr(ops, 'api', type(ops).__name__)} "
              f"{getattr(ops, 'api_reason', '')}; stage core {timeline.core} "
              f"{timeline.core_reason}"
              + ("; polls build slices in C" if timeline.compiled_emit else ""))  # fmt: skip
        mode.llm.run_workload(workload(args, next(seeds)))  # warm-up
        reads = _time_driver_reads(timeline) if args.time_driver_reads else None
        inter = Interleaver(mode.llm.engine, mode.tracer, args.block_steps, args.skip_steps)
        inter.time_records = args.time_records
        inter.order_seed, inter.control = args.order_seed, args.control
        inter.invert = args.order_invert
        if args.control:
            print(f"{name}: A/A control: the tracer stays off in every block")
        # The helper threads' working intervals, for ``attribute`` (a clock read and an append
        # per poller wake-up and per flush).
        timeline.busy_log, mode.tracer.flush_log = [], []
        if args.flush_interval is not None:
            if args.flush_interval <= 0:
                raise SystemExit("--flush-interval must be > 0")
            # read by the flush thread at each of its waits: in effect after the current one
            mode.tracer._flush_interval_s = args.flush_interval
        start = time.perf_counter()
        with inter.install():
            while True:  # at least one workload
                mode.llm.run_workload(workload(args, next(seeds)))
                if time.perf_counter() - start >= args.min_run_s:
                    break
        _sync(args.device)
        result = summarize(inter.samples)
        traced_steps = max(1, sum(1 for s in inter.samples if s.traced))
        result["polls"] = {"inline": timeline.polls_inline, "woken": timeline.polls_woken,
                           "in_wait": timeline.polls_in_wait, "policy": args.poll,
                           "in_wait_cpu_us_per_traced_step":
                               timeline.wait_poll_cpu_ns / 1e3 / traced_steps,
                           "in_wait_wall_us_per_traced_step":
                               timeline.wait_poll_wall_ns / 1e3 / traced_steps,
                           "in_wait_overrun_us_per_traced_step":
                               timeline.wait_poll_overrun_ns / 1e3 / traced_steps}  # fmt: skip
        print(f"{name}: device timeline polls due: {timeline.polls_inline} on the engine thread, "
              f"{timeline.polls_woken} handed to the poller thread, {timeline.polls_in_wait} on "
              f"the engine thread while its output was not ready (--poll {args.poll})")  # fmt: skip
        if timeline.polls_in_wait:
            p = result["polls"]
            print(f"{name}: in-wait polls per traced step: CPU "
                  f"{p['in_wait_cpu_us_per_traced_step']:.1f} us, wall "
                  f"{p['in_wait_wall_us_per_traced_step']:.1f} us, of which past the output's "
                  f"readiness at most {p['in_wait_overrun_us_per_traced_step']:.1f} us")  # fmt: skip
        result["helper_threads"] = _helper_threads(timeline, mode.tracer, inter)
        if reads is not None:
            result["driver_reads"] = _print_driver_reads(reads)
        result["elapsed_s"] = time.perf_counter() - start
        print_summary(name, result, args.block_steps, args.skip_steps)
        busy = {"poller": timeline.busy_log, "flush": mode.tracer.flush_log}
        timeline.busy_log = mode.tracer.flush_log = None
        result["attribution"] = attribute(inter.samples, busy)
        print_attribution(result["attribution"])
        if args.save_samples:
            result["samples"] = samples_table(inter.samples)
        if args.profile:
            result["profile"] = _interleaved_profile(mode, args, seeds, profile_diff)
        mode.llm.close()
        mode.tracer.close()
        results[name] = result
        out = {"interleaved": results, "config": vars(args) | {"trace_dir": trace_dir}}
        if args.out:  # after every mode: a run cut short by a time limit keeps what it measured
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(out, f, indent=2)
    return out


def _interleaved_profile(
    mode: Mode, args: argparse.Namespace, seeds: Any, profile_diff: Any
) -> list[tuple[str, float]]:
    """``--interleaved --profile N``: one more workload, switched the same way, cProfile'd per
    block kind; prints the N functions whose own time per step grew most when traced."""
    import cProfile

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _interleaved import Interleaver

    profilers = {True: cProfile.Profile(), False: cProfile.Profile()}
    inter = Interleaver(mode.llm.engine, mode.tracer, args.block_steps, args.skip_steps)
    inter.profilers = profilers
    with inter.install():
        mode.llm.run_workload(workload(args, next(seeds)))
    rows = profile_diff(profilers, inter.profiled_steps, args.profile)
    print(f"cProfile, traced minus untraced blocks, own time per decode step (us; "
          f"{inter.profiled_steps[True]} / {inter.profiled_steps[False]} steps; engine thread "
          "only on Python < 3.12):")  # fmt: skip
    for fn, us in rows:
        print(f"  {us:8.1f}  {fn}")
    return rows


def profile_modes(modes: list[Mode], work: list[Any], top: int) -> dict[str, Any]:
    """One workload per mode under cProfile; per traced mode the ``top`` functions whose own time
    per step grew most over ``off`` (µs per step, inflated by cProfile alike in every mode: read
    the differences). Python < 3.12: the engine thread only. Python >= 3.12 (cProfile on
    ``sys.monitoring``): every thread, so the tracers' flush threads show up too (their pickling,
    and ``lock.acquire`` = ``Event.wait`` between flushes, idle time that is no engine cost);
    ``direct`` measures the engine thread alone."""
    import cProfile
    import pstats

    per_step: dict[str, dict[str, float]] = {}
    for m in modes:
        m.timer.steps = 0
        prof = cProfile.Profile()
        prof.enable()
        m.llm.run_workload([dataclasses.replace(w, id=f"p-{m.name}-{w.id}") for w in work])
        prof.disable()
        steps = max(m.timer.steps, 1)
        stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        per_step[m.name] = {
            f"{k[0].rsplit('/', 2)[-1]}:{k[1]}({k[2]})": v[2] / steps * 1e6
            for k, v in stats.items()
        }
    base = per_step[modes[0].name]
    out: dict[str, Any] = {}
    if sys.version_info >= (3, 12):
        print("cProfile (Python >= 3.12) sees every thread: flush threads' pickling and "
              "lock.acquire (Event.wait, idle) are not on the engine thread")  # fmt: skip
    for m in modes[1:]:
        grown = {f: t - base.get(f, 0.0) for f, t in per_step[m.name].items()}
        rows = sorted(grown.items(), key=lambda kv: -kv[1])[:top]
        out[m.name] = rows
        print(f"cProfile, {m.name} minus off, own time per step (us):")
        for name, us in rows:
            print(f"  {us:8.1f}  {name}")
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
