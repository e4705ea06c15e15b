"""The tracer writes valid Perfetto protobuf: tracks, nesting, counters, flows, instants."""

from __future__ import annotations

import os
import threading
import time

import pytest

from instrument.schema import FLOW_ID_BASE, SCHEMA_VERSION, device_track_name
from instrument.tracer import Tracer, get_tracer, set_tracer, traced
from tests.instrument.conftest import TE, read_trace


def _write_sample(path: str) -> None:
    threading.current_thread().name = "engine-core"
    tracer = Tracer(path, flush_interval_s=0.05)
    for step in range(5):
        with tracer.span("step", step=step):
            with tracer.span(
                "schedule",
                step=step,
                num_reqs=2,
                num_tokens=9,
                num_prefill=1,
                num_decode=1,
                num_spec_tokens=0,
            ):
                time.sleep(0.0005)
            with tracer.span("launch", step=step, flow_out=FLOW_ID_BASE + step):
                pass
        now = time.monotonic_ns()
        tracer.slice_at(
            device_track_name(0, "compute"),
            "forward",
            now - 10_000,
            now,
            step=step,
            flow_in=FLOW_ID_BASE + step,
        )
        tracer.counter("kv_usage", step / 10)
    tracer.instant(
        "feature_decision",
        scope="process",
        feature="async_scheduling",
        requested="None",
        resolved=True,
        reason="auto: CUDA device",
    )
    tracer.close()


def test_trace_parses_with_declared_tracks(tmp_path):
    path = str(tmp_path / "t.pftrace")
    _write_sample(path)
    trace = read_trace(path)  # asserts every event names a declared track
    assert trace.truncated_bytes == 0
    names = set(trace.tracks.values())
    assert {"engine-core", "gpu:0 compute", "kv_usage", "process:stepscope"} <= names
    meta = [e for e in trace.events if e.name == "trace_metadata"]
    assert meta[0].args["schema_version"] == SCHEMA_VERSION
    assert meta[-1].args["closed"] is True


def test_slices_nest_per_track(tmp_path):
    path = str(tmp_path / "t.pftrace")
    _write_sample(path)
    slices = read_trace(path).slices()
    cpu = [s for s in slices if s[0] == "engine-core"]
    steps = [s for s in cpu if s[1] == "step"]
    assert len(steps) == 5
    for step in steps:
        children = [s for s in cpu if s[1] != "step" and s[4]["step"] == step[4]["step"]]
        assert {c[1] for c in children} == {"schedule", "launch"}
        for c in children:
            assert step[2] <= c[2] <= c[3] <= step[3]
    sched = next(s for s in cpu if s[1] == "schedule")
    assert sched[4] == {
        "step": 0,
        "num_reqs": 2,
        "num_tokens": 9,
        "num_prefill": 1,
        "num_decode": 1,
        "num_spec_tokens": 0,
    }
    assert sched[3] - sched[2] >= 400_000  # slept 0.5 ms


def test_flows_join_launch_to_forward(tmp_path):
    path = str(tmp_path / "t.pftrace")
    _write_sample(path)
    events = read_trace(path).events
    starts = {f: e.name for e in events for f in e.flow_ids}
    ends = {f: e.name for e in events for f in e.terminating_flow_ids}
    assert set(starts) == set(ends) == {FLOW_ID_BASE + s for s in range(5)}
    assert set(starts.values()) == {"launch"} and set(ends.values()) == {"forward"}


def test_counters_and_instants(tmp_path):
    path = str(tmp_path / "t.pftrace")
    _write_sample(path)
    events = read_trace(path).events
    counters = [e.counter for e in events if e.type == TE.TYPE_COUNTER]
    assert counters == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    decision = next(e for e in events if e.name == "feature_decision")
    assert decision.type == TE.TYPE_INSTANT and decision.track == "process:stepscope"
    assert decision.args == {
        "feature": "async_scheduling",
        "requested": "None",
        "resolved": True,
        "reason": "auto: CUDA device",
    }


def test_disabled_tracing_writes_nothing(tmp_path):
    tracer = Tracer(enabled=False)
    with tracer.span("step", step=0):
        tracer.instant("sync", op="item")
        tracer.counter("kv_usage", 1.0)
        tracer.slice_at("gpu:0 compute", "forward", 0, 1, step=0)
    tracer.close()
    assert os.listdir(tmp_path) == []
    assert tracer.span("x") is tracer.span("y")  # one shared no-op span


def test_spans_from_threads_get_their_own_tracks(tmp_path):
    path = str(tmp_path / "t.pftrace")
    tracer = Tracer(path)

    def work() -> None:
        with tracer.span("forward", step=1):
            pass

    worker = threading.Thread(target=work, name="device-worker")
    worker.start()
    worker.join()
    threading.current_thread().name = "engine-core"
    with tracer.span("schedule", step=1):
        pass
    tracer.close()
    by_track = {s[0]: s[1] for s in read_trace(path).slices()}
    assert by_track == {"device-worker": "forward", "engine-core": "schedule"}


def test_global_tracer_and_decorator(tmp_path):
    path = str(tmp_path / "t.pftrace")
    tracer = Tracer(path)
    previous = set_tracer(tracer)
    try:

        @traced("prepare_inputs", step=3)
        def prepare() -> int:
            return 7

        assert prepare() == 7
        assert get_tracer() is tracer
    finally:
        set_tracer(previous)
        tracer.close()
    assert [s[1] for s in read_trace(path).slices()] == ["prepare_inputs"]


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="output path"):
        Tracer(None)
    tracer = Tracer(str(tmp_path / "t.pftrace"))
    with pytest.raises(ValueError, match="ends before it starts"):
        tracer.slice_at("gpu:0 compute", "forward", 10, 5)
    tracer.close()


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_counter_values_write_what_counters_write(tmp_path, writer):
    """``counter_values`` (one buffered tuple per sample, as the engine samples its counters)
    writes the same counter samples as ``counters`` (one tuple per counter)."""
    from analysis import load_trace

    names = ("running_requests", "kv_usage", "batch_tokens")
    samples = [(3, 0.25, 256), (0, 1.0, 1), (7, 0.0, 8192)]
    frames = []
    for how in ("dict", "tuple"):
        path = str(tmp_path / f"{how}.pftrace")
        tracer = Tracer(path, writer=writer)
        for step, values in enumerate(samples):
            with tracer.span("schedule", step=step):  # a trace needs a slice to load
                pass
            if how == "dict":
                tracer.counters(dict(zip(names, values, strict=True)))
            else:
                tracer.counter_values(names, values)
        tracer.close()
        frames.append(load_trace(path).counters)
    got = [list(zip(f["name"], f["value"], strict=True)) for f in frames]
    expected = [(n, float(v)) for values in samples for n, v in zip(names, values, strict=True)]
    assert sorted(got[0]) == sorted(expected)
    assert got[1] == got[0]
    # Each sample's counters share one timestamp, distinct from the other samples'.
    assert frames[1].groupby("ts_ns").size().tolist() == [3, 3, 3]


def test_counter_values_refuses_mismatched_lengths():
    from instrument.events import EV_COUNTERS, expand_counters

    with pytest.raises(ValueError, match="2 counter names for 1 values"):
        expand_counters((EV_COUNTERS, ("a", "b"), 0, (1,)))


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_span_calls_write_what_a_span_block_writes(tmp_path, writer):
    """``span_begin``/``span_end`` (the engine's per-step phases: one buffered tuple, the step
    apart) write the slice a ``with tracer.span(...)`` block writes: same name, track, args in the
    same order (step first), flows; a step of None writes no step arg."""
    slices = []
    for how in ("with", "calls"):
        path = str(tmp_path / f"{how}.pftrace")
        tracer = Tracer(path, writer=writer)
        for step in range(3):
            if how == "with":
                with tracer.span("launch", step=step, flow_out=FLOW_ID_BASE + step):
                    pass
                with tracer.span("schedule"):
                    pass
            else:
                start = tracer.span_begin("launch")
                tracer.span_end("launch", start, step, {"flow_out": FLOW_ID_BASE + step})
                tracer.span_end("schedule", tracer.span_begin("schedule"), None)
        tracer.close()
        events = read_trace(path).events
        slices.append(
            [
                (e.track, e.type, e.name, list(e.args.items()), e.flow_ids)
                for e in events
                if e.name in ("launch", "schedule") or e.type == TE.TYPE_SLICE_END
            ]
        )
        assert sorted(f for e in events for f in e.flow_ids) == [FLOW_ID_BASE + s for s in range(3)]
    assert slices[1] == slices[0]
    begins = [(name, args) for _, kind, name, args, _ in slices[1] if kind == TE.TYPE_SLICE_BEGIN]
    assert [args for name, args in begins if name == "launch"][0][0] == ("step", 0)
    assert all(args == [] for name, args in begins if name == "schedule")


def test_span_end_shares_constant_args_and_writes_nothing_while_off(tmp_path):
    """A constant args dict may be passed to many spans (the writer never changes it); a span
    ended while the tracer is off (paused for a dropped step, or disabled) writes nothing."""
    path = str(tmp_path / "t.pftrace")
    tracer = Tracer(path)
    shared = {"kind": "sampled"}
    for step in range(3):
        tracer.span_end("wait_output", tracer.span_begin("wait_output"), step, shared)
    tracer.pause()
    tracer.span_end("wait_output", tracer.span_begin("wait_output"), 3, shared)
    tracer.resume()
    tracer.close()
    assert shared == {"kind": "sampled"}
    begins = [e for e in read_trace(path).events if e.type == TE.TYPE_SLICE_BEGIN]
    assert [e.args for e in begins] == [{"step": s, "kind": "sampled"} for s in range(3)]
    off = Tracer(enabled=False)
    off.span_end("wait_output", off.span_begin("wait_output"), 0)
    assert not off._buffer


def test_span_calls_push_and_pop_nvtx_ranges(tmp_path, monkeypatch):
    """With ``nvtx``, ``span_begin`` pushes the range and ``span_end`` pops it, traced or not
    (ranges stay balanced when tracing is paused between the two)."""
    from instrument import nvtx as nvtx_mod

    calls: list[tuple[str, str | None]] = []

    class Ranges:
        def push(self, name: str) -> None:
            calls.append(("push", name))

        def pop(self) -> None:
            calls.append(("pop", None))

    monkeypatch.setattr(nvtx_mod, "NvtxRanges", Ranges)
    tracer = Tracer(str(tmp_path / "t.pftrace"), nvtx=True)
    start = tracer.span_begin("schedule")
    tracer.span_end("schedule", start, 0)
    start = tracer.span_begin("launch")
    tracer.pause()
    tracer.span_end("launch", start, 1)
    tracer.resume()
    tracer.close()
    assert calls == [("push", "schedule"), ("pop", None), ("push", "launch"), ("pop", None)]


def test_the_buffer_is_flat_and_reads_back_as_the_events():
    """The tracer's buffer holds each event's kind then its fields, no tuple per event (fewer
    objects for the cyclic collector, docs/design.md §4.9 "Flat buffer"); ``unflatten`` gives the
    tuples back, every kind by its arity, and leaves out an event cut short at the end."""
    from instrument.events import (
        ARITY,
        EV_COUNTERS,
        EV_SLICE_AT,
        EV_SPAN,
        EV_STAGE,
        flatten,
        unflatten,
    )

    tracer = Tracer(enabled=True, path=os.devnull, flush_interval_s=1000.0)
    try:
        first = len(tracer._buffer)  # after the trace's metadata
        start = tracer.span_begin("launch")
        tracer.span_end("launch", start, 7, {"k": 1})
        tracer.counter_values(("a", "b"), (1, 2.5))
        tracer.instant("mark", x=1)
        tracer.request_slices("r", 1, 2, 3, 4, 5)
        stage = (EV_STAGE, "gpu:0 compute", "forward", 10, 20, {"graph": True}, None, 7, 19)
        tracer.append_slices([(EV_SLICE_AT, "gpu:0 copy", "h2d_inputs", 1, 2, {"step": 7}), stage])
        flat = list(tracer._buffer)[first:]
        assert all(not isinstance(f, tuple) or f in (("a", "b"), (1, 2.5)) for f in flat)
        events = unflatten(flat)
        assert [e[0] for e in events] == [EV_SPAN, EV_COUNTERS, 3, 5, EV_SLICE_AT, EV_STAGE]
        assert all(len(e) == 1 + ARITY[e[0]] for e in events)
        assert events[0][2:] == ("launch", start, events[0][4], 7, {"k": 1})
        assert events[-1] == stage
        assert flatten(events) == flat
        assert unflatten(flat + [EV_SLICE_AT, "t", "cut"]) == events  # the sender died mid-event
        with pytest.raises(ValueError, match="unknown raw event kind 'x' at item"):
            unflatten(flat + ["x"])
    finally:
        tracer.close()


def test_a_stage_slice_expands_to_the_args_a_dict_would_hold():
    """``EV_STAGE`` (a device stage's slice without a dict of its own): the site's args, then the
    stage's own, then step and host_end_ns; neither given dict is changed."""
    from instrument.events import EV_SLICE_AT, EV_STAGE, expand_stage

    site, own = {"lane_arg": "x"}, {"flow_in": 5, "graph": True}
    got = expand_stage((EV_STAGE, "t", "forward", 1, 2, site, own, 9, 3))
    assert got == (EV_SLICE_AT, "t", "forward", 1, 2, {**site, **own, "step": 9, "host_end_ns": 3})
    assert list(got[5]) == ["lane_arg", "flow_in", "graph", "step", "host_end_ns"]
    assert expand_stage((EV_STAGE, "t", "sample", 1, 2, {}, None, 4, 2))[5] == {
        "step": 4,
        "host_end_ns": 2,
    }
    assert site == {"lane_arg": "x"} and own == {"flow_in": 5, "graph": True}


def test_the_flush_thread_counts_its_cpu_time(tmp_path):
    # bench/bench_trace_overhead.py --interleaved prints it per traced step: the tracer's cost
    # to the process besides the engine thread.
    tracer = Tracer(tmp_path / "t.pftrace", flush_interval_s=0.01)
    assert tracer.flush_cpu_ns == 0
    deadline = time.monotonic() + 10
    while tracer.flush_cpu_ns == 0 and time.monotonic() < deadline:
        for i in range(200):
            tracer.counter("c", float(i))
        time.sleep(0.02)
    tracer.close()
    assert tracer.flush_cpu_ns > 0
    assert sum(e.type == TE.TYPE_COUNTER for e in read_trace(tmp_path / "t.pftrace").events) >= 200
