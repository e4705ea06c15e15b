"""The device timeline's CUDA path, counted with stand-in events: event calls per engine step,
and batched, bisected polls that lose no stage and read every time exactly."""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from types import SimpleNamespace

import pytest

from analysis import load_trace
from instrument import device_timeline
from instrument.cuda_driver import StandInDriver
from instrument.device_events import StandInCudaEvent, StandInStream
from instrument.device_timeline import DeviceTimeline
from instrument.tracer import Tracer

# The runner's stages per step, as model_runner records them: (name, lane, stream, contiguous,
# followed by a sync event the runner waits on: inputs_ready, sampled_ready, the output's ready).
STAGES = [
    ("h2d_inputs", "copy", "h2d", False, True),
    ("input_prep", "compute", "compute", False, False),
    ("forward", "compute", "compute", True, False),
    ("sample", "compute", "compute", True, True),
    ("d2h_output", "copy", "d2h", False, True),
]


class EngineLoop:
    """The runner's calls into the timeline, step by step, over stand-in streams; remembers the
    host stamp of every stage's begin and end event (the reference the slices must match)."""

    def __init__(
        self,
        tracer: Tracer,
        wait_only: bool = False,
        driver: StandInDriver | None = None,
        **timeline_kwargs: int,
    ) -> None:
        self.wait_only = wait_only  # the runner's inputs_ready / sampled_ready: waited on at once
        self.streams = {name: StandInStream() for name in ("h2d", "compute", "d2h")}
        clock = StandInCudaEvent.clock(driver=driver)
        self.timeline = DeviceTimeline(tracer, 0, clock, **timeline_kwargs)
        self.expected: dict[tuple[int, str], tuple[int, int]] = {}
        self.done_at: dict[tuple[int, str], tuple[str, int]] = {}  # (stream, end event seq)
        self.sync_events: list[tuple[StandInCudaEvent, int]] = []  # (event, its stamp)

    def launch(self, step: int) -> None:
        self.timeline.poll_if_due()  # the runner's hook, at prepare_inputs
        for name, lane, stream_name, contiguous, sync in STAGES:
            stream = self.streams[stream_name]
            with self.timeline.stage(
                name, step=step, lane=lane, stream=stream, contiguous=contiguous
            ):
                pass
            scope = self.timeline._last
            if scope is not None:  # traced
                self.expected[(step, name)] = (scope.begin.ns, scope.end.ns)
                self.done_at[(step, name)] = (stream_name, stream.num_recorded)
            if sync:
                wait_only = self.wait_only and name != "d2h_output"
                event = self.timeline.event_after_stage(
                    stream, StandInCudaEvent, wait_only=wait_only
                )
                if not wait_only:
                    self.sync_events.append((event, event.ns))

    def finish(self) -> None:
        """Let every stream run to its end, then drain the timeline."""
        for stream in self.streams.values():
            stream.advance()
        self.timeline.drain()

    def completed(self) -> set[tuple[int, str]]:
        """Brute force: the stages whose end event the simulated device has passed."""
        return {
            key
            for key, (stream, seq) in self.done_at.items()
            if seq <= self.streams[stream].num_done
        }


def _device_slices(path: str) -> dict[tuple[int, str], tuple[int, int]]:
    frames = load_trace(path)
    s = frames.slices[frames.slices["track"].str.startswith("gpu:0")]
    keys = list(zip(s["step"].astype(int), s["name"], strict=True))
    assert len(keys) == len(set(keys)), "a stage was written twice"
    return dict(zip(keys, zip(s["ts_ns"], s["end_ns"], strict=True), strict=True))


def test_event_calls_per_engine_step(tmp_path):
    """Async engine: step N is launched while N-1 runs; the engine waits for N-1 on a busy
    device. Per step: 8 records (5 stages, 2 contiguous), 8 conversions (one per distinct
    event), and far fewer queries than one per stage (was 8 / ~6 / 8 before batching)."""
    path = str(tmp_path / "t.pftrace")
    tracer = Tracer(path)
    loop = EngineLoop(tracer)
    num_steps = 640
    made = []
    new_event = loop.timeline._new
    loop.timeline._new = lambda: made.append(1) or new_event()
    StandInCudaEvent.reset_calls()
    launched: dict[str, int] = {}
    for step in range(num_steps):
        loop.launch(step)
        loop.timeline.poll_while_waiting(lambda: False)  # the device still runs step - 1
        for name, stream in loop.streams.items():
            stream.num_done = launched.get(name, 0)
            launched[name] = stream.num_recorded
    loop.finish()
    calls = {k: v / num_steps for k, v in StandInCudaEvent.calls.items()}
    # 8 events a step, 3 of them the runner's sync events (recorded untraced too: 5 added).
    # integers: a float difference with anchors recorded (a slow run) is not exactly 8
    records = StandInCudaEvent.calls["record"] - loop.timeline.ops.num_anchor_records
    assert records == 8 * num_steps
    anchors = loop.timeline.ops.num_anchor_records / num_steps  # each read once or twice
    # 8 a step, a few more where a contiguous begin was split across polls
    assert calls["elapsed_time"] - anchors >= 8 and calls["elapsed_time"] - 2 * anchors <= 8.2
    assert calls["query"] <= 2
    assert len(made) < 200 + 3 * num_steps  # pooled, but for the 3 lent per step
    # A lent sync event is the stage's end event, and is never recorded again.
    assert len(loop.sync_events) == 3 * num_steps
    assert all(event.ns == ns for event, ns in loop.sync_events)
    ends = {(step, name): loop.expected[(step, name)][1] for step, name in loop.expected}
    lent = [ends[(s, n)] for s in range(num_steps) for n in ("h2d_inputs", "sample", "d2h_output")]
    assert [ns for _, ns in loop.sync_events] == lent
    tracer.close()
    assert loop.timeline.num_recorded == loop.timeline.num_emitted == 5 * num_steps
    written = _device_slices(path)
    assert written.keys() == loop.expected.keys()
    for key, (start, end) in loop.expected.items():
        got = written[key]
        assert abs(got[0] - start) <= 1 and abs(got[1] - end) <= 1, key  # ms float round trip
    metadata = load_trace(path).metadata
    assert not any(k.startswith("dropped_") for k in metadata), metadata


@pytest.mark.parametrize("poll_batch", [1, 3, 16])
def test_polls_emit_exactly_the_completed_stages(tmp_path, poll_batch):
    """Random device progress per stream: after every poll, the emitted stages are exactly those
    whose end event completed (the brute-force set), whatever the batch boundaries; contiguous
    stages split across polls keep their shared event until both are out (exact times)."""
    rng = random.Random(poll_batch)
    path = str(tmp_path / "t.pftrace")
    tracer = Tracer(path)
    loop = EngineLoop(tracer, poll_batch=poll_batch, max_deferred=4 * poll_batch)
    emitted: set[tuple[int, str]] = set()
    observed: list[tuple[int, str]] = []
    loop.timeline.observer = lambda lane, name, step, s, e: observed.append((step, name))
    for step in range(300):
        loop.launch(step)
        for stream in loop.streams.values():
            stream.advance(rng.randint(0, 4))
        loop.timeline.poll()
        emitted = set(observed)
        assert emitted == loop.completed()
        assert len(observed) == len(emitted)  # nothing emitted twice
    loop.finish()
    tracer.close()
    written = _device_slices(path)
    assert written.keys() == loop.expected.keys()
    for key, (start, end) in loop.expected.items():
        assert abs(written[key][0] - start) <= 1 and abs(written[key][1] - end) <= 1, key


def test_untraced_steps_record_only_the_runners_sync_events():
    loop = EngineLoop(Tracer(enabled=False))
    StandInCudaEvent.reset_calls()
    for step in range(10):
        loop.launch(step)
    loop.timeline.poll_while_waiting(lambda: False)
    assert StandInCudaEvent.calls == {"record": 30, "query": 0, "elapsed_time": 0, "create": 30}
    assert loop.timeline.num_recorded == 0


def test_poll_while_waiting_only_on_a_busy_device_and_a_full_batch(tmp_path):
    tracer = Tracer(str(tmp_path / "t.pftrace"))
    loop = EngineLoop(tracer, poll_batch=10, max_deferred=20)
    loop.launch(0)
    loop.launch(1)  # 10 stages pending
    for stream in loop.streams.values():
        stream.advance()
    StandInCudaEvent.reset_calls()
    assert loop.timeline.poll_while_waiting(lambda: True) == 0  # output ready: no wait to use
    assert StandInCudaEvent.calls["query"] == 0
    assert loop.timeline.poll_if_due() == 0  # below max_deferred
    assert loop.timeline.poll_while_waiting(lambda: False) == 10
    loop.launch(2)
    assert loop.timeline.poll_while_waiting(lambda: False) == 0  # 5 pending < poll_batch
    for step in range(3, 6):
        loop.launch(step)
    for stream in loop.streams.values():
        stream.advance()
    assert loop.timeline.num_pending == 20
    assert loop.timeline.poll_if_due() == 20  # the hot-path hook polls once max_deferred is hit
    tracer.close()


def test_stages_that_never_complete_are_counted(tmp_path):
    path = str(tmp_path / "t.pftrace")
    tracer = Tracer(path)
    loop = EngineLoop(tracer)
    for step in range(4):
        loop.launch(step)
    loop.streams["h2d"].advance()  # only the copies in reach the device
    loop.timeline.drain()
    tracer.close()
    assert loop.timeline.num_emitted == 4 and loop.timeline.num_dropped == 16
    assert load_trace(path).metadata["dropped_device_slices"] == 16


def test_a_contiguous_stage_after_a_poll_keeps_the_shared_event(tmp_path):
    """A poll between two contiguous stages (the first already emitted): the first's end event
    must not be recorded again before the second stage, which begins at it, is read."""
    path = str(tmp_path / "t.pftrace")
    tracer = Tracer(path)
    compute, copy = StandInStream(), StandInStream()
    timeline = DeviceTimeline(tracer, 0, StandInCudaEvent.clock())
    for step in range(3):  # some emitted stages: events in the pool
        with timeline.stage("forward", step=step, stream=compute):
            pass
    compute.advance()
    timeline.poll()
    with timeline.stage("input_prep", step=3, stream=compute):
        pass
    prep_end = timeline._last.end.ns
    compute.advance()
    assert timeline.poll() == 1  # input_prep is out; its end is still the newest event
    with timeline.stage("forward", step=3, stream=compute, contiguous=True):
        pass
    for step in range(4, 8):  # records on another stream take events from the pool
        with timeline.stage("h2d_inputs", step=step, lane="copy", stream=copy):
            pass
    compute.advance()
    copy.advance()
    timeline.drain()
    tracer.close()
    written = _device_slices(path)
    assert abs(written[(3, "forward")][0] - prep_end) <= 1
    assert abs(written[(3, "input_prep")][1] - prep_end) <= 1


def test_a_lent_end_is_never_shared_or_recorded_again(tmp_path):
    tracer = Tracer(str(tmp_path / "t.pftrace"))
    stream = StandInStream()
    timeline = DeviceTimeline(tracer, 0, StandInCudaEvent.clock())
    with timeline.stage("sample", step=0, stream=stream):
        pass
    ready = timeline.event_after_stage(stream, StandInCudaEvent)
    assert ready is timeline._last.end
    stamp = ready.ns
    for step in range(1, 50):  # a contiguous stage may not begin at a lent event
        with timeline.stage("forward", step=step, stream=stream, contiguous=True):
            pass
        stream.advance()
        timeline.poll()
    timeline.drain()
    tracer.close()
    assert ready.ns == stamp and timeline.num_emitted == 50


@pytest.mark.gpu
@pytest.mark.parametrize("api", ["torch", "driver"])
def test_cuda_clock_calls_the_c_methods_and_reads_what_torch_reads(api: str):
    """On CUDA the clock's record / query / elapsed_time are torch's C methods (no Python frame)
    with ``api="torch"``, or the CUDA driver's calls (instrument/cuda_driver.py, self-tested at
    calibration) with ``api="driver"``; either way a batch conversion reads what
    torch.cuda.Event.elapsed_time reads per event (to 1 µs: the driver's clock re-bases on its
    anchors, docs/design.md §4.3)."""
    import types

    import torch

    from instrument.device_events import CudaClock

    clock = CudaClock.calibrate(api=api)
    if api == "torch":
        for fn in (clock.record, clock.query, clock._elapsed_ms):
            assert not isinstance(fn, types.FunctionType)
    else:
        assert clock.driver is not None, clock.api_reason
    stream = torch.cuda.Stream()
    x = torch.randn(1 << 20, device="cuda")
    events = []
    for _ in range(4):
        with torch.cuda.stream(stream):
            x.mul_(1.0001)
        event = clock.new()
        clock.record(event, stream)
        events.append(event)
    torch.cuda.synchronize()
    assert all(clock.query(e) for e in events)
    got = clock.host_ns_many(events)
    want = [clock.reference_host_ns + int(clock.reference.elapsed_time(e) * 1e6) for e in events]
    assert got == sorted(got)
    if api == "torch":  # the same float milliseconds, to the nanosecond (the H200: one read
        # 1 ns apart, rounding against this test's truncation)
        assert max(abs(g - w) for g, w in zip(got, want, strict=True)) <= 1
    else:
        assert max(abs(g - w) for g, w in zip(got, want, strict=True)) <= 1_000


def _run_async(loop: EngineLoop, num_steps: int, wait_s: float = 0.0) -> None:
    """Step N launched while the device runs N-1; the engine waits on a busy device (for
    ``wait_s``, releasing the GIL as the engine's wait does)."""
    launched: dict[str, int] = {}
    for step in range(num_steps):
        loop.launch(step)
        loop.timeline.poll_while_waiting(lambda: False)
        if wait_s:
            time.sleep(wait_s)
        for name, stream in loop.streams.items():
            stream.num_done = launched.get(name, 0)
            launched[name] = stream.num_recorded
    loop.finish()


def test_wait_only_sync_events_return_to_the_pool(tmp_path):
    """The runner's inputs_ready / sampled_ready are only waited on at once (``wait_only``):
    they go back to the pool, so one event is made per step (the output's ``ready``, which the
    caller keeps) instead of three; every slice's times stay exact and ``ready`` is never
    recorded again."""
    path = str(tmp_path / "t.pftrace")
    tracer = Tracer(path)
    loop = EngineLoop(tracer, wait_only=True)
    num_steps = 640
    StandInCudaEvent.reset_calls()
    _run_async(loop, num_steps)
    calls = {k: v / num_steps for k, v in StandInCudaEvent.calls.items()}
    # integers: a float difference with anchors recorded (a slow run) is not exactly 8
    records = StandInCudaEvent.calls["record"] - loop.timeline.ops.num_anchor_records
    assert records == 8 * num_steps
    assert calls["create"] < 1 + 200 / num_steps  # was 3 per step (all three lent)
    assert len(loop.sync_events) == num_steps
    assert all(event.ns == ns for event, ns in loop.sync_events)  # ready: never re-recorded
    tracer.close()
    assert loop.timeline.num_recorded == loop.timeline.num_emitted == 5 * num_steps
    written = _device_slices(path)
    assert written.keys() == loop.expected.keys()
    for key, (start, end) in loop.expected.items():
        got = written[key]
        assert abs(got[0] - start) <= 1 and abs(got[1] - end) <= 1, key


def test_background_poller_writes_the_same_slices(tmp_path):
    """``background``: the poll at the wait runs on the poller thread while the engine thread
    keeps recording stages; every stage is still emitted once, with exact times, nothing is
    dropped, and the engine thread made no query or conversion at the wait."""
    path = str(tmp_path / "t.pftrace")
    tracer = Tracer(path)
    loop = EngineLoop(tracer, wait_only=True, background=True)
    timeline = loop.timeline
    at_wait = []  # queries the engine thread made inside poll_while_waiting
    in_wait = False
    query, poll_while_waiting = timeline._query, timeline.poll_while_waiting
    main = threading.get_ident()

    def counting_query(event):
        if in_wait and threading.get_ident() == main:
            at_wait.append(1)
        return query(event)

    def waiting(done):
        nonlocal in_wait
        in_wait = True
        try:
            return poll_while_waiting(done)
        finally:
            in_wait = False

    timeline._query = counting_query
    timeline.poll_while_waiting = waiting
    polled_in_background = []
    poll = timeline.poll
    timeline.poll = lambda *a: (
        polled_in_background.append(threading.get_ident() != main) or poll(*a)
    )
    num_steps = 800
    _run_async(loop, num_steps, wait_s=0.0005)
    assert timeline._poller is None  # drain stopped it
    assert not at_wait  # the poll at the wait ran on the poller thread
    assert any(polled_in_background)
    # the counts say where due polls went: handed over, and none at the wait on this thread
    assert timeline.polls_woken > 0
    assert timeline.polls_inline == sum(1 for bg in polled_in_background if not bg)
    assert timeline.poller_cpu_ns > 0  # its polls' CPU time, counted on its own thread
    tracer.close()
    assert timeline.num_recorded == timeline.num_emitted == 5 * num_steps
    assert timeline.num_dropped == 0 and timeline.num_pending == 0
    written = _device_slices(path)
    assert written.keys() == loop.expected.keys()
    for key, (start, end) in loop.expected.items():
        got = written[key]
        assert abs(got[0] - start) <= 1 and abs(got[1] - end) <= 1, key
    assert not any(k.startswith("dropped_") for k in load_trace(path).metadata)


def test_background_poller_failure_reaches_the_engine_thread(tmp_path):
    tracer = Tracer(str(tmp_path / "t.pftrace"))
    loop = EngineLoop(tracer, background=True, poll_batch=5, max_deferred=50)

    def broken(event):
        raise ValueError("device lost")

    query = loop.timeline._query
    loop.timeline._query = broken
    loop.launch(0)
    loop.timeline.poll_while_waiting(lambda: False)  # wakes the poller, which fails
    loop.timeline._poller.join(timeout=5)
    with pytest.raises(RuntimeError, match="poller failed") as info:
        loop.timeline.poll_while_waiting(lambda: False)
    assert isinstance(info.value.__cause__, ValueError)
    loop.timeline._query = query
    for stream in loop.streams.values():
        stream.advance()
    with pytest.raises(RuntimeError, match="poller failed"):
        loop.timeline.drain()
    loop.timeline.drain()  # reported once; the stages are then emitted
    assert loop.timeline.num_emitted == 5
    tracer.close()


@pytest.mark.parametrize("background", [False, True])
def test_given_back_ready_events_return_to_the_pool(tmp_path, background):
    """The output's ``ready`` is lent; once the engine has waited for it (``give_back``, as
    ``AsyncOutput.get`` does) it returns to the pool: no event made per step at all. It is never
    recorded again before it is given back, and every slice's times stay exact."""
    path = str(tmp_path / "t.pftrace")
    tracer = Tracer(path)
    loop = EngineLoop(tracer, wait_only=True, background=background)
    timeline = loop.timeline
    num_steps = 640
    StandInCudaEvent.reset_calls()
    launched: dict[str, int] = {}
    for step in range(num_steps):
        loop.launch(step)
        timeline.poll_while_waiting(lambda: False)
        if background:
            time.sleep(0.0002)
        for name, stream in loop.streams.items():
            stream.num_done = launched.get(name, 0)
            launched[name] = stream.num_recorded
        if step:  # the engine got step - 1's output: its ready event is done with
            event, ns = loop.sync_events[step - 1]
            assert event.ns == ns  # not recorded again while lent
            timeline.give_back(event)
    timeline.give_back(StandInCudaEvent())  # not lent: ignored
    for stream in loop.streams.values():
        stream.advance()
    timeline.drain()
    # integers: a float difference with anchors recorded (a slow run) is not exactly 8
    records = StandInCudaEvent.calls["record"] - loop.timeline.ops.num_anchor_records
    assert records == 8 * num_steps
    # Was 3 per step, 1 with wait-only events. The pool grows to what is pending at a poll (a
    # poll batch of stages and the steps enqueued meanwhile), not with the run's length.
    assert StandInCudaEvent.calls["create"] < 2 * timeline.poll_batch + 40
    tracer.close()
    assert timeline.num_recorded == timeline.num_emitted == 5 * num_steps
    written = _device_slices(path)
    assert written.keys() == loop.expected.keys()
    for key, (start, end) in loop.expected.items():
        got = written[key]
        assert abs(got[0] - start) <= 1 and abs(got[1] - end) <= 1, key


@pytest.mark.parametrize("inline_when_host_bound", [True, False])
def test_host_bound_engine_polls_on_its_own_thread_only_when_asked(
    tmp_path, monkeypatch, inline_when_host_bound
):
    """A host-bound engine: every step's output is ready when the engine reaches its wait, so
    the wait never wakes the poller. By default the hot-path hook then polls on the engine thread
    at ``max_deferred`` pending stages: a poller thread could only run by taking the GIL from an
    engine that never blocks (on the H200 a host-bound run paid +256 us a step with it). With
    ``inline_when_host_bound=False`` (the earlier behaviour) it wakes the poller thread instead,
    which emits in chunks of ``POLL_CHUNK``, and no query runs on the engine thread before drain.
    Either way every stage is emitted once with exact times."""
    chunk = 16  # below the backlogs of this loop (40 stages), so they are emitted chunk by chunk
    monkeypatch.setattr(device_timeline, "POLL_CHUNK", chunk)
    path = str(tmp_path / "t.pftrace")
    tracer = Tracer(path)
    loop = EngineLoop(
        tracer, wait_only=True, background=True, poll_batch=8, max_deferred=40,
        inline_when_host_bound=inline_when_host_bound,
    )  # fmt: skip
    timeline = loop.timeline
    main = threading.get_ident()
    on_main = []
    chunks = []
    query, poll = timeline._query, timeline.poll
    timeline._query = lambda e: on_main.append(threading.get_ident() == main) or query(e)

    def chunked(limit=None):
        n = poll(limit)
        if threading.get_ident() != main:
            chunks.append((limit, n))
        return n

    timeline.poll = chunked
    launched: dict[str, int] = {}
    num_steps = 400
    for step in range(num_steps):
        loop.launch(step)
        assert timeline.poll_while_waiting(lambda: True) == 0  # output ready: no wait to use
        time.sleep(0.0001)  # the engine's other work, releasing the GIL now and then
        for name, stream in loop.streams.items():
            stream.num_done = launched.get(name, 0)
            launched[name] = stream.num_recorded
    if inline_when_host_bound:
        assert not chunks and timeline._poller is None  # the poller never started
        assert on_main and all(on_main)  # every query ran on the engine thread
    else:
        assert chunks and all(limit == chunk and n <= chunk for limit, n in chunks)
        assert max(n for _, n in chunks) == chunk  # a backlog is emitted chunk by chunk
        assert not any(on_main)  # every poll ran on the poller thread
    assert timeline.num_emitted > 0
    for stream in loop.streams.values():
        stream.advance()
    timeline.drain()
    tracer.close()
    assert timeline.num_recorded == timeline.num_emitted == 5 * num_steps
    written = _device_slices(path)
    assert written.keys() == loop.expected.keys()
    for key, (start, end) in loop.expected.items():
        got = written[key]
        assert abs(got[0] - start) <= 1 and abs(got[1] - end) <= 1, key
    assert not any(k.startswith("dropped_") for k in load_trace(path).metadata)


def test_hot_path_hook_polls_inline_only_when_the_poller_cannot_keep_up(tmp_path):
    """``poll_if_due`` with ``background``: wakes the poller between ``max_deferred`` and
    ``max_pending // 2`` pending stages; past that (a poller that cannot keep up) it polls on
    the calling thread, so pending stages stay bounded without drops."""
    tracer = Tracer(str(tmp_path / "t.pftrace"))
    loop = EngineLoop(tracer, background=True, poll_batch=5, max_deferred=10, max_pending=40)
    timeline = loop.timeline
    woken = []
    timeline._wake = lambda: woken.append(timeline.num_pending)  # a poller that never polls
    for step in range(4):
        loop.launch(step)  # hook first: 0, 5, 10, 15 pending when it runs
    assert woken == [10, 15] and timeline.num_emitted == 0
    for stream in loop.streams.values():
        stream.advance()
    loop.launch(4)  # 20 pending = max_pending // 2: inline
    assert timeline.num_emitted == 20 and woken == [10, 15]
    timeline.drain()
    tracer.close()


def test_tracing_switched_off_and_on_mid_run_keeps_every_traced_stage(tmp_path):
    """Tracing switched off and on every 3 steps (Tracer.muted, bench_trace_overhead.py
    --interleaved): stages recorded while on and emitted by polls while off are written, with
    their exact times; untraced steps add nothing; nothing is dropped."""
    path = str(tmp_path / "t.pftrace")
    tracer = Tracer(path)
    loop = EngineLoop(tracer)
    for step in range(60):
        tracer.enabled = (step // 3) % 2 == 0
        loop.launch(step)
        for stream in loop.streams.values():
            stream.advance(3)
        loop.timeline.poll()  # half of these run while tracing is off
    tracer.enabled = True
    loop.finish()
    tracer.close()
    written = _device_slices(path)
    assert written.keys() == loop.expected.keys()
    assert {step for step, _ in written} == {s for s in range(60) if (s // 3) % 2 == 0}
    for key, (start, end) in loop.expected.items():
        assert abs(written[key][0] - start) <= 1 and abs(written[key][1] - end) <= 1, key
    assert not any(k.startswith("dropped_") for k in load_trace(path).metadata)


def test_a_contiguous_stage_after_untraced_work_records_its_own_begin(tmp_path):
    """Work enqueued while tracing was off lies between the last traced stage and the next one:
    that stage cannot begin at the last one's end event, even when declared contiguous."""
    tracer = Tracer(str(tmp_path / "t.pftrace"))
    loop = EngineLoop(tracer)
    compute = loop.streams["compute"]
    with loop.timeline.stage("forward", step=0, stream=compute):
        pass
    first = loop.timeline._last
    with tracer.muted():
        with loop.timeline.stage("forward", step=1, stream=compute):
            StandInCudaEvent().record(compute)  # untraced work on the stream
    with loop.timeline.stage("sample", step=1, stream=compute, contiguous=True):
        pass
    second = loop.timeline._last
    assert second is not first and second.begin is not first.end
    assert second.begin.ns > first.end.ns
    tracer.close()


def test_poll_sections_count_every_emitted_stage_and_converted_event(tmp_path):
    """``poll_sections_ns`` (set by a bench): every poll adds its CPU per section and the stages
    and events it covered; over a run the stages are every emitted slice and the events every
    conversion the driver made (begins read once where a stage is contiguous), and the poller's
    wall time is counted beside its CPU time."""
    tracer = Tracer(str(tmp_path / "t.pftrace"))
    driver = StandInDriver()
    loop = EngineLoop(tracer, wait_only=True, driver=driver, background=True)
    timeline = loop.timeline
    sections = timeline.poll_sections_ns = [0] * len(device_timeline.POLL_SECTIONS)
    clock = timeline.ops
    _run_async(loop, 400, wait_s=0.0002)
    tracer.close()
    named = dict(zip(device_timeline.POLL_SECTIONS, sections, strict=True))
    assert named["stages"] == timeline.num_emitted == 5 * 400
    converted = driver.calls["elapsed_time"] - clock.num_anchors  # an anchor's own conversion
    assert named["events"] == converted
    assert named["stages"] < named["events"] <= 2 * named["stages"]
    assert all(named[k] > 0 for k in ("query", "convert", "build", "hand"))
    assert timeline.poller_cpu_ns > 0
    assert timeline.poller_wall_ns >= 0.99 * timeline.poller_cpu_ns  # two clocks' readings


def test_the_completed_count_is_exact_and_cheap_near_the_newest(tmp_path):
    """``_completed`` against every boundary of every queue length up to 40 (brute force): the
    count of completed stages is exact, a queue done through its newest stage costs one query,
    and a boundary within the newest few costs at most 2 + 2 log2(distance) queries (a poll runs
    while the device works on the newest step); a far one at most 2 log2(n) + 2, about twice a
    bisection of all n (the host runs a step or two ahead, so far boundaries are rare)."""
    timeline = DeviceTimeline(Tracer(str(tmp_path / "t.pftrace")), 0, StandInCudaEvent.clock())
    for n in range(1, 41):
        for done in range(n + 1):
            stages = deque(SimpleNamespace(end=i) for i in range(n))
            asked: list[int] = []
            timeline._query = lambda end, done=done, asked=asked: asked.append(end) or end < done
            assert timeline._completed(stages, n) == done
            distance = n - done  # incomplete stages at the newest end
            if distance == 0:
                assert len(asked) == 1
            else:
                assert len(asked) <= 2 + 2 * math.log2(distance)
            assert len(asked) <= 2 * math.log2(n) + 2
            assert timeline._completed(stages, done) == done  # a limit below: those only


def test_in_wait_polls_emit_in_chunks_until_the_output_is_ready(tmp_path):
    """``in_wait``: the engine thread's poll at its wait emits ``WAIT_CHUNK`` stages at a time
    and stops as soon as the output it waits for is ready, leaving the rest pending for a later
    wait; over a run every stage is still written exactly once with its exact times. The polls'
    CPU, wall and overrun bound are counted (the overrun only for polls the output cut short)."""
    path = str(tmp_path / "t.pftrace")
    tracer = Tracer(path)
    loop = EngineLoop(tracer, wait_only=True, in_wait=True, poll_batch=200, max_deferred=400)
    timeline = loop.timeline
    chunk = device_timeline.WAIT_CHUNK
    launched: dict[str, int] = {}
    cut_short = 0
    for step in range(300):
        loop.launch(step)
        checks = {"n": 0}
        ready_after = 1 + step % 3  # the output becomes ready after 1-3 chunks

        def done(checks=checks, ready_after=ready_after) -> bool:
            checks["n"] += 1  # the first check is poll_while_waiting's own, before any chunk
            return checks["n"] > ready_after

        pending = timeline.num_pending
        emitted = timeline.poll_while_waiting(done)
        if pending >= timeline.poll_batch:
            assert emitted <= chunk * ready_after  # stopped once done() said ready
            if emitted == chunk * ready_after:
                cut_short += 1
        else:
            assert emitted == 0
        for name, stream in loop.streams.items():
            stream.num_done = launched.get(name, 0)
            launched[name] = stream.num_recorded
    assert timeline.polls_in_wait > 0 and timeline.polls_woken == 0
    assert cut_short > 0  # some polls left completed stages for a later wait
    assert timeline.wait_poll_wall_ns >= timeline.wait_poll_overrun_ns > 0
    assert timeline.wait_poll_cpu_ns > 0
    loop.finish()
    tracer.close()
    assert timeline.num_emitted == timeline.num_recorded == 5 * 300
    written = _device_slices(path)
    assert written.keys() == loop.expected.keys()
    for key, (start, end) in loop.expected.items():
        got = written[key]
        assert abs(got[0] - start) <= 1 and abs(got[1] - end) <= 1, key


# Each test runs with both cores of the stages (tests/instrument/conftest.py).
pytestmark = pytest.mark.usefixtures("stage_core")
