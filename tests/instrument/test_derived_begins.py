"""Derived device begins (``DeviceTimeline(begins="derived" | "both")``, docs/design.md §4.3).

A stage that is not contiguous records no begin event; its slice begins at the latest of the
host time its enqueue began, the end of the slice before it on its stream, and the end of the
stage its stream waited for (``after``). Most tests drive the timeline with scripted events whose
completion times the test sets, so every term of the max is known exactly.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest

from engine.device import CpuDevice
from instrument.device_timeline import DeviceTimeline
from instrument.tracer import Tracer
from tests.instrument.conftest import read_trace


class Stream(list[Any]):
    """A stream of scripted events: they complete when the test gives them a time."""


class ScriptedEvent:
    """Completes when the test sets ``t`` (host-clock ns); recording it again clears ``t``."""

    recorded = 0

    def __init__(self) -> None:
        self.t: int | None = None

    def record(self, stream: Stream) -> None:
        ScriptedEvent.recorded += 1
        self.t = None
        stream.append(self)

    def query(self) -> bool:
        return self.t is not None

    def host_ns(self) -> int:
        assert self.t is not None
        return self.t


def _timeline(tmp_path: Any, begins: str = "derived", **kw: int) -> tuple[DeviceTimeline, str]:
    path = str(tmp_path / "t.pftrace")
    return DeviceTimeline(Tracer(path), 0, ScriptedEvent, begins=begins, **kw), path


def _stage(timeline: DeviceTimeline, name: str, stream: Stream, step: int = 0, **kw: Any) -> Any:
    with timeline.stage(name, step=step, stream=stream, **kw) as scope:
        pass
    return scope


def _prime(timeline: DeviceTimeline, *streams: Stream) -> None:
    """One stage per stream, done at t = 1 ns and emitted: the first stage on a stream records
    its begin (nothing bounds it yet), so the stages a test makes after this derive theirs."""
    for i, stream in enumerate(streams):
        scope = _stage(timeline, "prime", stream, step=-1 - i)
        assert scope.begin is not None  # recorded (in every mode)
        scope.begin.t = scope.end.t = 1
    timeline.poll()


def _slices(timeline: DeviceTimeline, path: str) -> dict[tuple[str, int], tuple[int, int, dict]]:
    """(name, step) -> (start, end, args) of every device slice written."""
    timeline.drain()
    timeline.tracer.close()
    out = {}
    for track, name, start, end, args in read_trace(path).slices():
        if track.startswith("gpu:0") and name != "prime":
            assert (name, args["step"]) not in out, "a stage was written twice"
            out[(name, args["step"])] = (start, end, args)
    return out


def test_derived_begin_is_the_latest_of_host_previous_end_and_waited_for_end(tmp_path):
    timeline, path = _timeline(tmp_path)
    copy, compute = Stream(), Stream()
    _prime(timeline, copy, compute)
    # 1: the host is the latest term (the stream idle, waiting for the enqueue).
    a = _stage(timeline, "a", compute, step=1)
    a.end.t = a.host_begin_ns + 1  # done before the host enqueues b
    b = _stage(timeline, "b", compute, step=1)
    assert b.host_begin_ns > a.end.t
    assert b.begin is None  # no begin event recorded
    b.end.t = b.host_begin_ns + 5_000
    timeline.poll()
    # 2: the previous stage on the stream ends after the host enqueued this one.
    c = _stage(timeline, "c", compute, step=2)
    c.end.t = c.host_begin_ns + 10**9  # far past d's enqueue, however slow this machine is
    d = _stage(timeline, "d", compute, step=2)
    d.end.t = c.end.t + 20_000
    # 3: the stage the stream waited for (another stream) ends last.
    h = _stage(timeline, "h2d", copy, step=3, lane="copy")
    e = _stage(timeline, "e", compute, step=3, after=h)
    h.end.t = d.end.t + 40_000
    e.end.t = h.end.t + 10_000
    written = _slices(timeline, path)
    assert written[("b", 1)][:2] == (b.host_begin_ns, b.end.t)
    assert written[("d", 2)][:2] == (c.end.t, d.end.t)
    assert written[("e", 3)][:2] == (h.end.t, e.end.t)
    # h2d's own begin: its host time (nothing waited for, its stream idle).
    assert written[("h2d", 3)][0] == h.host_begin_ns


def test_contiguous_stages_still_begin_at_the_previous_end(tmp_path):
    timeline, path = _timeline(tmp_path)
    compute = Stream()
    _prime(timeline, compute)
    prep = _stage(timeline, "input_prep", compute)
    forward = _stage(timeline, "forward", compute, contiguous=True)
    assert forward.begin is prep.end and not hasattr(forward, "host_begin_ns")
    prep.end.t = prep.host_begin_ns + 1_000
    forward.end.t = prep.end.t + 7_000
    written = _slices(timeline, path)
    assert written[("forward", 0)][:2] == (prep.end.t, forward.end.t)
    assert written[("input_prep", 0)][1] == written[("forward", 0)][0]  # abut, no overlap


def test_a_dependency_emitted_by_an_earlier_poll_and_its_event_recycled(tmp_path):
    """input_prep waits for h2d_inputs; h2d_inputs is emitted first and its end event goes back
    to the pool and is recorded again, with another time, before input_prep is emitted: the
    derived begin uses the time h2d_inputs' slice ended, not what the event reads now."""
    timeline, path = _timeline(tmp_path)
    copy, compute = Stream(), Stream()
    _prime(timeline, copy, compute)
    h = _stage(timeline, "h2d_inputs", copy, step=0, lane="copy")
    prep = _stage(timeline, "input_prep", compute, step=0, after=h)
    h_end = h.end
    h.end.t = prep.host_begin_ns + 30_000
    assert timeline.poll() == 1  # h2d_inputs only: input_prep has not completed
    assert h.end_ns == h_end.t
    again = _stage(timeline, "h2d_inputs", copy, step=1, lane="copy")
    assert again.end is h_end  # the pooled event, recorded again
    h_end.t = h.end_ns + 500_000
    prep.end.t = h.end_ns + 60_000
    assert timeline.poll() == 2
    written = _slices(timeline, path)
    assert written[("input_prep", 0)][:2] == (h.end_ns, prep.end.t)


def test_a_dependency_later_in_the_same_poll_or_left_pending_by_its_limit(tmp_path):
    """Streams are polled in the order they were first used: here compute before copy, so a
    compute stage is converted before the copy stage it waited for (same poll), or emitted while
    that stage is still pending (a poll's limit): both read the dependency's end."""
    timeline, path = _timeline(tmp_path, poll_batch=1, max_deferred=1)
    copy, compute = Stream(), Stream()
    _prime(timeline, compute, copy)  # compute's queue comes first
    first = _stage(timeline, "forward", compute, step=0)
    first.end.t = first.host_begin_ns + 1_000
    timeline.poll()
    for step, limit in ((1, None), (2, 1)):
        h = _stage(timeline, "h2d_inputs", copy, step=step, lane="copy")
        prep = _stage(timeline, "input_prep", compute, step=step, after=h)
        h.end.t = prep.host_begin_ns + 200_000
        prep.end.t = h.end.t + 1_000
        assert timeline.poll(limit) == (2 if limit is None else 1)
        assert prep.emitted and h.emitted == (limit is None)
    written = _slices(timeline, path)
    for step in (1, 2):
        h_start, h_end, _ = written[("h2d_inputs", step)]
        assert written[("input_prep", step)][0] == h_end


def test_the_first_stage_on_a_stream_and_after_untraced_work_records_its_begin(tmp_path):
    """Tracing switched off and on (Tracer.muted, a sampled trace's dropped steps): work no slice
    covers may still be queued on every stream, so no term bounds the next stage's begin. The
    first stage on each stream after such a gap (and the first ever) records its begin event; the
    next one on that stream derives its begin again, from that stage's end."""
    timeline, path = _timeline(tmp_path)
    compute, copy = Stream(), Stream()
    a = _stage(timeline, "forward", compute, step=0)  # first ever on compute
    assert a.begin is not None
    a.begin.t, a.end.t = 5, 10_000
    timeline.poll()
    timeline.tracer.enabled = False
    with timeline.stage("forward", step=1, stream=compute) as untraced:
        assert untraced is None
    timeline.tracer.enabled = True
    # The untraced forward is still running on the device, far behind the host.
    b = _stage(timeline, "sample", compute, step=2, contiguous=True)
    assert b.begin is not None  # recorded: nothing known bounds it
    h = _stage(timeline, "h2d_inputs", copy, step=3, lane="copy")
    assert h.begin is not None  # first on copy
    c = _stage(timeline, "input_prep", compute, step=3, after=h)
    assert c.begin is None  # derived: compute's work since the gap is all in b
    host = c.host_begin_ns
    b.begin.t = host + 3_000_000  # when the untraced forward finished
    b.end.t = b.begin.t + 5_000
    h.begin.t, h.end.t = host - 2_000, host - 1_000
    c.end.t = b.end.t + 7_000
    written = _slices(timeline, path)
    assert written[("sample", 2)][:2] == (b.begin.t, b.end.t)  # not the host time: the record
    assert written[("h2d_inputs", 3)][:2] == (h.begin.t, h.end.t)
    assert written[("input_prep", 3)][:2] == (b.end.t, c.end.t)  # b's end is the latest term


def test_a_dropped_stage_is_not_a_term(tmp_path):
    """Over ``max_pending`` the oldest pending stage of a stream is dropped (no slice): a later
    stage does not begin at its end; the other terms still hold (the last slice on the stream,
    the host time; here the dropped stage also was the one waited for)."""
    timeline, path = _timeline(tmp_path, max_pending=2, poll_batch=1, max_deferred=1)
    copy, compute = Stream(), Stream()
    _prime(timeline, copy, compute)
    a = _stage(timeline, "forward", compute, step=0)
    a.end.t = a.host_begin_ns + 1_000
    timeline.poll()
    dropped = _stage(timeline, "forward", compute, step=1)
    waited = _stage(timeline, "h2d_inputs", copy, step=2, lane="copy")
    c = _stage(timeline, "input_prep", compute, step=2, after=waited)  # drops step 1's forward
    assert timeline.num_dropped == 1 and dropped.end_ns == -1
    _stage(timeline, "h2d_inputs", copy, step=3, lane="copy")  # drops the waited-for copy
    assert timeline.num_dropped == 2 and waited.end_ns == -1 and waited.after is None
    dropped.end.t = c.host_begin_ns + 50_000  # would be the latest term: ignored
    waited.end.t = c.host_begin_ns + 70_000
    c.end.t = c.host_begin_ns + 90_000
    written = _slices(timeline, path)
    assert ("forward", 1) not in written and ("h2d_inputs", 2) not in written
    assert written[("input_prep", 2)][:2] == (c.host_begin_ns, c.end.t)


def test_slices_of_one_stream_never_overlap(tmp_path):
    """Scripted end times in stream order, a device that runs at the host's pace or far behind
    it, waits across streams, polls of random sizes: on each stream every slice begins at or after the previous
    one's end, and ends at or after its own begin."""
    import random

    rng = random.Random(3)
    timeline, path = _timeline(tmp_path, poll_batch=1, max_deferred=1)
    streams = {"copy": Stream(), "compute": Stream()}
    _prime(timeline, *streams.values())
    device = {"copy": 0, "compute": 0}
    for step in range(300):
        h = _stage(timeline, "h2d_inputs", streams["copy"], step=step, lane="copy")
        prep = _stage(timeline, "input_prep", streams["compute"], step=step, after=h)
        fwd = _stage(timeline, "forward", streams["compute"], step=step, contiguous=True)
        # each stage ends after its stream's previous one, after its host enqueue, and (input
        # prep) after the copy it waited for; the device runs ahead or far behind the host
        lag = rng.choice([0, 0, 50_000, 2_000_000])
        device["copy"] = max(device["copy"], h.host_begin_ns + lag) + rng.randrange(1, 5_000)
        h.end.t = device["copy"]
        start = max(device["compute"], h.end.t, prep.host_begin_ns + lag)
        device["compute"] = start + rng.randrange(1, 9_000)
        prep.end.t = device["compute"]
        device["compute"] += rng.randrange(0, 9_000)
        fwd.end.t = device["compute"]
        if rng.random() < 0.3:
            timeline.poll(rng.choice([None, 1, 2, 5]))
    written = _slices(timeline, path)
    assert len(written) == 900
    by_track: dict[str, list[tuple[int, int]]] = {}
    for (name, _), (start, end, _) in written.items():
        by_track.setdefault("copy" if name == "h2d_inputs" else "compute", []).append((start, end))
    for spans in by_track.values():
        spans.sort()
        for (_, prev_end), (start, end) in zip(spans, spans[1:], strict=False):
            assert prev_end <= start <= end


def test_emitted_stages_keep_no_chain_of_earlier_stages(tmp_path):
    """The speculative-graph chain: each verify waits for the previous step's output copy, each
    copy for that step's verify. Once emitted, a stage drops what it waited for, so old stages
    are freed (weak references die) rather than held, step after step, by the newest."""
    timeline, _ = _timeline(tmp_path, poll_batch=1, max_deferred=1)
    compute, d2h = Stream(), Stream()
    _prime(timeline, compute, d2h)
    refs = []
    copied: Any = None
    t = 0
    for step in range(50):
        verify = _stage(timeline, "verify", compute, step=step, after=copied)
        copied = _stage(timeline, "d2h_output", d2h, step=step, lane="copy", after=verify)
        t = max(t, copied.host_begin_ns) + 1_000
        verify.end.t, copied.end.t = t, t + 500
        refs += [weakref.ref(verify), weakref.ref(copied)]
        timeline.poll()
        del verify
    gc.collect()
    alive = [i for i, ref in enumerate(refs) if ref() is not None]
    # the runner's one held stage (the newest copy) and the timeline's last stage / held end
    assert len(alive) <= 3 and min(alive) >= len(refs) - 4, alive
    assert copied.after is None  # emitted: it no longer holds the verify it waited for


def test_both_keeps_the_recorded_begin_and_writes_the_derived_one(tmp_path):
    timeline, path = _timeline(tmp_path, begins="both")
    copy, compute, d2h = Stream(), Stream(), Stream()
    _prime(timeline, copy, compute)
    h = _stage(timeline, "h2d_inputs", copy, lane="copy")
    prep = _stage(timeline, "input_prep", compute, after=h)
    fwd = _stage(timeline, "forward", compute, contiguous=True)
    out = _stage(timeline, "d2h_output", d2h, lane="copy", after=fwd)  # first on its stream
    h.begin.t, h.end.t = h.host_begin_ns + 2_000, prep.host_begin_ns + 9_000
    prep.begin.t, prep.end.t = h.end.t + 3_000, h.end.t + 20_000  # reaction latency: 3 µs
    fwd.end.t = prep.end.t + 50_000
    out.begin.t, out.end.t = fwd.end.t + 4_000, fwd.end.t + 9_000
    written = _slices(timeline, path)
    start, end, args = written[("input_prep", 0)]
    assert (start, end) == (prep.begin.t, prep.end.t)  # the recorded begin
    assert args["derived_begin_ns"] == h.end.t == start - 3_000
    assert written[("h2d_inputs", 0)][2]["derived_begin_ns"] == h.host_begin_ns
    assert "derived_begin_ns" not in written[("forward", 0)][2]  # contiguous: exact
    # The first stage on a stream records its begin in derived mode too: no derived arg.
    assert written[("d2h_output", 0)][:2] == (out.begin.t, out.end.t)
    assert "derived_begin_ns" not in written[("d2h_output", 0)][2]


@pytest.mark.parametrize("begins", ["recorded", "derived", "both"])
def test_begin_records_and_metadata_per_mode(tmp_path, begins):
    """Per step of the plain decode path (h2d_inputs, input_prep, forward and sample
    contiguous, d2h_output), with the runner's three sync events: 8 records, 5 derived."""
    timeline, path = _timeline(tmp_path, begins=begins)
    copy, compute, d2h = Stream(), Stream(), Stream()
    _prime(timeline, copy, compute, d2h)
    ScriptedEvent.recorded = 0
    for step in range(10):
        h = _stage(timeline, "h2d_inputs", copy, step=step, lane="copy")
        timeline.event_after_stage(copy, ScriptedEvent, wait_only=True)
        _stage(timeline, "input_prep", compute, step=step, after=h)
        _stage(timeline, "forward", compute, step=step, contiguous=True)
        s = _stage(timeline, "sample", compute, step=step, contiguous=True)
        timeline.event_after_stage(compute, ScriptedEvent, wait_only=True)
        _stage(timeline, "d2h_output", d2h, step=step, lane="copy", after=s)
        timeline.event_after_stage(d2h, ScriptedEvent)
    assert ScriptedEvent.recorded == 10 * (5 if begins == "derived" else 8)
    timeline.drain()
    timeline.tracer.close()
    meta = [e.args for e in read_trace(path).events if e.name == "trace_metadata"]
    found = [m["device_begins"] for m in meta if "device_begins" in m]
    assert found == ([] if begins == "recorded" else [begins])


def test_cpu_device_both_mode_derived_is_a_close_lower_bound(tmp_path):
    """On the CPU device a stream's worker stamps each event when it reaches it, so a derived
    begin is at or before the recorded one, by the worker's reaction time."""
    path = str(tmp_path / "t.pftrace")
    device = CpuDevice()
    timeline = DeviceTimeline(Tracer(path), 0, device.timed_event_factory(), begins="both")
    h2d, compute = device.h2d_stream, device.compute_stream
    for step in range(40):
        with timeline.stage("h2d_inputs", step=step, lane="copy", stream=h2d) as h:
            device.submit(h2d, lambda: sum(range(2_000)))
        ready = timeline.event_after_stage(h2d, device.new_event, wait_only=True)
        device.wait_event(compute, ready)
        with timeline.stage("input_prep", step=step, stream=compute, after=h):
            device.submit(compute, lambda: sum(range(5_000)))
        timeline.poll()
    device.synchronize()
    timeline.drain()
    timeline.tracer.close()
    device.close()
    slices = [s for s in read_trace(path).slices() if s[0].startswith("gpu:0")]
    assert len(slices) == 80
    # every slice but the first on each stream (recorded in derived mode too) has a derived begin
    errors = [
        s - args["derived_begin_ns"] for _, _, s, _, args in slices if "derived_begin_ns" in args
    ]
    assert len(errors) == 78
    assert min(errors) >= 0 and sorted(errors)[len(errors) // 2] < 2_000_000, errors


@pytest.mark.parametrize("begins", ["recorded", "derived"])
def test_two_streams_of_one_lane_overlap_on_tracks_of_their_own(tmp_path, begins):
    """The copy lane's h2d and d2h streams run at once: their slices may overlap in time. On one
    track the reader would pair one slice's begin with the other's end; each stream writes its own
    track (both named ``gpu:0 copy``), and every slice reads back whole."""
    timeline, path = _timeline(tmp_path, begins=begins)
    h2d, d2h = Stream(), Stream()
    _prime(timeline, h2d, d2h)
    out = _stage(timeline, "d2h_output", d2h, step=1, lane="copy")
    into = _stage(timeline, "h2d_inputs", h2d, step=2, lane="copy")
    t = into.host_begin_ns if hasattr(into, "host_begin_ns") else 10**6
    # not nested: d2h ends while h2d runs (a reader of one track closes h2d at d2h's end)
    for scope, (start, end) in ((out, (t - 5_000, t + 10_000)), (into, (t, t + 20_000))):
        if scope.begin is not None:
            scope.begin.t = start
        scope.end.t = end
    timeline.drain()
    timeline.tracer.close()
    copy = [s for s in read_trace(path).slices() if s[0] == "gpu:0 copy" and s[1] != "prime"]
    got = {name: (start, end) for _, name, start, end, _ in copy}
    assert got["d2h_output"][1] == t + 10_000 and got["h2d_inputs"][1] == t + 20_000, got
    assert got["h2d_inputs"][0] < got["d2h_output"][1]  # they do overlap in time


# Each test runs with both cores of the stages (tests/instrument/conftest.py).
pytestmark = pytest.mark.usefixtures("stage_core")
