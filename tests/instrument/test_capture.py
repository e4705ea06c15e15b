"""Capture control: kept steps and dropped counts are exact; budget stop and ring keep loadable files."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from analysis import load_trace
from instrument.capture import CaptureConfig, parse_step_range
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
            if (s - first_kept) % c.every:
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
]


@pytest.mark.parametrize("config", CASES, ids=lambda c: f"{c.first_step}:{c.end_step}/{c.every}")
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
