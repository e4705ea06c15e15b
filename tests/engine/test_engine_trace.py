"""An engine run's trace carries the contract of docs/design.md §4, and async overlap shows on the CPU."""

from __future__ import annotations

from analysis import analyze_trace, load_trace
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from instrument.schema import FLOW_ID_BASE, Counter, CpuSlice, DeviceSlice, Instant
from instrument.tracer import Tracer


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
