"""The device timeline over the CUDA driver's event calls (``instrument.cuda_driver``), with
stand-in events and a stand-in driver: the same slices as torch's calls, one driver call per
conversion, a self-test that catches a driver that disagrees, and float32 elapsed times that
stay exact over a long run because the clock moves its reference forward."""

from __future__ import annotations

import random
import time

import pytest

from analysis import load_trace
from instrument.cuda_driver import (
    CUDA_ERROR_NOT_READY,
    CudaDriver,
    CudaDriverError,
    StandInDriver,
)
from instrument.device_events import CudaClock, StandInCudaEvent, StandInStream
from instrument.events import unflatten
from instrument.tracer import Tracer
from tests.instrument.test_device_timeline_batching import EngineLoop, _device_slices, _run_async


def test_driver_calls_write_the_same_slices(tmp_path):
    """Background poller, async engine: every stage emitted once, times within float32
    rounding of the stand-in stamps; per step 8 records (5 of the timeline's, 3 the runner's),
    one ``cuEventElapsedTime`` per distinct event (torch's elapsed_time also queries both)."""
    path = str(tmp_path / "t.pftrace")
    tracer = Tracer(path)
    driver = StandInDriver()
    loop = EngineLoop(tracer, wait_only=True, background=True, driver=driver)
    clock = loop.timeline.ops
    assert clock.api == "driver (stand-in)"
    StandInCudaEvent.reset_calls()
    num_steps = 600
    _run_async(loop, num_steps, wait_s=0.0003)
    tracer.close()
    records = driver.calls["record"] + driver.calls["torch_record"] - clock.num_anchor_records
    assert records == 8 * num_steps
    # Through torch only an event's first record (which creates it): the lent ``ready`` events
    # are not given back here, so one is made per step.
    assert driver.calls["torch_record"] <= StandInCudaEvent.calls["create"] < 1.5 * num_steps
    # Every distinct event converted once, and a few twice (a begin that is an end an earlier
    # poll read); besides the stages' events, one conversion per anchor the clock adopted. (With
    # 256-stage poll stretches there are so few repeats that subtracting two per anchor recorded
    # took the count under 8 a step.)
    stage_conversions = driver.calls["elapsed_time"] - clock.num_anchors
    assert 8 * num_steps <= stage_conversions <= 8.2 * num_steps
    assert clock.num_anchors <= clock.num_anchor_records
    assert StandInCudaEvent.calls["elapsed_time"] == 0  # no torch-style conversion at all
    assert loop.timeline.num_recorded == loop.timeline.num_emitted == 5 * num_steps
    written = _device_slices(path)
    assert written.keys() == loop.expected.keys()
    for key, (start, end) in loop.expected.items():
        got = written[key]
        assert abs(got[0] - start) <= 100 and abs(got[1] - end) <= 100, key


def test_driver_errors_are_raised_not_read_as_incomplete():
    driver = StandInDriver()
    clock = StandInCudaEvent.clock(driver=driver)
    stream = StandInStream()
    event = StandInCudaEvent()
    assert clock.query(event)  # never recorded (no handle yet): complete, as torch says
    clock.record(event, stream)  # first record: through torch, which creates the event
    assert driver.calls["torch_record"] == 1 and event.cuda_event
    assert not clock.query(event)  # recorded, the stream has not reached it
    stream.advance()
    assert clock.query(event)
    broken = StandInDriver()
    broken._elapsed_fn = lambda ms, a, b: CUDA_ERROR_NOT_READY
    with pytest.raises(CudaDriverError, match="cuEventElapsedTime failed"):
        broken.elapsed_ms_many(event, [event])


def test_self_test_rejects_a_driver_that_disagrees_with_torch():
    stream = StandInStream(auto=True)
    assert StandInDriver().self_test(StandInCudaEvent, stream, lambda: None) is None
    lying = StandInDriver()
    fn = lying._elapsed_fn

    def off_by_a_microsecond(ms, a, b):
        code = fn(ms, a, b)
        ms._obj.value += 0.002
        return code

    lying._elapsed_fn = off_by_a_microsecond
    assert "torch" in lying.self_test(StandInCudaEvent, stream, lambda: None)


@pytest.mark.parametrize("driver", [False, True])
def test_long_runs_keep_microsecond_times(monkeypatch, driver):
    """1,000 s of simulated device time, events 100 ms apart, converted in batches: an elapsed
    time is a float32 of ms (2^-24 relative: ~30 us at 1,000 s from a start-up reference), so
    without anchors the error grows past 10 us; with them every time stays within 1 us."""
    now = [10**12]
    monkeypatch.setattr(time, "monotonic_ns", lambda: now[0])
    errors = {}
    for anchored in (False, True):
        clock = StandInCudaEvent.clock(driver=StandInDriver() if driver else None)
        if not driver:  # torch's elapsed_time returns a float32 too: model it
            ms32 = StandInDriver()
            clock._elapsed_ms = ms32.elapsed_ms
        if not anchored:
            clock.anchor_stream = None
        stream = StandInStream(auto=True)
        rng = random.Random(0)
        worst, batch = 0, []
        for _ in range(10_000):
            now[0] += 100_000_000 + rng.randrange(1000)
            event = StandInCudaEvent()
            clock.record(event, stream)
            batch.append(event)
            if len(batch) == 10:
                got = clock.host_ns_many(batch)
                worst = max(worst, *(abs(g - e.ns) for g, e in zip(got, batch, strict=True)))
                batch = []
        errors[anchored] = worst
        if anchored:
            assert clock.num_anchors >= 999  # one a batch (batches lie 1 s apart)
    assert errors[False] > 10_000
    assert errors[True] <= 1_000


def test_abutting_stages_split_across_polls_share_one_time(tmp_path, monkeypatch):
    """``forward`` and ``sample`` (contiguous: one event between them) emitted by two polls
    with a new clock reference in between: the shared event converts to times that may differ
    by a rounding; ``sample`` must still start exactly where ``forward`` ended (abutting slices
    that overlapped by 1 ns would be paired wrongly by every reader)."""
    path = str(tmp_path / "t.pftrace")
    tracer = Tracer(path)
    loop = EngineLoop(tracer, driver=StandInDriver())
    timeline, clock = loop.timeline, loop.timeline.ops
    loop.launch(0)
    for stream in loop.streams.values():
        stream.advance()
    # Compute holds input_prep, forward, sample: emit the first two only.
    assert timeline.poll(limit=3) == 3  # h2d_inputs (its queue comes first), input_prep, forward
    buffered = unflatten(list(timeline.tracer._buffer))  # the tracer's buffer is flat
    written_forward = [s for s in buffered if s[2] == "forward"]
    monkeypatch.setattr(clock, "ANCHOR_MS", -1.0)  # every conversion moves the reference
    clock.keep_anchored()
    clock.keep_anchored()
    assert clock.num_anchors >= 1
    real = clock.host_ns_many
    monkeypatch.setattr(clock, "host_ns_many", lambda events: [t + 1 for t in real(events)])
    assert timeline.poll() == 2  # sample (its begin read again, 1 ns later), d2h_output
    tracer.close()
    forward_end = written_forward[0][4]
    sample = [s for s in load_trace(path).slices.itertuples() if s.name == "sample"]
    assert sample[0].ts_ns == forward_end


def test_driver_load_and_api_choice_fail_clearly():
    assert CudaDriver.load("libstepscope-no-such-driver.so") is None  # then torch's calls
    with pytest.raises(ValueError, match="api must be one of auto, driver, driver-held, torch"):
        CudaClock.calibrate(api="nvml")


# Each test runs with both cores of the stages (tests/instrument/conftest.py).
pytestmark = pytest.mark.usefixtures("stage_core")
