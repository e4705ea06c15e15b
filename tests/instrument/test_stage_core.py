"""The compiled stage core (``instrument/_stagecore.c``, ``instrument/native.py``): built and
current, the same slices as the Python classes from the same stand-in device, the driver's
``cuEventRecord`` called directly (and its failure raised), a stale build refused with the reason,
and its stages collected like Python objects. The timeline tests run with both cores too
(``stage_core`` in tests/instrument/conftest.py)."""

from __future__ import annotations

import ctypes
import gc
import weakref

import pytest

from instrument import device_timeline, native
from instrument.cuda_driver import CudaDriver, CudaDriverError, StandInDriver
from instrument.device_events import StandInCudaEvent, StandInStream
from instrument.device_timeline import DeviceTimeline
from instrument.schema import Arg
from instrument.tracer import Tracer
from tests.instrument.conftest import read_trace
from tests.instrument.test_device_timeline_batching import EngineLoop, _device_slices, _run_async


def test_the_compiled_core_is_built_from_this_source():
    module, reason = native.load()
    assert module is not None, f"the compiled stage core is {reason}"
    assert module.SOURCE_HASH == native.source_hash()


def test_a_build_compiles_the_source_into_a_loadable_module(tmp_path):
    out = native.build(tmp_path / ("_stagecore" + native.target().suffix), quiet=True)
    assert out.exists() and out.stat().st_size > 0
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # nothing half-written left


def test_a_stale_build_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "source_hash", lambda: "0" * 16)
    module, reason = native.load()
    assert module is None and reason.startswith("stale: built from ")
    with pytest.raises(RuntimeError, match="stale"):
        native.resolve("c")
    assert native.resolve("auto")[0] is None  # auto: the Python classes, and why
    with pytest.raises(ValueError, match="core must be one of"):
        native.resolve("rust")


def _run(tmp_path, core: str, name: str, num_steps: int = 400, **kwargs):
    path = str(tmp_path / f"{name}.pftrace")
    tracer = Tracer(path)
    driver = StandInDriver()
    loop = EngineLoop(tracer, wait_only=True, driver=driver, core=core, **kwargs)
    _run_async(loop, num_steps, wait_s=0.0002)
    tracer.close()
    return loop, driver, path


@pytest.mark.parametrize("begins", ["recorded", "both"])
def test_both_cores_write_the_same_slices(tmp_path, begins):
    """The same engine loop through each core: the same stages, events and driver calls, and
    every slice within float32 rounding of the stand-in stamps. The compiled core records through
    the stand-in driver's C function pointer (a ctypes callback), so it is counted as a record.
    ``both`` stamps derived begins too (as args); tests/instrument/test_derived_begins.py runs
    derived begins through each core."""
    results = {}
    for core in ("python", "c"):
        loop, driver, path = _run(tmp_path, core, f"{core}-{begins}", begins=begins)
        assert loop.timeline.core == core
        written = _device_slices(path)
        assert written.keys() == loop.expected.keys()
        for key, (start, end) in loop.expected.items():
            got = written[key]
            assert abs(got[0] - start) <= 100 and abs(got[1] - end) <= 100, key
        t = loop.timeline
        assert t.num_recorded == t.num_emitted == 5 * 400 and t.num_dropped == 0
        # Every record, less the clock's own anchors (one each ANCHOR_MS of the run).
        results[core] = (
            driver.calls["record"] + driver.calls["torch_record"] - t.ops.num_anchor_records
        )
    assert results["c"] == results["python"] == 8 * 400


def test_the_compiled_core_calls_the_driver_record_directly(tmp_path):
    loop, driver, _ = _run(tmp_path, "c", "direct", num_steps=200)
    direct = loop.timeline.direct_records
    # Every record of an event that has a handle: all but each event's first (torch's, which
    # creates it) and the anchors the clock records itself (the first of which is torch's too).
    records, anchors = driver.calls["record"], loop.timeline.ops.num_anchor_records
    # 8 records a step (3 begins, 5 ends), plus the clock's anchors: each either through the
    # pointer (counted as "record") or torch's first record of a new event.
    assert records + driver.calls["torch_record"] == 8 * 200 + anchors
    assert records - anchors <= direct <= records
    assert direct + driver.calls["torch_record"] >= 8 * 200


def test_a_failed_record_raises_the_driver_error(tmp_path):
    """A nonzero CUresult from the directly called ``cuEventRecord`` is a ``CudaDriverError``
    naming it, and the stage is not queued (as the Python path raises and queues nothing)."""
    failing_c = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(lambda e, s: 700)
    failing = CudaDriver(
        lambda handle, stream: 700, lambda handle: 0, lambda *a: 0, lambda e, s: e.record(s),
        name="failing", record_addr=ctypes.cast(failing_c, ctypes.c_void_p).value,
    )  # fmt: skip
    tracer = Tracer(str(tmp_path / "fail.pftrace"))
    timeline = DeviceTimeline(tracer, 0, StandInCudaEvent.clock(driver=failing), core="c")
    stream = StandInStream(auto=True)
    site = timeline.site("forward", stream=stream)
    event = StandInCudaEvent()
    event.record(stream)  # it has a handle now: the direct call is used
    timeline._free.append(event)
    with pytest.raises(CudaDriverError, match="cuEventRecord failed with CUresult 700"):
        with site.stage(0, contiguous=True):
            pass
    assert timeline.num_recorded == 0 and timeline.direct_records == 0
    tracer.close()


def test_stages_are_collected_once_unreachable(tmp_path):
    tracer = Tracer(str(tmp_path / "gc.pftrace"))
    loop = EngineLoop(tracer, wait_only=True, core="c", begins="both")
    _run_async(loop, 50, wait_s=0.0)
    loop.timeline.drain()
    ref = weakref.ref(loop.timeline._last)  # a compiled stage: weak-referenceable, in cycles
    del loop
    tracer.close()
    gc.collect()
    assert ref() is None


def test_the_metadata_says_which_core_ran(tmp_path, monkeypatch):
    path = str(tmp_path / "meta.pftrace")
    tracer = Tracer(path)
    DeviceTimeline(tracer, 0, StandInCudaEvent.clock(), core="c")
    DeviceTimeline(tracer, 0, StandInCudaEvent.clock(), core="python")
    monkeypatch.setattr(native, "DEFAULT_CORE", "python")
    assert DeviceTimeline(tracer, 0, StandInCudaEvent.clock()).core == "python"
    tracer.close()
    values = [
        e.args[Arg.STAGE_CORE.value]
        for e in read_trace(path).events
        if Arg.STAGE_CORE.value in e.args
    ]
    assert values == ["c", "python (asked for)", "python (asked for)"]


def test_an_untraced_stage_is_the_shared_null_scope():
    tracer = Tracer(enabled=False, path=None)
    timeline = DeviceTimeline(tracer, 0, StandInCudaEvent.clock(), core="c")
    site = timeline.site("forward", stream=StandInStream(auto=True))
    with site.stage(0) as scope:
        assert scope is None
    assert site.stage(1) is device_timeline._NULL_SCOPE
    assert timeline.num_recorded == 0 and timeline._last is None


def test_the_compiled_span_end_writes_what_the_python_one_writes(tmp_path):
    """``Tracer(core=...)``: the same spans (positional and keyword calls, with and without args,
    a new thread's first event) read back the same from either core's trace; off, nothing."""
    import threading

    written = {}
    for core in ("python", "c"):
        path = str(tmp_path / f"spans-{core}.pftrace")
        tracer = Tracer(path, core=core)
        assert tracer.span_core == core
        start = tracer.span_begin("schedule")
        tracer.span_end("schedule", start, 3, {"num_reqs": 4})
        tracer.span_end(name="launch", start_ns=tracer.span_begin("launch"), step=None)

        def on_a_thread(tracer=tracer) -> None:
            tracer.span_end("worker", tracer.span_begin("worker"), 5, args={"k": "v"})

        thread = threading.Thread(target=on_a_thread, name=f"spans-{core}")
        thread.start()
        thread.join()
        tracer.enabled = False
        tracer.span_end("ignored", tracer.span_begin("ignored"), 6)
        tracer.enabled = True
        tracer.close()
        written[core] = sorted(
            (track.replace(f"spans-{core}", "spans-*"), name, args)
            for track, name, _, _, args in read_trace(path).slices()
        )
    assert written["c"] == written["python"]
    names = [name for _, name, _ in written["c"]]
    assert sorted(names) == ["launch", "schedule", "worker"]
    assert {"k": "v", "step": 5}.items() <= dict(written["c"][-1][2]).items()
    tracer = Tracer(str(tmp_path / "bad.pftrace"), core="c")
    with pytest.raises(TypeError, match="unexpected keyword"):
        tracer.span_end("x", 0, 1, bogus=2)
    tracer.close()


def test_a_polls_conversions_run_in_one_compiled_loop(tmp_path):
    """With the compiled core the clock's driver converts a poll's events in one C loop
    (``elapsed_ms_many``, the GIL handed over once): the same float32 milliseconds as the
    ctypes loop, and an incomplete event raises the driver's error with its CUresult."""
    driver = StandInDriver()
    tracer = Tracer(str(tmp_path / "conv.pftrace"))
    python_driver_loop = StandInDriver()
    DeviceTimeline(tracer, 0, StandInCudaEvent.clock(driver=python_driver_loop), core="python")
    assert python_driver_loop._elapsed_many_c is None  # the Python core keeps the ctypes loop
    DeviceTimeline(tracer, 0, StandInCudaEvent.clock(driver=driver), core="c")
    assert driver._elapsed_many_c is not None
    stream = StandInStream(auto=True)
    events = []
    for _ in range(20):
        event = StandInCudaEvent()
        event.record(stream)
        events.append(event)
    ctypes_loop = StandInDriver()
    for release in (True, False):
        driver.reads_release_gil = release
        assert driver.elapsed_ms_many(events[0], events) == ctypes_loop.elapsed_ms_many(
            events[0], events
        )
    pending = StandInCudaEvent()
    pending.record(StandInStream())  # never advanced: not complete
    with pytest.raises(CudaDriverError, match="CUresult 600"):
        driver.elapsed_ms_many(events[0], [events[1], pending])
    tracer.close()


@pytest.mark.parametrize("begins", ["recorded", "derived"])
def test_compiled_emit_builds_every_slice_in_c(tmp_path, monkeypatch, begins):
    """``compiled_emit``: a poll's slices come from ``emit_stages`` (the Python loop is never
    used), and they are the slices the stages stand for: one per stage, in stream order, each
    non-empty, a stream's slices never overlapping, every pooled event back once. The timeline
    tests run with it too (the ``c-emit`` core of the ``stage_core`` fixture)."""
    monkeypatch.setattr(device_timeline, "COMPILED_EMIT", True)
    monkeypatch.setattr(
        DeviceTimeline, "_build_slices", lambda *a: pytest.fail("the Python build ran")
    )
    path = str(tmp_path / f"emit-{begins}.pftrace")
    tracer = Tracer(path)
    timeline = DeviceTimeline(
        tracer, 0, StandInCudaEvent.clock(driver=StandInDriver()), begins=begins, core="c"
    )
    assert timeline.compiled_emit
    streams = {name: StandInStream(auto=True) for name in ("h2d", "compute", "d2h")}
    h2d = timeline.site("h2d_inputs", lane="copy", stream=streams["h2d"])
    prep = timeline.site("input_prep", stream=streams["compute"])
    forward = timeline.site("forward", stream=streams["compute"])
    d2h = timeline.site("d2h_output", lane="copy", stream=streams["d2h"])
    num_steps = 300
    for step in range(num_steps):
        with h2d.stage(step) as copied:
            pass
        with prep.stage(step, after=copied):
            pass
        with forward.stage(step, contiguous=True) as fwd:
            pass
        timeline.event_after_stage(streams["compute"], StandInCudaEvent, wait_only=True)
        with d2h.stage(step, after=fwd):
            pass
        if step % 10 == 9:
            timeline.poll()
    timeline.drain()
    tracer.close()
    assert timeline.num_emitted == 4 * num_steps and timeline.num_dropped == 0
    slices = [s for s in read_trace(path).slices() if s[0].startswith("gpu:")]
    assert len(slices) == 4 * num_steps
    by_track: dict[str, list[tuple[int, int]]] = {}
    for track, _, start, end, _ in slices:
        assert end >= start
        by_track.setdefault(track, []).append((start, end))
    for spans in by_track.values():
        spans.sort()
        # one stream: no overlap
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
