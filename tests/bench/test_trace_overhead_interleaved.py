"""bench_trace_overhead.py --interleaved: tracing switched on and off in blocks of one engine run."""

from __future__ import annotations

import json
import os
import random
import statistics

import pytest

from bench._interleaved import Interleaver, StepSample, _merged, _overlap_ns, attribute, summarize
from bench.bench_trace_overhead import main
from tests.instrument.conftest import read_trace


def _synthetic(added_us: float, num_blocks: int, block: int) -> list[StepSample]:
    """Steps whose untraced cost drifts slowly (1000 → 1400 µs over the run) with noise; traced
    steps cost ``added_us`` more."""
    rng = random.Random(1)
    inter = Interleaver(engine=None, tracer=None, block_steps=block, skip_steps=4)
    out = []
    for i in range(num_blocks * block):
        b = i // block
        traced = inter.traced_block(b)
        base = 1000 + 400 * i / (num_blocks * block) + rng.gauss(0, 20)
        host = base + (added_us if traced else 0.0)
        # the process's CPU: the engine thread's plus a poller thread's 10 µs when traced
        proc = host * 0.9 + (10.0 if traced else 0.0)
        out.append(StepSample(b, traced, i % block >= 4, host + 3000, host, host * 0.9,
                              proc_us=proc))  # fmt: skip
    return out


def test_summarize_recovers_a_known_added_cost_under_drift() -> None:
    samples = _synthetic(added_us=30.0, num_blocks=40, block=32)
    result = summarize(samples)
    assert result["pairs"] == 20
    # Pooled medians: brute force over the steady steps.
    steady = [s for s in samples if s.steady]
    assert result["host_us"]["traced"] == statistics.median(s.host_us for s in steady if s.traced)
    assert result["host_us"]["untraced"] == statistics.median(
        s.host_us for s in steady if not s.traced
    )
    # The drift (400 µs over the run, 13x the effect) cancels within pairs.
    lo, hi = result["host_us"]["diff_ci95"]
    assert lo <= 30.0 <= hi and hi - lo < 20.0
    assert abs(result["host_us"]["diff_median"] - 30.0) < 8.0
    assert abs(result["cpu_us"]["diff_median"] - 27.0) < 8.0
    assert abs(result["proc_us"]["diff_median"] - 37.0) < 8.0
    # Wall = host + 3000: throughput ratio ≈ (3000 + ~1200) / (3030 + ~1200).
    assert 0.990 < result["throughput_ratio"]["median"] < 0.996
    # Tails: brute force over the steady traced steps' wall times.
    walls = sorted(s.wall_us for s in steady if s.traced)
    tail = result["tail"]["wall_us"]["traced"]
    assert tail["max"] == walls[-1] and tail["p50"] == walls[len(walls) // 2]
    assert tail["p99"] == walls[int(0.99 * len(walls))]
    assert abs(tail["mean"] - sum(walls) / len(walls)) < 1e-6
    # Blocks alternate traced-first and untraced-first pair by pair.
    assert [Interleaver(None, None, 16, 4).traced_block(b) for b in range(8)] == [
        True, False, False, True, True, False, False, True,
    ]  # fmt: skip


def test_collections_on_the_engine_thread_are_counted_per_step() -> None:
    """The interleaver times the cyclic collections that run inside ``run_step`` on the engine
    thread (a mean per steady step and kind); one planted ``gc.collect()`` in every traced step
    shows as one run a traced step and none untraced."""
    import gc
    from types import SimpleNamespace

    class Scheduler:
        def schedule(self) -> SimpleNamespace:
            return SimpleNamespace(num_reqs=2, total_num_scheduled_tokens=2)

    tracer = SimpleNamespace(enabled=True, paused=False)
    engine = SimpleNamespace(scheduler=Scheduler())

    def run_step() -> None:
        engine.scheduler.schedule()
        if tracer.enabled:
            gc.collect(0)

    engine.run_step = run_step
    inter = Interleaver(engine=engine, tracer=tracer, block_steps=12, skip_steps=2)
    with inter.install():
        for _ in range(12 * 4):
            engine.run_step()
    steady = [s for s in inter.samples if s.steady]
    assert all(s.gc_runs == 1 and s.gc_us > 0 for s in steady if s.traced)
    assert all(s.gc_runs == 0 and s.gc_us == 0 for s in steady if not s.traced)
    gcs = summarize(inter.samples, min_steps=4)["gc"]
    assert gcs["traced"]["runs_per_step"] == 1.0 and gcs["untraced"]["runs_per_step"] == 0.0
    traced_us = [s.gc_us for s in steady if s.traced]
    assert gcs["traced"]["us_per_step"] == statistics.fmean(traced_us)


def test_interleaved_mode_runs_on_the_cpu(tmp_path) -> None:
    out = tmp_path / "il.json"
    # 72 output tokens: enough steps that the every-4 run's traced blocks hold both kept and
    # dropped steady steps (48 left no kept one there).
    result = main(
        ["--interleaved", "--modes", "off,trace,trace-every4", "--num-requests", "4",
         "--max-num-seqs", "4",
         "--in-len", "8", "--out-len", "72", "--block-steps", "16", "--skip-steps", "2",
         "--min-run-s", "0", "--time-records", "--out", str(out)]
    )  # fmt: skip
    r = result["interleaved"]["trace"]
    assert r["pairs"] >= 1
    # Event records on the engine thread per steady decode step (--time-records): traced, with
    # derived begins (the default: no begin events), the 5 stages' 5 end events, 3 of which are
    # the runner's sync events; untraced, those 3 sync events only (docs/design.md §4.3; recorded
    # begins add 3: tests/engine/test_derived_begins_engine.py).
    records = r["event_records"]
    assert records["traced"]["per_step"] == 5.0 and records["untraced"]["per_step"] == 3.0
    # A sampled trace: the engine skips the tracer's work on the steps it drops, so they record
    # the untraced step's 3 sync events; kept steps record the full trace's 5 (§4.9).
    every4 = result["interleaved"]["trace-every4"]
    assert every4["event_records"]["untraced"]["per_step"] == 3.0
    sampled = every4["sampled"]
    assert sampled["kept"]["steady_steps"] > 0 and sampled["dropped"]["steady_steps"] > 0
    assert sampled["kept"]["event_records"]["per_step"] == 5.0
    assert sampled["dropped"]["event_records"]["per_step"] == 3.0
    assert "sampled" not in r  # a full trace skips no step
    helpers = r["helper_threads"]  # the poller's and the flush thread's CPU per traced step
    assert helpers["traced_steps"] >= r["steady_steps"]["traced"] > 0
    assert helpers["poller_us_per_traced_step"] >= 0 and helpers["flush_us_per_traced_step"] >= 0
    # the polls' CPU by section, on whichever thread they ran: every emitted stage counted
    sections = helpers["poll_sections"]
    assert set(sections) == {"query", "convert", "build", "hand", "stages", "events", "queries"}
    assert 0 < sections["queries"] <= sections["stages"]
    assert sections["stages"] >= 5 * r["steady_steps"]["traced"] > 0
    assert sections["stages"] <= sections["events"] and sections["build"] > 0
    assert records["traced"]["us_per_record"] > 0 and records["untraced"]["us_per_record"] > 0
    assert r["steady_steps"]["traced"] > 0 and r["steady_steps"]["untraced"] > 0
    for q in ("host_us", "cpu_us", "wall_us"):
        assert r[q]["traced"] > 0 and r[q]["untraced"] > 0
        lo, hi = r[q]["diff_ci95"]
        assert lo <= r[q]["diff_median"] <= hi
    assert json.loads(out.read_text())["interleaved"]["trace"]["pairs"] == r["pairs"]
    # Where the mean goes: every steady step in one class of its kind, the classes' excesses
    # summing to the difference of the means; the phases inside the engine CPU.
    att = r["attribution"]
    assert att["threads"] == ["flush", "poller"] and att["busy_intervals"]["poller"] > 0
    for kind in ("traced", "untraced"):
        assert att[kind]["steps"] == r["steady_steps"][kind]
        assert sum(c["steps"] for c in att[kind]["classes"].values()) == att[kind]["steps"]
        m = att[kind]["mean"]
        assert 0 < m["sched_cpu_us"] < m["cpu_us"] and 0 < m["post_cpu_us"] < m["cpu_us"]
    for q, d in att["difference"].items():
        assert sum(e[q] for e in att["excess"].values()) == pytest.approx(d, abs=1e-6)
    assert {k: set(v) for k, v in r["gc"].items()} == {
        kind: {"us_per_step", "runs_per_step"} for kind in ("traced", "untraced")
    }
    # The trace of the switched run: only some steps traced, and every device slice of a traced
    # step lies after that step was scheduled (a stage after a switch back on does not begin at
    # a stale event of the block before) and none was dropped.
    trace = read_trace(os.path.join(result["config"]["trace_dir"], "trace.pftrace"))
    slices = trace.slices()
    scheduled = {a["step"]: start for _, name, start, _, a in slices if name == "schedule"}
    device = [(name, start, a["step"]) for t, name, start, _, a in slices if t.startswith("gpu:")]
    assert device and scheduled
    for name, start, step in device:
        assert step in scheduled, (name, step)
        assert start >= scheduled[step], (name, step)
    meta = [e.args for e in trace.events if e.name == "trace_metadata"]
    assert not any(k.startswith("dropped_device") for m in meta for k in m)


def test_the_direct_measure_splits_off_collections_inside_the_tracers_calls() -> None:
    """``CostMeter`` (the direct measure): a collection planted inside a wrapped call counts in
    that call's wall time and in ``gc_in_calls_us_per_step``; one between calls only in
    ``gc_us_per_step``; ``tracer_us_per_step_no_gc`` is the calls' time less the former."""
    import gc
    import threading

    import pytest

    from bench._tracer_cost import CostMeter

    meter = CostMeter()
    meter._thread = threading.get_ident()
    collecting = meter.wrap("tracer.span_end", lambda: gc.collect(0))
    quiet = meter.wrap("tracer.span_begin", lambda: None)
    gc.callbacks.append(meter.on_gc)
    try:
        for _ in range(4):
            quiet()
            collecting()
            gc.collect(0)  # the engine's own, outside every call
    finally:
        gc.callbacks.remove(meter.on_gc)
    out = meter.per_step(4)
    assert out["gc_collections_per_step"][0] == 2.0
    assert 0 < out["gc_in_calls_us_per_step"] < out["gc_us_per_step"]
    assert out["tracer_us_per_step_no_gc"] == pytest.approx(
        out["tracer_us_per_step"] - out["gc_in_calls_us_per_step"]
    )
    assert out["tracer_us_per_step_no_gc"] >= 0


def test_time_driver_reads_counts_every_driver_read_of_a_run(tmp_path) -> None:
    """``--time-driver-reads``: the wrapped reads still answer as the driver does, every
    ``cuEventElapsedTime`` of the run is counted (the anchors' too: the same driver call), and
    every end-event query the polls make is timed, none of them twice."""
    from bench.bench_trace_overhead import _print_driver_reads, _time_driver_reads
    from instrument.cuda_driver import StandInDriver
    from instrument.tracer import Tracer
    from tests.instrument.test_device_timeline_batching import EngineLoop, _run_async

    tracer = Tracer(str(tmp_path / "t.pftrace"))
    driver = StandInDriver()
    loop = EngineLoop(tracer, wait_only=True, driver=driver, background=True)
    totals = _time_driver_reads(loop.timeline)
    _run_async(loop, 200, wait_s=0.0002)
    tracer.close()
    assert loop.timeline.num_emitted == 5 * 200  # the wrapped reads answered correctly
    assert totals["elapsed_calls"] == driver.calls["elapsed_time"] > 0
    # The clock queries its anchors itself (not through the timeline's query): not timed here.
    assert 0 < totals["query_calls"] <= driver.calls["query"]
    assert totals["stamp_queries"] == 0  # no graph stamps in this loop
    row = _print_driver_reads(totals)
    assert row["elapsed_us_per_call"] > 0 and row["query_us_per_call"] > 0
    assert row["elapsed_calls"] == totals["elapsed_calls"]


def test_interleaved_in_wait_policy_reports_the_critical_host_time(tmp_path) -> None:
    """``--poll wait`` with ``--poll-batch`` / ``--max-deferred``: the engine thread's polls at
    its wait are counted (CPU, wall, overrun bound), the critical host time is the host time
    less those polls' wall plus their overrun (brute force over the steps), and the traced and
    untraced tokens still agree (every output digest the same)."""
    from bench._interleaved import QUANTITIES

    out = tmp_path / "il.json"
    result = main(
        ["--interleaved", "--modes", "off,trace", "--num-requests", "4", "--max-num-seqs", "4",
         "--in-len", "8", "--out-len", "72", "--block-steps", "16", "--skip-steps", "2",
         "--min-run-s", "0", "--poll", "wait", "--poll-batch", "20", "--max-deferred", "40",
         "--out", str(out)]
    )  # fmt: skip
    r = result["interleaved"]["trace"]
    assert "crit_us" in QUANTITIES and r["pairs"] >= 1
    polls = r["polls"]
    # The poller is woken only for what a traced block left pending as tracing switched off
    # (DeviceTimeline._untraced_gap), at most once a traced block.
    assert polls["policy"] == "wait" and polls["in_wait"] > 0 and polls["woken"] <= r["pairs"] + 1
    assert polls["in_wait_wall_us_per_traced_step"] >= polls["in_wait_overrun_us_per_traced_step"]
    # Critical host time never exceeds the host time (the polls' wall less their overrun >= 0);
    # untraced, no poll runs, so the two are the same.
    assert r["crit_us"]["untraced"] == r["host_us"]["untraced"]
    assert r["crit_us"]["traced"] <= r["host_us"]["traced"] + 1e-9
    with pytest.raises(SystemExit, match="max-deferred"):
        main(["--interleaved", "--modes", "off,trace", "--poll-batch", "20",
              "--max-deferred", "10", "--num-requests", "2", "--out-len", "4"])  # fmt: skip


def test_summarize_sees_a_cost_paid_in_one_step_of_many_in_the_mean_only() -> None:
    """A traced cost of 480 µs in every 16th step (30 µs a step on average, as a poll every ~20
    steps is): the pairs' median difference misses it, their mean difference finds it."""
    rng = random.Random(2)
    inter = Interleaver(engine=None, tracer=None, block_steps=32, skip_steps=4)
    samples = []
    for i in range(40 * 32):
        b = i // 32
        traced = inter.traced_block(b)
        host = (
            1000
            + 200 * i / (40 * 32)
            + rng.gauss(0, 5)
            + (480.0 if traced and i % 16 == 7 else 0.0)
        )
        samples.append(StepSample(b, traced, i % 32 >= 4, host + 3000, host, host, proc_us=host))
    result = summarize(samples)
    assert abs(result["host_us"]["diff_median"]) < 5.0
    assert abs(result["host_us"]["mean_diff_median"] - 480.0 / 16 * 32 / 28) < 8.0
    lo, hi = result["host_us"]["mean_diff_ci95"]
    assert lo <= result["host_us"]["mean_diff_median"] <= hi
    assert "crit_us" not in result  # not measured in these samples


def test_the_direct_measure_times_the_compiled_cores_stages_as_the_pythons(tmp_path) -> None:
    """The direct measure (``bench/_tracer_cost.py``) with each stage core: the compiled core's
    sites are C objects (timed through proxies), and it counts the same stage calls a step as
    the Python core's patched classes, every opened stage exited; the traced mode's added time
    is a number either way. ``--rounds 0`` runs that measurement alone."""
    import math

    from bench.bench_trace_overhead import main as overhead_main

    calls = {}
    for core in ("python", "c"):
        result = overhead_main(
            ["--num-requests", "4", "--max-num-seqs", "4", "--in-len", "8", "--out-len", "24",
             "--rounds", "0", "--min-run-s", "0", "--micro-steps", "20", "--modes", "off,trace",
             "--out", str(tmp_path / f"{core}.json"), "--", "--trace-core", core]
        )  # fmt: skip
        assert f"stage core {core}" in result["event_api"]["trace"], result["event_api"]
        assert result["modes"] == {}  # --rounds 0: the direct measurement alone
        traced = result["direct"]["trace"]
        per_step = traced["calls_per_step"]
        assert per_step["timeline.stage"] >= 4  # the runner's stages of a decode step, at least
        assert per_step["stage.__exit__"] == per_step["timeline.stage"]
        assert math.isfinite(traced["added_tracer_us_per_step"])
        assert traced["by_call_us_per_step"]["stage.__exit__"] > 0
        calls[core] = {k: v for k, v in per_step.items() if k.startswith(("timeline.", "stage."))}
    assert calls["c"] == calls["python"]


def test_attribute_splits_the_mean_by_the_helper_threads_work() -> None:
    """A synthetic run where a traced step costs 100 µs more exactly when a "poller" interval
    overlaps its host windows: the excess lands on the poller's class, none on the clear one,
    and the overlaps match a brute-force count."""
    rng = random.Random(3)
    samples, poller = [], []
    t = 0
    for i in range(2000):
        traced = (i // 50) % 2 == 0
        busy = traced and i % 7 == 0
        host = 1000.0 + rng.gauss(0, 5) + (100.0 if busy else 0.0)
        # the call's span: 1 ms host, then a 2 ms wait, then 0.2 ms after it
        windows = ((t, t + 1_000_000), (t + 3_000_000, t + 3_200_000))
        if busy:  # the poller worked across the first window's end and into the wait
            poller.append((t + 900_000, t + 2_000_000))
        elif i % 5 == 0:  # ... or only inside the wait: not the step's business
            poller.append((t + 1_100_000, t + 2_900_000))
        samples.append(StepSample(i // 50, traced, True, 3200.0, host, host, crit_us=host, sched_cpu_us=200.0,
                                  post_cpu_us=150.0, windows=windows))  # fmt: skip
        t += 4_000_000
    att = attribute(samples, {"poller": poller, "flush": []})
    classes = att["traced"]["classes"]
    assert set(classes) == {"clear", "poller"} and set(att["untraced"]["classes"]) == {"clear"}
    share = classes["poller"]["share"]
    assert share == pytest.approx(
        sum(1 for i in range(2000) if (i // 50) % 2 == 0 and i % 7 == 0)
        / sum(1 for i in range(2000) if (i // 50) % 2 == 0)
    )
    assert classes["poller"]["overlap_us"]["poller"] == pytest.approx(100.0)
    assert att["excess"]["poller"]["host_us"] == pytest.approx(share * 100.0, abs=1.5)
    assert abs(att["excess"]["clear"]["host_us"]) < 1.5
    assert att["difference"]["host_us"] == pytest.approx(
        sum(e["host_us"] for e in att["excess"].values())
    )
    assert att["traced"]["mean"]["launch_cpu_us"] == pytest.approx(
        att["traced"]["mean"]["cpu_us"] - 350.0
    )
    # _overlap_ns against a brute force over random intervals
    for _ in range(200):
        ivs = [(a, a + rng.randrange(1, 50)) for a in (rng.randrange(0, 500) for _ in range(8))]
        wins = tuple(sorted((a, a + rng.randrange(1, 40)) for a in
                            rng.sample(range(0, 500, 50), 3)))  # fmt: skip
        covered = {x for a, b in ivs for x in range(a, b)}
        brute = sum(1 for a, b in wins for x in range(a, b) if x in covered)
        assert _overlap_ns(wins, _merged(ivs)) == brute
