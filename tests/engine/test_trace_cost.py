"""The Python work tracing adds to an engine step, counted rather than timed (docs/design.md §4.9).

Timings of the tracer's cost on a shared machine move by tens of µs between identical runs; the
number of bytecodes the engine thread executes per step does not. One CPU engine run, tracing
switched on and off every 8 iterations (as ``bench_trace_overhead.py --interleaved`` does), every
steady decode iteration's bytecodes counted on the engine thread (``sys.settrace`` opcode events;
C calls such as an event record count as one call instruction).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import pytest

from bench.poll_cost import count_opcodes as _count_opcodes
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from instrument import native
from instrument.tracer import Tracer
from tests.engine.test_spec_graphs import _force_spec_graphs

# Added bytecodes per steady decode iteration, traced minus untraced (medians), measured on this
# tree: 1,009 (1,012 before the kv_usage counter read lost a property frame; 1,121 before the
# engine's six CPU spans became two plain calls each,
# ``Tracer.span_begin``/``span_end``, docs/design.md §4.9; 1,392 before stage sites, §4.3; 1,383
# before the stages named the stage their stream waits for, ``after=``; 1,503 before
# CpuEvent.record and the graph_replay lookup were trimmed). The shares: the five device stages'
# entries and exits (~465, ~93 each), the five CpuEvent.record calls the stages add (240: the CPU
# device's Python; one driver call each on CUDA), the six CPU spans (~130), the span args and
# counters (~130), the stages' sync events (~30).
MAX_ADDED_BYTECODES = 1060
# The same with derived device begins (--trace-begins derived, docs/design.md §4.3): 874
# measured (877 before that frame, 986 before the span calls, 1,260 before stage sites); three begin records fewer, a
# host clock read and a store more per such stage.
MAX_ADDED_BYTECODES_DERIVED = 920
# Derived begins with the forward replayed from a CUDA graph and graph stamps (what a traced H200
# decode step runs, the CPU device's HostStamps standing in): 748 measured (765 before the
# counter frame and the stamped forward's graph lookup went, 918 before the span calls);
# input_prep and the forward end at stamps, so two end records fewer.
MAX_ADDED_BYTECODES_STAMPED = 790
# With the compiled stage core (instrument/_stagecore.c, docs/design.md §4.3) the stages, their
# sync events, give_back, the two poll hooks and the spans' ends are C calls: 232 measured with
# recorded begins (the CPU device's five CpuEvent.record calls, Python here, one driver call on
# CUDA) and -22 as a traced H200 decode step runs (derived begins, stamped forward): fewer than
# untraced, whose three sync events the timeline records through its Python path. (358 and 104
# before the spans' ends were compiled.) A bound only: a C call counts as one instruction.
MAX_ADDED_BYTECODES_C = 250
MAX_ADDED_BYTECODES_STAMPED_C = 20


# The wait's poll batch in these runs. They last ~60-120 steps of 5 stages: at the engine's
# default (POLL_BATCH, 128 stages: a poll every ~25 steps) the event pool is still growing and the
# pending stages still piling up through most of the counted steps. At 64 both settle early, as
# they do in a long run at the default; the work a steady step adds is the same at either batch.
TEST_POLL_BATCH = 64


def _tiny_llm(tracer: Tracer, model_config: Any, **engine_kw: Any) -> LLM:
    llm = LLM(
        tracer=tracer,
        model_config=model_config,
        random_weights=True,
        num_kv_blocks=128,
        max_num_seqs=4,
        **engine_kw,
    )
    llm.engine.runner.timeline.poll_batch = TEST_POLL_BATCH
    return llm


def _generate_counted(
    llm: LLM,
    tracer: Tracer,
    step: Callable[[], Any],
    schedule: Callable[[], Any],
    max_tokens: int,
) -> None:
    """Four greedy requests with the engine's ``run_step`` and its scheduler's ``schedule``
    replaced by the counting wrappers; both restored, the engine and tracer closed after."""
    engine = llm.engine
    run_step, original_schedule = engine.run_step, engine.scheduler.schedule
    engine.run_step, engine.scheduler.schedule = step, schedule
    prompts = [[(5 * i + j) % 120 + 2 for j in range(8)] for i in range(4)]
    try:
        llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        )
    finally:
        engine.run_step, engine.scheduler.schedule = run_step, original_schedule
        tracer.enabled = True
        llm.close()
        tracer.close()


@pytest.mark.parametrize(
    ("core", "begins", "graphs", "bound"),
    [
        ("python", "recorded", False, MAX_ADDED_BYTECODES),
        ("python", "derived", False, MAX_ADDED_BYTECODES_DERIVED),
        ("python", "derived", True, MAX_ADDED_BYTECODES_STAMPED),
        ("c", "recorded", False, MAX_ADDED_BYTECODES_C),
        ("c", "derived", True, MAX_ADDED_BYTECODES_STAMPED_C),
    ],
)
def test_tracing_adds_a_bounded_number_of_bytecodes_per_step(
    tmp_path, tiny_model_config, monkeypatch, core, begins, graphs, bound
):
    monkeypatch.setattr(native, "DEFAULT_CORE", core)
    if graphs:
        _force_spec_graphs(monkeypatch, {"cuda_graphs"})
    tracer = Tracer(str(tmp_path / "t.pftrace"))
    llm = _tiny_llm(tracer, tiny_model_config, trace_begins=begins)
    engine = llm.engine
    assert (engine.runner.fwd.graphs.stamps is not None) == graphs  # the stamped forward
    assert engine.runner.timeline.core == core
    run_step, schedule = engine.run_step, engine.scheduler.schedule
    counts: dict[bool, list[int]] = {True: [], False: []}
    calls = 0
    decode = [False, False]  # this iteration's and the previous one's schedule: decode only

    def counted_schedule() -> Any:
        so = schedule()
        decode[1] = 0 < so.num_reqs == so.total_num_scheduled_tokens
        return so

    def counted_step() -> Any:
        nonlocal calls
        traced = (calls // 8) % 2 == 0
        steady = calls % 8 >= 2 and decode[1]  # past the switch's spill, after a decode step
        calls += 1
        tracer.enabled = traced
        decode[0], decode[1] = decode[1], False
        if not steady:
            return run_step()
        out, n = _count_opcodes(run_step)
        if decode[1]:
            counts[traced].append(n)
        return out

    _generate_counted(llm, tracer, counted_step, counted_schedule, max_tokens=60)
    assert len(counts[True]) >= 10 and len(counts[False]) >= 10, counts
    added = statistics.median(counts[True]) - statistics.median(counts[False])
    print(f"{core} core, {begins} begins, stamped {graphs}: {added} added bytecodes a step")
    assert (0 if core == "python" else -200) < added <= bound, (
        f"tracing ({core} core, {begins} begins) adds {added} bytecodes per steady decode step on the engine "
        f"thread (bound {bound}): new per-step Python work on the traced hot path?"
    )


# The device timeline's poll, per slice it emits (derived begins, the default; on CUDA it runs on
# the poller thread, where it holds the GIL the engine thread wants: bench/README.md session 16):
# 196 measured on this tree (208 before the completed stages were popped in one C-level loop,
# 241 before the derived begins moved into the emit pass). That is the Python slice loop (the
# Python core's, and the compiled core's with STEPSCOPE_COMPILED_EMIT=0); the compiled core's
# default builds the slices in C: 33 measured (session 19).
MAX_POLL_BYTECODES_PER_SLICE = {False: 215, True: 45}


@pytest.mark.parametrize("compiled_emit", [False, True], ids=["python-loop", "compiled-emit"])
def test_the_poll_emits_a_slice_in_a_bounded_number_of_bytecodes(
    tmp_path, tiny_model_config, monkeypatch, compiled_emit
):
    from instrument import device_timeline

    monkeypatch.setattr(device_timeline, "COMPILED_EMIT", compiled_emit)
    tracer = Tracer(str(tmp_path / "t.pftrace"))
    llm = _tiny_llm(tracer, tiny_model_config, trace_begins="derived")
    timeline = llm.engine.runner.timeline
    poll = timeline.poll
    totals = {"bytecodes": 0, "slices": 0}

    def counted_poll(limit: int | None = None) -> int:
        n, count = _count_opcodes(lambda: poll(limit))
        totals["bytecodes"] += count
        totals["slices"] += n
        return n

    timeline.poll = counted_poll  # whichever thread polls (the poller, or the engine inline)
    prompts = [[(5 * i + j) % 120 + 2 for j in range(8)] for i in range(4)]
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    finally:
        llm.close()
        tracer.close()
    assert totals["slices"] >= 50, totals
    per_slice = totals["bytecodes"] / totals["slices"]
    assert timeline.compiled_emit == (compiled_emit and timeline.core == "c")
    bound = MAX_POLL_BYTECODES_PER_SLICE[timeline.compiled_emit]
    assert per_slice <= bound, (
        f"the poll takes {per_slice:.0f} bytecodes per slice it emits "
        f"(bound {bound}): new per-stage Python in the poll?"
    )


# A step a sampled trace drops costs what an untraced step costs, but for asking the capture rule
# (``Tracer.trace_step``, once per step: ~48) and pausing / resuming the tracer around the step's
# two phases (~68), less the untraced iteration's own call of the rule (~19): measured 103 added
# bytecodes per steady decode iteration on this tree, where a kept step adds ~1,140.
MAX_DROPPED_EXTRA_BYTECODES = 120


def test_a_dropped_step_costs_what_an_untraced_step_costs(tmp_path, tiny_model_config, monkeypatch):
    """``--trace-every``: the engine thread skips the tracer's work on the steps the trace drops
    (docs/design.md §4.9). Tracing switched on and off every 8 iterations; in traced blocks runs
    of 4 steps are kept, one run in 2. An iteration counts as dropped (kept) when both steps it
    works on, the one it schedules and the one it retires, are dropped (kept)."""
    from instrument.capture import CaptureConfig

    # The Python core: a kept step's stages are Python work there, which the bound below reads.
    monkeypatch.setattr(native, "DEFAULT_CORE", "python")
    tracer = Tracer(str(tmp_path / "t.pftrace"), capture=CaptureConfig(every=2, run_length=4))
    llm = _tiny_llm(tracer, tiny_model_config)
    engine = llm.engine
    run_step, schedule = engine.run_step, engine.scheduler.schedule
    counts: dict[str, list[int]] = {"kept": [], "dropped": [], "untraced": []}
    calls = 0
    decode = [False, False]
    skipped = [False, False]  # the step scheduled in this iteration / the one before: dropped

    def counted_schedule() -> Any:
        so = schedule()
        decode[1] = 0 < so.num_reqs == so.total_num_scheduled_tokens
        skipped[1] = tracer.paused  # the engine paused the tracer for this step's phase
        return so

    def counted_step() -> Any:
        nonlocal calls
        traced = (calls // 8) % 2 == 0
        steady = calls % 8 >= 2 and decode[1]
        calls += 1
        tracer.enabled = traced
        decode[0], decode[1] = decode[1], False
        skipped[0], skipped[1] = skipped[1], False
        if not steady:
            return run_step()
        out, n = _count_opcodes(run_step)
        if decode[1]:
            if not traced:
                counts["untraced"].append(n)
            elif skipped[0] == skipped[1]:  # retired and scheduled step: both dropped, or kept
                counts["dropped" if skipped[1] else "kept"].append(n)
        return out

    _generate_counted(llm, tracer, counted_step, counted_schedule, max_tokens=100)
    assert all(len(v) >= 5 for v in counts.values()), {k: len(v) for k, v in counts.items()}
    untraced = statistics.median(counts["untraced"])
    dropped = statistics.median(counts["dropped"]) - untraced
    kept = statistics.median(counts["kept"]) - untraced
    assert 0 < dropped <= MAX_DROPPED_EXTRA_BYTECODES, (dropped, kept)
    assert kept > 5 * MAX_DROPPED_EXTRA_BYTECODES, (dropped, kept)  # a kept step is traced


# Objects the cyclic collector counts (tuples, dicts, instances) a traced step leaves alive, on
# average, beyond an untraced step's, each step's stages emitted in its own window (the device
# synchronised and polled in it): 4.65–4.71 measured (4 runs, session 21) with derived begins and
# the stamped forward. Before session 21 the polls landed wherever 128 stages had pended, so some
# windows were credited with freeing earlier steps' stage objects and others were not: 10.1–11.5
# (8 runs; 19.8 before the tracer's buffer became flat and the device stages' slices lost their
# dicts, docs/design.md §4.9 "Flat buffer"). What is left includes the schedule, update and
# forward args dicts and the counter values' tuple (a dict of plain values is not tracked, but
# its allocation still counts towards a gen-0 collection). Every one held until the next flush
# counts towards a gen-0 collection, and what a collection finds alive is promoted.
MAX_ADDED_GC_OBJECTS = 7


def test_a_traced_step_leaves_few_objects_for_the_collector(
    tmp_path, tiny_model_config, monkeypatch
):
    """The collector's gen-0 count (allocations less deallocations of container objects), with
    collections off, per steady engine iteration, traced vs untraced in alternate blocks of 8; the
    flush interval longer than the run, so the buffer holds everything traced (its worst case)."""
    import gc

    _force_spec_graphs(monkeypatch, {"cuda_graphs"})
    tracer = Tracer(str(tmp_path / "t.pftrace"), flush_interval_s=1000.0)
    llm = _tiny_llm(tracer, tiny_model_config, trace_begins="derived")
    engine = llm.engine
    # Polls on the engine thread, inside the counted steps: the collector's count is global, and a
    # poller thread's allocations landing in one window or the next made the mean move by ±2.
    timeline = engine.runner.timeline
    timeline.background = False
    run_step = engine.run_step
    counts: dict[bool, list[int]] = {True: [], False: []}
    calls = 0

    def counted_step() -> Any:
        nonlocal calls
        traced = (calls // 8) % 2 == 0
        steady = calls % 8 >= 2
        calls += 1
        tracer.enabled = traced
        before = gc.get_count()[0]
        out = run_step()
        # The step's stages emitted inside its own window: where a poll lands would otherwise
        # decide which step the stages' deallocations are credited to (an untraced block's
        # first waits poll what the traced block left: DeviceTimeline._untraced_gap).
        engine.device.synchronize()
        timeline.poll()
        if steady:
            counts[traced].append(gc.get_count()[0] - before)
        return out

    gc.collect()
    gc.disable()
    try:
        _generate_counted(llm, tracer, counted_step, engine.scheduler.schedule, max_tokens=120)
    finally:
        gc.enable()
    assert len(counts[True]) >= 40 and len(counts[False]) >= 40
    added = statistics.mean(counts[True]) - statistics.mean(counts[False])
    assert added <= MAX_ADDED_GC_OBJECTS, (
        f"a traced step leaves {added:.1f} more container objects alive than an untraced one "
        f"(bound {MAX_ADDED_GC_OBJECTS}): a tuple or dict per event held in the tracer's buffer?"
    )
