"""Device slices come from events recorded around each stage, read without blocking."""

from __future__ import annotations

import time

import pytest
import torch

from engine.device import CpuDevice
from instrument.device_timeline import DeviceTimeline
from instrument.sync_detect import SyncDetector, hot_region
from instrument.tracer import Tracer
from tests.instrument.conftest import read_trace


def _busy(seconds: float, log: list[tuple[int, int]]):
    def run() -> None:
        start = time.monotonic_ns()
        time.sleep(seconds)
        log.append((start, time.monotonic_ns()))

    return run


def test_cpu_device_slices_match_worker_execution(tmp_path):
    path = str(tmp_path / "t.pftrace")
    tracer = Tracer(path)
    device = CpuDevice()
    timeline = DeviceTimeline(tracer, 0, device.timed_event_factory())
    ran: list[tuple[int, int]] = []
    stream = device.compute_stream
    with SyncDetector(tracer) as detector, hot_region():
        for step in range(5):
            with timeline.stage("forward", step=step, stream=stream):
                device.submit(stream, _busy(0.004, ran))
            timeline.poll()  # never blocks: most pairs are still pending here
    device.synchronize()
    timeline.drain()
    assert timeline.num_pending == 0 and timeline.num_emitted == 5
    device.close()
    tracer.close()
    assert detector.hits == []  # no sync on the hot path
    slices = [s for s in read_trace(path).slices() if s[0] == "gpu:0 compute"]
    assert [s[4]["step"] for s in slices] == list(range(5))
    for (_, name, start, end, _), (run_start, run_end) in zip(slices, ran, strict=True):
        assert name == "forward"
        # The slice brackets the work the worker really ran, within scheduling noise.
        assert start <= run_start and run_end <= end
        assert (end - start) - (run_end - run_start) < 3_000_000


def test_poll_does_not_block_on_pending_work(tmp_path):
    tracer = Tracer(str(tmp_path / "t.pftrace"))
    device = CpuDevice()
    timeline = DeviceTimeline(tracer, 0, device.timed_event_factory())
    with timeline.stage("forward", step=0, stream=device.compute_stream):
        device.submit(device.compute_stream, _busy(0.2, []))
    t0 = time.monotonic()
    assert timeline.poll() == 0
    assert time.monotonic() - t0 < 0.05
    device.synchronize()
    assert timeline.poll() == 1
    device.close()
    tracer.close()


def test_disabled_tracer_records_no_events():
    device = CpuDevice()
    made = []

    def factory():
        made.append(1)
        return device.new_event()

    timeline = DeviceTimeline(Tracer(enabled=False), 0, factory)
    with timeline.stage("forward", step=0, stream=device.compute_stream):
        pass
    assert made == [] and timeline.num_pending == 0
    device.close()


def test_untraced_sync_events_are_recorded_again_not_made_per_call():
    """Untraced, the runner's sync events are made once: a ``wait_only`` one per stream
    (recorded again at each call: a stream wait took its state when enqueued), the others once
    given back; a wait enqueued before the next record still waits for the earlier work."""
    device = CpuDevice()
    made = []

    def make():
        made.append(1)
        return device.new_event()

    timeline = DeviceTimeline(Tracer(enabled=False), 0, device.new_event)
    h2d, compute = device.h2d_stream, device.compute_stream
    first = timeline.event_after_stage(h2d, make, wait_only=True)
    device.wait_event(compute, first)
    assert timeline.event_after_stage(h2d, make, wait_only=True) is first
    other = timeline.event_after_stage(compute, make, wait_only=True)
    assert other is not first and len(made) == 2
    ready = timeline.event_after_stage(compute, make)
    assert ready is not other and len(made) == 3
    ready.synchronize()
    timeline.give_back(ready)
    assert timeline.event_after_stage(compute, make) is ready and len(made) == 3
    assert timeline.event_after_stage(compute, make) is not ready and len(made) == 4
    device.synchronize()
    device.close()


@pytest.mark.gpu
def test_cuda_slices_line_up_with_kernels(tmp_path):
    from engine.device import CudaDevice

    path = str(tmp_path / "t.pftrace")
    tracer = Tracer(path)
    device = CudaDevice(0)
    timeline = DeviceTimeline(tracer, 0, device.timed_event_factory())
    x = torch.randn(1 << 22, device="cuda")
    with SyncDetector(tracer) as detector, hot_region():
        for step in range(200):
            with timeline.stage("forward", step=step, stream=device.compute_stream):
                device.submit(device.compute_stream, lambda: x.mul_(1.0001))
            timeline.poll()
    torch.cuda.synchronize()
    timeline.drain()
    tracer.close()
    assert [h for h in detector.hits if h.hot] == []
    slices = [s for s in read_trace(path).slices() if s[0] == "gpu:0 compute"]
    assert len(slices) == 200
    starts = [s[2] for s in slices]
    assert starts == sorted(starts)


@pytest.mark.parametrize("begins", ["recorded", "derived", "both"])
def test_a_stage_site_writes_what_timeline_stage_writes(tmp_path, begins):
    """``timeline.site(...).stage(...)`` (the runner's way) and ``timeline.stage(...)`` give the
    same slices: names, tracks, args in the same order (the site's, the stage's own, then
    ``step`` and ``host_end_ns``), and a site's args are not changed by its slices."""
    written = []
    for use_site in (False, True):
        path = str(tmp_path / f"{use_site}.pftrace")
        tracer = Tracer(path)
        device = CpuDevice()
        timeline = DeviceTimeline(tracer, 0, device.timed_event_factory(), begins=begins)
        h2d, compute = device.h2d_stream, device.compute_stream
        copy = timeline.site("h2d_inputs", lane="copy", stream=h2d)
        fwd = timeline.site("forward", stream=compute, graph_replay=True)
        for step in range(3):
            if use_site:
                with copy.stage(step) as copied:
                    device.submit(h2d, _busy(0.001, []))
                device.wait_event(compute, timeline.event_after_stage(h2d, device.new_event))
                with fwd.stage(step, after=copied, args={"flow_in": 7 + step, "n": step}):
                    device.submit(compute, _busy(0.001, []))
                with fwd.stage(step, contiguous=True):
                    device.submit(compute, _busy(0.001, []))
            else:
                with timeline.stage("h2d_inputs", step=step, lane="copy", stream=h2d) as copied:
                    device.submit(h2d, _busy(0.001, []))
                device.wait_event(compute, timeline.event_after_stage(h2d, device.new_event))
                with timeline.stage(
                    "forward", step=step, stream=compute, after=copied, graph_replay=True,
                    flow_in=7 + step, n=step,
                ):  # fmt: skip
                    device.submit(compute, _busy(0.001, []))
                with timeline.stage(
                    "forward", step=step, stream=compute, contiguous=True, graph_replay=True
                ):
                    device.submit(compute, _busy(0.001, []))
            device.synchronize()  # each step done before the next one is enqueued
        timeline.drain()
        assert fwd.args == {"graph_replay": True}
        device.close()
        tracer.close()
        slices = read_trace(path).slices()
        written.append(
            sorted((t, name, args["step"], list(args)) for t, name, _, _, args in slices)
        )
    assert len(written[0]) == 9 and written[0] == written[1]
    own = [keys for _, _, _, keys in written[1] if "n" in keys]
    assert own and all(keys[:4] == ["graph_replay", "n", "step", "host_end_ns"] for keys in own)


# Each test runs with both cores of the stages (tests/instrument/conftest.py).
pytestmark = pytest.mark.usefixtures("stage_core")
