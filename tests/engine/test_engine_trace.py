"""An engine run's trace carries the contract of docs/design.md §4, and async overlap shows on the CPU."""

from __future__ import annotations

import pandas as pd
import pytest

from analysis import analyze_trace, load_trace
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from instrument.schema import FLOW_ID_BASE, Counter, CpuSlice, DeviceSlice, Instant
from instrument.tracer import Tracer
from tests.engine.test_trace_cost import _tiny_llm


def _run(tmp_path, tiny_model_config, async_on: bool) -> str:
    path = str(tmp_path / f"async_{async_on}.pftrace")
    tracer = Tracer(path)
    llm = LLM(
        tracer=tracer,
        trace_requests=True,
        model_config=tiny_model_config,
        random_weights=True,
        async_scheduling=async_on,
        num_kv_blocks=128,
        max_num_seqs=8,
    )
    prompts = [[(5 * i + j) % 120 + 2 for j in range(8 + i)] for i in range(8)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    llm.close()
    tracer.close()
    return path


def test_trace_has_the_contract(tmp_path, tiny_model_config):
    frames = load_trace(_run(tmp_path, tiny_model_config, async_on=True))
    names = set(frames.slices["name"])
    assert {
        s.value
        for s in (
            CpuSlice.SCHEDULE,
            CpuSlice.PREPARE_INPUTS,
            CpuSlice.LAUNCH,
            CpuSlice.WAIT_OUTPUT,
            CpuSlice.READ_OUTPUT,
            CpuSlice.UPDATE_FROM_OUTPUT,
        )
    } <= names
    assert {
        DeviceSlice.INPUT_PREP.value,
        DeviceSlice.FORWARD.value,
        DeviceSlice.SAMPLE.value,
    } <= names
    assert {"h2d_inputs", "d2h_output", "queued", "prefill", "decode"} <= names
    assert {c.value for c in Counter} <= set(frames.counters["name"])
    decisions = set(frames.decisions["feature"])
    assert {"async_scheduling", "cuda_graphs", "triton_kernels", "pinned_memory"} <= decisions
    assert Instant.ENGINE_CONFIG.value in set(frames.instants["name"])
    steps = frames.slices[frames.slices["name"] == CpuSlice.SCHEDULE.value]["step"]
    assert (steps >= 0).all() and steps.is_unique
    flows = frames.flows
    launches = frames.slices[frames.slices["name"] == CpuSlice.LAUNCH.value]
    assert len(flows) == len(launches) > 0  # one flow per launched step
    names = frames.slices.set_index("slice_id")["name"]
    assert set(names.loc[flows["src_slice_id"]]) == {CpuSlice.LAUNCH.value}
    assert set(names.loc[flows["dst_slice_id"]]) == {DeviceSlice.FORWARD.value}
    assert (flows["flow_id"].astype("int64") >= FLOW_ID_BASE).all()


def test_async_overlap_is_real_on_cpu(tmp_path, tiny_model_config):
    on = analyze_trace(_run(tmp_path, tiny_model_config, async_on=True)).headline
    off = analyze_trace(_run(tmp_path, tiny_model_config, async_on=False)).headline
    assert on["overlap"] > 0.3, on["overlap"]
    assert off["overlap"] < 0.05, off["overlap"]  # sync: scheduling never overlaps the device


def test_batched_device_polls_lose_no_stage(tmp_path, tiny_model_config):
    """The device timeline polls in batches (at the engine's wait, or past max_deferred): every
    launched step still has each of its device stages exactly once, the trace holds every stage
    the runner recorded, and the metadata reports nothing dropped."""
    path = str(tmp_path / "batched.pftrace")
    tracer = Tracer(path)
    llm = LLM(
        tracer=tracer,
        model_config=tiny_model_config,
        random_weights=True,
        num_kv_blocks=128,
        max_num_seqs=8,
    )
    timeline = llm.engine.runner.timeline
    prompts = [[(5 * i + j) % 120 + 2 for j in range(8 + i)] for i in range(8)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    batched_polls = timeline.num_emitted  # emitted before the run's end (by batched polls)
    llm.close()
    tracer.close()
    assert batched_polls > 0 and timeline.num_recorded > timeline.poll_batch
    assert timeline.num_emitted == timeline.num_recorded and timeline.num_dropped == 0
    frames = load_trace(path)
    device = frames.slices[frames.slices["track"].str.startswith("gpu:0")]
    assert len(device) == timeline.num_recorded
    launched = set(frames.slices[frames.slices["name"] == CpuSlice.LAUNCH.value]["step"])
    per_step = device.groupby("step")["name"].apply(sorted).to_dict()
    stages = sorted(["h2d_inputs", "input_prep", "forward", "sample", "d2h_output"])
    assert set(per_step) == launched and all(v == stages for v in per_step.values())
    assert not any(k.startswith("dropped_") for k in frames.metadata), frames.metadata
    assert (device["host_end_ns"] > 0).all()


def test_spec_run_ends_with_every_device_stage_written(tmp_path, tiny_model_config):
    """With async speculation the last step's draft is enqueued after its output copy; closing
    the runner waits for it, so it is written, not counted as dropped."""
    path = str(tmp_path / "spec.pftrace")
    tracer = Tracer(path)
    llm = LLM(
        tracer=tracer,
        model_config=tiny_model_config,
        random_weights=True,
        spec_method="ngram",
        num_spec_tokens=2,
        num_kv_blocks=128,
        max_num_seqs=4,
    )
    timeline = llm.engine.runner.timeline
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8], [11, 12, 13, 11, 12, 13]]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    llm.close()
    tracer.close()
    assert timeline.num_dropped == 0 and timeline.num_emitted == timeline.num_recorded > 0
    frames = load_trace(path)
    assert "dropped_device_slices" not in frames.metadata
    device = frames.slices[frames.slices["track"].str.startswith("gpu:0")]
    assert len(device) == timeline.num_recorded
    launched = set(frames.slices[frames.slices["name"] == CpuSlice.LAUNCH.value]["step"])
    drafts = set(device[device["name"] == DeviceSlice.DRAFT.value]["step"])
    assert drafts == launched  # every step drafted, the last one included


def test_forward_slices_say_whether_they_replayed_a_cuda_graph(tmp_path, tiny_model_config):
    """``graph_replay`` (docs/design.md §4.9) is on every forward slice; on the CPU the captured
    bodies run eagerly, so it is False everywhere and the analysis models no graph replay."""
    path = _run(tmp_path, tiny_model_config, async_on=True)
    frames = load_trace(path)
    sl = frames.slices
    fwd = sl[sl["name"] == DeviceSlice.FORWARD.value]
    assert len(fwd) > 0 and fwd["graph_replay"].notna().all()
    assert not fwd["graph_replay"].astype(bool).any()
    others = sl[sl["track"].str.startswith("gpu:0") & (sl["name"] != DeviceSlice.FORWARD.value)]
    assert others["graph_replay"].isna().all()
    starved = analyze_trace(path, window="all").tables["starved"]
    assert not starved["graph_replay"].any()


def test_a_phase_that_raises_still_writes_its_span(tmp_path, tiny_model_config):
    """The engine's CPU spans are ``span_begin`` / ``span_end`` in a ``finally``
    (docs/design.md §4.9): when the update phase raises mid-run, its ``update_from_output``
    slice is still written, the run's earlier steps are all there, and the trace loads."""
    path = str(tmp_path / "t.pftrace")
    tracer = Tracer(path)
    llm = _tiny_llm(tracer, tiny_model_config)
    scheduler = llm.engine.scheduler
    update, calls = scheduler.update_from_output, []

    def failing_update(so, out):
        calls.append(so.step)
        if len(calls) == 6:
            raise RuntimeError("planted failure in update_from_output")
        return update(so, out)

    scheduler.update_from_output = failing_update
    prompts = [[(5 * i + j) % 120 + 2 for j in range(8)] for i in range(4)]
    with pytest.raises(RuntimeError, match="planted failure"):
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    tracer.close()  # not llm.close(): its drain would apply outputs past the step that failed
    slices = load_trace(path).slices
    updates = slices[slices["name"] == CpuSlice.UPDATE_FROM_OUTPUT.value]
    failed = calls[-1]
    assert failed in set(updates["step"]), "the failing phase's span is missing"
    row = updates[updates["step"] == failed].iloc[0]
    assert row["dur_ns"] >= 0 and pd.isna(row["num_accepted"])  # no args: it did not finish
    assert set(calls[:-1]) <= set(updates["step"])  # the steps before it, each with its span
