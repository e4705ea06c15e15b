"""Graph stamps (``--trace-graph-stamps``, docs/design.md §4.3): a traced step whose forward is
one stamped graph replay ends ``input_prep`` and ``forward`` at times the graph wrote itself, on
the CPU device through :class:`~instrument.graph_stamps.HostStamps` (the body run on the compute
stream's worker). Two event records fewer per traced decode step, the same tokens, the same
slices, and a desync of the host's and the device's counts is an error, never a made-up time."""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np
import pytest

from analysis import load_trace
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from instrument.graph_stamps import RING, HostStamps, StampEvent
from tests.engine.test_derived_begins_engine import _llm as traced_llm
from tests.engine.test_spec_graphs import _force_spec_graphs

PROMPTS = [[(5 * i + j) % 120 + 2 for j in range(8)] for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(autouse=True)
def _graphs_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda_graphs resolved on, as on a CUDA device: the CPU then runs the padded bodies
    (``CudaGraphRunner(replay_eagerly=True)``), the path stamps wrap."""
    _force_spec_graphs(monkeypatch, {"cuda_graphs"})


def _llm(path: str | None, model_config: str, stamps: bool, **kw: Any) -> tuple[LLM, Any]:
    return traced_llm(
        path, model_config, kw.pop("trace_begins", "recorded"), graph_stamps=stamps, **kw
    )


def _run(path: str | None, model_config: str, stamps: bool, **kw: Any) -> list[list[int]]:
    llm, tracer = _llm(path, model_config, stamps, **kw)
    try:
        outs = llm.generate(PROMPTS, GREEDY)
    finally:
        llm.close()
        if tracer is not None:
            tracer.close()
    return [o.output_token_ids for o in outs]


@pytest.mark.parametrize("begins", ["recorded", "derived"])
def test_stamped_trace_has_the_same_tokens_and_abutting_slices(tmp_path, tiny_model_config, begins):
    """Tokens equal the untraced run's; every graph step's input_prep ends exactly where its
    forward begins, the forward ends where its sample begins, and no compute slice overlaps the
    next; the metadata says the stamps are the host's (error 0)."""
    plain = _run(None, tiny_model_config, True)
    path = str(tmp_path / "s.pftrace")
    assert _run(path, tiny_model_config, True, trace_begins=begins) == plain
    frames = load_trace(path)
    assert frames.metadata.get("graph_stamps") == "host"
    assert int(frames.metadata.get("graph_stamp_error_ns")) == 0
    assert "dropped_device_slices" not in frames.metadata
    compute = frames.slices[frames.slices["track"] == "gpu:0 compute"].sort_values("ts_ns")
    by_step = {(r["name"], int(r["step"])): r for _, r in compute.iterrows()}
    graph_steps = [s for (n, s) in by_step if n == "forward" and ("sample", s) in by_step]
    assert len(graph_steps) >= 30
    for s in graph_steps:
        prep, fwd, sample = by_step["input_prep", s], by_step["forward", s], by_step["sample", s]
        assert prep["end_ns"] == fwd["ts_ns"], s
        assert fwd["end_ns"] == sample["ts_ns"], s
        assert fwd["dur_ns"] > 0, s
        # input_prep's host end is when its successor, the replay, was enqueued: the CPU
        # device's clock is the host's, so the stream reaches the stamp no earlier
        assert prep["host_end_ns"] <= prep["end_ns"] and prep["host_end_ns"] <= fwd["host_end_ns"]
    assert np.all(compute["ts_ns"].to_numpy()[1:] >= compute["end_ns"].to_numpy()[:-1])


def _records_per_step(path: str, model_config: str, stamps: bool) -> float:
    """The timeline's event records per engine step (median over the steady middle); with
    stamps, the host's count of stamped replays equals the device's."""
    llm, tracer = _llm(path, model_config, stamps)
    engine = llm.engine
    timeline, run_step = engine.runner.timeline, engine.run_step
    record = timeline._record
    per_step: list[int] = []
    records = 0

    def counted_record(event: Any, stream: Any) -> None:
        nonlocal records
        records += 1
        record(event, stream)

    def counted_step() -> Any:
        nonlocal records
        records = 0
        out = run_step()
        per_step.append(records)
        return out

    timeline._record, engine.run_step = counted_record, counted_step
    try:
        llm.generate(PROMPTS, GREEDY)
        graph_stamps = engine.runner.fwd.graphs.stamps
        if stamps:
            engine.device.synchronize()
            assert isinstance(graph_stamps, HostStamps)
            assert graph_stamps.next_index == graph_stamps._device_index > 30
        else:
            assert graph_stamps is None
    finally:
        engine.run_step = run_step
        llm.close()
        tracer.close()
    return statistics.median(per_step[4:-4])


def test_two_records_fewer_per_traced_decode_step(tmp_path, tiny_model_config):
    """The timeline's event records in a steady traced decode step: 8 with events, 6 with
    stamps (recorded begins)."""
    counts = {
        stamps: _records_per_step(str(tmp_path / f"{stamps}.pftrace"), tiny_model_config, stamps)
        for stamps in (False, True)
    }
    assert counts == {False: 8, True: 6}, counts


def test_untraced_engine_has_no_stamps(tiny_model_config):
    llm, _ = _llm(None, tiny_model_config, True)
    try:
        assert llm.engine.runner.fwd.graphs.stamps is None
        assert llm.engine.runner.graph_stamps_off == "off (not tracing)"
    finally:
        llm.close()


def test_a_stamp_of_another_replay_is_an_error_not_a_time():
    stamps = HostStamps()
    begin, end = stamps.take()
    assert not end.done()
    stamps.begin()
    stamps.end()
    assert end.done() and end.host_ns() >= begin.host_ns()
    # the host counts a replay the device never ran: the next stamp's row is not its own
    stamps.take()
    late_begin, late_end = stamps.take()
    stamps.begin()
    stamps.end()  # the device's replay 1 lands in row 1
    assert not late_end.done()
    stamps.ring[late_end.index % RING, 0] = late_end.index + RING  # a row of a later lap
    with pytest.raises(RuntimeError, match="counts of stamped replays differ"):
        late_end.host_ns()
    assert isinstance(late_begin, StampEvent)


def test_stamps_that_cannot_be_captured_leave_the_graphs_without_them():
    """The probe capture fails (here: no CUDA at all): the runner drops its stamps and says
    why, instead of a stamp failure costing the graphs."""
    from engine.runner.cuda_graphs import CudaGraphRunner

    class Stream:  # what the probe needs of a stream once its capture failed
        synced = False

        def synchronize(self) -> None:
            self.synced = True

    stream = Stream()
    graphs = CudaGraphRunner(True, max_batch=4, stamps=HostStamps())
    graphs._probe_stamps(stream)  # type: ignore[arg-type]
    assert stream.synced
    assert graphs.stamps is None
    assert graphs.stamps_failure is not None and graphs.stamps_failure.startswith("capture failed")


def test_stages_left_pending_when_tracing_stops_are_read_before_their_stamps_wrap(
    tmp_path, tiny_model_config, monkeypatch, stage_core
):
    """A traced run leaves fewer stages pending than a poll waits for; tracing then stops
    (``Tracer.muted``) while the engine goes on replaying stamped graphs, more of them than the
    ring holds. The first untraced stage makes those stages due (``_untraced_gap``): they are
    emitted at the next waits, before their ring rows are written again, so the trace keeps
    every traced step and closes cleanly; before, the close failed on an overwritten row. The
    thresholds are back to the usual ones once nothing is pending."""
    from instrument import graph_stamps

    monkeypatch.setattr(graph_stamps, "RING", 32)  # the host ring: 32 rows (a GPU's: 4,096)
    path = str(tmp_path / "gap.pftrace")
    llm, tracer = _llm(path, tiny_model_config, True, trace_begins="derived")
    timeline = llm.engine.runner.timeline
    assert timeline.core == ("python" if stage_core == "python" else "c")
    usual = (timeline.poll_batch, timeline.max_deferred)
    try:
        short = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        llm.generate(PROMPTS, short)
        pending = timeline.num_recorded - timeline.num_emitted - timeline.num_dropped
        assert 0 < pending < timeline.poll_batch  # left for a later poll
        stamps = llm.engine.runner.fwd.graphs.stamps
        replays = stamps.next_index
        with tracer.muted():
            llm.generate(PROMPTS, GREEDY)  # 40 tokens each: past the ring's 32 rows
        assert stamps.next_index - replays > 32
        assert timeline.num_recorded == timeline.num_emitted  # read in time, none dropped
        assert (timeline.poll_batch, timeline.max_deferred) == usual
    finally:
        llm.close()
        tracer.close()
    frames = load_trace(path)
    assert "dropped_device_slices" not in frames.metadata
    forwards = frames.slices[frames.slices["name"] == "forward"]
    steps = sorted(int(s) for s in forwards["step"])
    assert len(steps) >= 5 and steps == list(range(steps[0], steps[0] + len(steps)))
