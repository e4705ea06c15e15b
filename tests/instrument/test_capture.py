"""Capture control: kept steps and dropped counts are exact; budget stop and ring keep loadable files."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest

from analysis import load_trace
from instrument.capture import CaptureConfig, CaptureGate, StepRule, parse_step_range
from instrument.events import EV_SLICE_AT
from instrument.schema import device_track_name, request_track_name
from instrument.tracer import Tracer

COMPUTE = device_track_name(0, "compute")
EVENTS_PER_STEP = 4  # schedule + wait_output (CPU), forward (device), one counter


def _emit(tracer: Tracer, steps: range, counters: bool = True) -> None:
    """Engine-like steps: step N's device slice is emitted one step late (after N+1's CPU)."""
    threading.current_thread().name = "engine-core"
    tracer.instant("engine_config", scope="process", model="tiny")
    for step in steps:
        base = step * 1_000_000
        tracer.thread_slice("schedule", base, base + 100_000, step=step, num_reqs=4)
        tracer.thread_slice("wait_output", base + 100_000, base + 900_000, step=step, kind="x")
        if counters:  # a counter belongs to the step of the latest CPU slice
            tracer.counter("kv_usage", step / 1000)
        if step > steps.start:
            prev = (step - 1) * 1_000_000
            tracer.slice_at(COMPUTE, "forward", prev + 200_000, prev + 950_000, step=step - 1)
    last = (steps.stop - 1) * 1_000_000
    tracer.slice_at(COMPUTE, "forward", last + 200_000, last + 950_000, step=steps.stop - 1)


def _kept_reference(c: CaptureConfig, steps: range) -> tuple[list[int], dict[str, int]]:
    """Rules 1-3 of instrument.capture, written as a plain loop."""
    kept: list[int] = []
    dropped = {"warmup": 0, "range": 0, "sampled": 0}
    first_kept = None
    for s in steps:
        if s < c.warmup_steps and not c.include_warmup:
            dropped["warmup"] += 1
        elif s < c.first_step or (c.end_step is not None and s >= c.end_step):
            dropped["range"] += 1
        else:
            first_kept = s if first_kept is None else first_kept
            if ((s - first_kept) // c.run_length) % c.every:
                dropped["sampled"] += 1
            else:
                kept.append(s)
    return kept, dropped


CASES = [
    CaptureConfig(),
    CaptureConfig(warmup_steps=3),
    CaptureConfig(warmup_steps=3, include_warmup=True, every=5),
    CaptureConfig(first_step=10, end_step=50, every=4, warmup_steps=3),
    CaptureConfig(first_step=1, end_step=None, every=7, warmup_steps=2),
    CaptureConfig(first_step=1, end_step=None, every=7, warmup_steps=2, run_length=1),
    CaptureConfig(first_step=5, end_step=90, every=3, run_length=4),
]


@pytest.mark.parametrize(
    "config", CASES, ids=lambda c: f"{c.first_step}:{c.end_step}/{c.every}x{c.run_length}"
)
def test_kept_steps_and_dropped_counts_are_exact(tmp_path: Path, config: CaptureConfig) -> None:
    steps = range(0, 100)
    path = tmp_path / "t.pftrace"
    with Tracer(path, capture=config, flush_interval_s=0.01) as tracer:
        _emit(tracer, steps)
    frames = load_trace(path)
    kept, dropped = _kept_reference(config, steps)
    got = frames.slices.groupby("step").size()
    assert got.index.tolist() == kept
    assert (got == 3).all()  # each kept step whole: schedule, wait_output and its late forward
    assert frames.config == {"model": "tiny"}  # process instants are never gated
    meta = frames.metadata
    assert meta["steps_seen"] == len(steps) and meta["steps_kept"] == len(kept)
    for reason, n in dropped.items():
        assert meta.get(f"dropped_steps_{reason}", 0) == n
        assert meta.get(f"dropped_events_{reason}", 0) == n * EVENTS_PER_STEP
    assert meta["capture_every"] == config.every
    assert meta["capture_run_length"] == (config.run_length if config.every > 1 else 0)
    assert len(frames.counters) == len(kept)


@pytest.mark.parametrize(
    "config", [CaptureConfig(warmup_steps=3), CaptureConfig(first_step=2, end_step=6, every=2)]
)
def test_request_tracks_are_kept_whatever_step_they_finish_in(
    tmp_path: Path, config: CaptureConfig
) -> None:
    """Issue 18: a request finishing in a warm-up step lost its whole track (its slices are
    written at finish and took that step). Request tracks span steps: rules 1-3 never drop them."""
    path = tmp_path / "t.pftrace"
    with Tracer(path, capture=config, flush_interval_s=0.01) as tracer:
        threading.current_thread().name = "engine-core"
        for step in range(10):
            base = step * 1_000_000
            tracer.thread_slice("schedule", base, base + 100_000, step=step)
            track = request_track_name(f"r{step}")  # r<step> finishes in this step
            tracer.slice_at(track, "queued", base + 10_000, base + 50_000, request_id="x")
            tracer.slice_at(track, "prefill", base + 50_000, base + 500_000, request_id="x")
    frames = load_trace(path)
    sl = frames.slices
    requests = sl[sl["track"].str.startswith("request ")]
    assert sorted(requests["track"].unique()) == [request_track_name(f"r{i}") for i in range(10)]
    assert len(requests) == 20
    kept, _ = _kept_reference(config, range(10))
    assert sorted(sl.loc[sl["name"] == "schedule", "step"].tolist()) == kept  # steps still gated


def test_stop_at_budget_keeps_a_prefix_and_counts_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "t.pftrace"
    budget = 64 * 1024
    with Tracer(path, capture=CaptureConfig(max_bytes=budget), flush_interval_s=0.01) as tracer:
        # Counters take the real clock, which sorts after these synthetic times: left out here.
        _emit(tracer, range(0, 3000), counters=False)
    size = path.stat().st_size
    assert budget <= size <= budget + 2048  # late events of admitted steps + closing metadata
    frames = load_trace(path)
    steps = sorted(set(frames.slices["step"].tolist()))
    assert steps == list(range(len(steps)))
    meta = frames.metadata
    assert meta["steps_kept"] == len(steps)
    assert meta["dropped_steps_size"] == 3000 - len(steps)


def test_ring_keeps_the_most_recent_steps(tmp_path: Path) -> None:
    path = tmp_path / "t.pftrace"
    ring = 128 * 1024
    with Tracer(path, capture=CaptureConfig(max_bytes=ring, mode="ring"), flush_interval_s=0.01):
        pass  # an empty ring closes into a loadable (metadata-only) file
    tracer = Tracer(path, capture=CaptureConfig(max_bytes=ring, mode="ring"), flush_interval_s=10)
    for first in range(0, 4000, 250):  # many flushes: the ring rotates several times
        _emit(tracer, range(first, first + 250))
        tracer.flush()
    tracer.close()
    assert not os.path.exists(f"{path}.seg0") and not os.path.exists(f"{path}.seg1")
    assert path.stat().st_size <= ring + 4096
    frames = load_trace(path)
    steps = sorted(set(frames.slices["step"].tolist()))
    assert steps[-1] == 3999 and steps == list(range(steps[0], 4000))
    meta = frames.metadata
    assert meta["ring_rotations"] >= 2
    assert meta["dropped_steps_ring"] == 4000 - len(steps)
    assert frames.config == {"model": "tiny"}  # replayed in each segment's preamble
    assert len(frames.decisions) == 0 and frames.metadata["schema_version"] == 1


def test_ring_segments_load_after_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "t.pftrace"
    tracer = Tracer(
        path, capture=CaptureConfig(max_bytes=128 * 1024, mode="ring"), flush_interval_s=10
    )
    for first in range(0, 3000, 250):
        _emit(tracer, range(first, first + 250))
        tracer.flush()
    # No close: what a killed process leaves. Each segment loads on its own.
    seen: set[int] = set()
    for seg in (f"{path}.seg0", f"{path}.seg1"):
        frames = load_trace(seg)
        assert frames.config == {"model": "tiny"}
        seen |= set(frames.slices["step"].tolist())
    assert 2999 in seen
    tracer.close()


@pytest.mark.parametrize(
    ("text", "expected"),
    [("3:9", (3, 9)), ("5:", (5, None)), (":7", (0, 7))],
)
def test_parse_step_range(text: str, expected: tuple[int, int | None]) -> None:
    assert parse_step_range(text) == expected


@pytest.mark.parametrize("text", ["7", "9:3", "a:b", "-1:4"])
def test_parse_step_range_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_step_range(text)


@pytest.mark.parametrize(
    "kwargs",
    [{"every": 0}, {"mode": "loop"}, {"mode": "ring"}, {"max_bytes": 10}, {"first_step": -1}],
)
def test_bad_capture_config_is_a_clear_error(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        CaptureConfig(**kwargs)  # type: ignore[arg-type]


def _emit_skipping(tracer: Tracer, steps: range) -> None:
    """What the engine does (engine/core.py): rules 1-3 asked once per step, the step's phase run
    with the tracer paused when they drop it. Each step: schedule, a sync instant, wait_output, a
    counter and a finishing request; its device slice arrives later, as the device timeline's
    batches do (``append_slices``: only stages recorded while traced)."""
    threading.current_thread().name = "engine-core"
    tracer.instant("engine_config", scope="process", model="tiny")
    late: list[tuple[object, ...]] = []
    for step in steps:
        traced = tracer.trace_step(step)
        if not traced:
            tracer.pause()
        try:
            base = step * 1_000_000
            tracer.thread_slice("schedule", base, base + 100_000, step=step, num_reqs=4)
            tracer.instant("sync", op="item", hot=True)
            tracer.thread_slice("wait_output", base + 100_000, base + 900_000, step=step, kind="x")
            tracer.counter("kv_usage", step / 1000)
            tracer.request_slices(f"r{step}", base, base + 1000, base + 2000, base + 3000, 2)
            tracer.metadata(note=step)
            if tracer.enabled:  # DeviceTimeline.stage records nothing while paused
                late.append(("forward", base + 200_000, base + 950_000, {"step": step}))
        finally:
            if not traced:
                tracer.resume()
        tracer.append_slices([(EV_SLICE_AT, COMPUTE, n, a, b, args) for n, a, b, args in late])
        late = []


@pytest.mark.parametrize(
    ("config", "writer"),
    [(c, "thread") for c in CASES] + [(CASES[3], "process")],
    ids=lambda v: (
        v if isinstance(v, str) else f"{v.first_step}:{v.end_step}/{v.every}x{v.run_length}"
    ),
)
def test_steps_skipped_on_the_engine_thread_are_counted_exactly(
    tmp_path: Path, config: CaptureConfig, writer: str
) -> None:
    """A step rules 1-3 drop is never recorded (the engine asks ``trace_step`` once per step and
    pauses the tracer): the file holds the same kept steps, each whole, as when the writer drops
    them, and the metadata counts every step; the dropped ones as skipped on the engine."""
    steps = range(0, 100)
    path = tmp_path / "t.pftrace"
    with Tracer(path, capture=config, flush_interval_s=0.01, writer=writer) as tracer:
        _emit_skipping(tracer, steps)
    frames = load_trace(path)
    kept, dropped = _kept_reference(config, steps)
    sl = frames.slices
    step_slices = sl[sl["step"] >= 0]
    got = step_slices.groupby("step")["name"].apply(lambda n: sorted(n.astype(str)))
    assert got.index.tolist() == kept
    assert all(names == ["forward", "schedule", "wait_output"] for names in got)
    assert frames.config == {"model": "tiny"}
    # Request tracks span steps: written whatever step they finish in (3 slices each).
    assert sl["track"].str.startswith("request ").sum() == 3 * len(steps)
    meta = frames.metadata
    assert meta["steps_seen"] == len(steps) and meta["steps_kept"] == len(kept)
    for reason, n in dropped.items():
        assert meta.get(f"dropped_steps_{reason}", 0) == n
        assert meta.get(f"engine_skipped_steps_{reason}", 0) == n
        assert f"dropped_events_{reason}" not in meta  # never made: no event count exists
    assert meta.get("engine_skipped_instants", 0) == sum(dropped.values())  # one sync each
    assert len(frames.counters) == len(kept)
    assert meta["note"] == 99  # process instants are written while paused too
    assert not tracer.enabled and not tracer.paused


def _reason_reference(c: CaptureConfig, steps: range) -> list[str | None]:
    """Rules 1-3 step by step, as a plain loop (the reason each step is dropped for)."""
    out: list[str | None] = []
    first_kept = None
    for s in steps:
        if s < c.warmup_steps and not c.include_warmup:
            out.append("warmup")
        elif s < c.first_step or (c.end_step is not None and s >= c.end_step):
            out.append("range")
        else:
            first_kept = s if first_kept is None else first_kept
            out.append("sampled" if ((s - first_kept) // c.run_length) % c.every else None)
    return out


def test_step_rule_is_the_gates_arithmetic() -> None:
    """The engine's rule (one remembered answer, no per-step cache) and the writer's gate agree
    with a plain loop step by step, on the cases above and on random configurations."""
    rng = random.Random(0)
    configs = list(CASES)
    for _ in range(500):
        first = rng.randrange(0, 12)
        configs.append(
            CaptureConfig(
                first_step=first,
                end_step=rng.choice([None, first + rng.randrange(1, 50)]),
                every=rng.randrange(1, 5),
                run_length=rng.randrange(1, 7),
                warmup_steps=rng.randrange(0, 6),
                include_warmup=rng.random() < 0.3,
            )
        )
    steps = range(120)
    for config in configs:
        rule, gate = StepRule(config), CaptureGate(config)
        want = _reason_reference(config, steps)
        assert [rule.reason(s) for s in steps] == want, config
        assert [gate.static(s) for s in steps] == want, config
        assert rule.drops_any == any(want), config


def test_pause_outside_tracing_and_resume_after_close(tmp_path: Path) -> None:
    """pause/resume only undo each other: a tracer switched off stays off (the interleaved bench
    switches ``enabled`` between iterations), and one closed while paused stays closed."""
    tracer = Tracer(tmp_path / "t.pftrace", capture=CaptureConfig(every=2, run_length=1))
    tracer.enabled = False
    assert tracer.trace_step(0) and tracer.trace_step(1)  # off: nothing counted, no s0 taken
    tracer.pause()
    assert not tracer.paused
    tracer.resume()
    assert not tracer.enabled
    tracer.enabled = True
    assert tracer.trace_step(5) and not tracer.trace_step(6) and tracer.trace_step(7)
    assert tracer.skipped_steps == {"warmup": 0, "range": 0, "sampled": 1}
    tracer.pause()
    assert tracer.paused and not tracer.enabled
    tracer.close()
    tracer.resume()
    assert not tracer.enabled and not tracer.paused
