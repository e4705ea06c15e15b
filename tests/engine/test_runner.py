"""ModelRunner on the CPU device: several async steps of a tiny model against full recompute."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.device import CpuDevice
from engine.kernels.backend import KernelBackend, create_kernel_backend
from engine.runner.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from tests.engine.runner_harness import (
    new_req,
    reference_greedy,
    step_output,
    tiny_model,
)

PROMPT_A = [5, 17, 3, 44, 9, 61, 2]
PROMPT_B = [11, 12, 80, 7, 33]
PROMPT_C = [90, 4, 25]


@pytest.fixture
def device():
    dev = CpuDevice()
    yield dev
    dev.close()


def make_runner(
    device: CpuDevice, model, use_triton: bool = False, kernels: KernelBackend | None = None
) -> ModelRunner:
    limits = SchedulerConfig(
        max_num_seqs=2,  # forces the finished row to be reused
        max_model_len=32,
        max_num_batched_tokens=16,
    )
    return ModelRunner(
        model,
        device,
        limits,
        CacheConfig(block_size=4, num_kv_blocks=32),
        kernels=kernels or create_kernel_backend("triton" if use_triton else "torch"),
    )


def run_schedule(runner: ModelRunner) -> dict[str, list[int]]:
    """Chunked prefill, decode, finish + row reuse, block growth; all steps enqueued before any
    output is read: tokens flow step to step on the device only."""
    outs = [
        # A prefills 4 of 7 prompt tokens: no token returned.
        step_output(0, new=[new_req("A", PROMPT_A, [3, 5])], tokens={"A": 4}),
        # A's last chunk (3 tokens) samples a1; B prefills whole and samples b1.
        step_output(
            1, new=[new_req("B", PROMPT_B, [7, 8])], cached=[("A", [], 4)], tokens={"A": 3, "B": 5}
        ),
        step_output(2, cached=[("A", [], 7), ("B", [], 5)], tokens={"A": 1, "B": 1}),
        # A finishes; C takes its row.
        step_output(
            3,
            new=[new_req("C", PROMPT_C, [10])],
            cached=[("B", [], 6)],
            tokens={"C": 3, "B": 1},
            finished={"A"},
        ),
        step_output(4, cached=[("C", [], 3), ("B", [], 7)], tokens={"B": 1, "C": 1}),
        step_output(5, cached=[("C", [11], 4)], tokens={"C": 1}),  # C grows a second block
    ]
    handles = [runner.execute_model(o) for o in outs]
    got: dict[str, list[int]] = {}
    for handle in handles:
        result = handle.get()
        for req_id, toks in zip(result.req_ids, result.sampled_token_ids, strict=True):
            got.setdefault(req_id, []).extend(toks)
    assert handles[0].get().sampled_token_ids == [[]]
    return got


def test_async_steps_match_full_recompute_greedy(device: CpuDevice) -> None:
    model = tiny_model()
    runner = make_runner(device, model)
    assert runner.states.row_of == {}
    got = run_schedule(runner)
    assert got["A"] == reference_greedy(model, PROMPT_A, 2)
    assert got["B"] == reference_greedy(model, PROMPT_B, 4)
    assert got["C"] == reference_greedy(model, PROMPT_C, 3)
    assert runner.states.row_of == {"B": 1, "C": 0}  # C reused A's row
    assert not runner.graphs.enabled and runner.graphs.failure is None  # never asked to capture


def test_resumed_request_recomputes_prompt_plus_outputs(device: CpuDevice) -> None:
    model = tiny_model()
    runner = make_runner(device, model)
    first = runner.execute_model(
        step_output(0, new=[new_req("R", PROMPT_B, [1, 2])], tokens={"R": 5})
    )
    second = runner.execute_model(step_output(1, cached=[("R", [], 5)], tokens={"R": 1}))
    committed = first.get().sampled_token_ids[0] + second.get().sampled_token_ids[0]
    # Preempted: finish + re-add with its committed outputs, recomputed from scratch.
    resumed = new_req("R", PROMPT_B, [4, 6], outputs=committed)
    third = runner.execute_model(step_output(2, new=[resumed], tokens={"R": 7}, finished={"R"}))
    fourth = runner.execute_model(step_output(3, cached=[("R", [], 7)], tokens={"R": 1}))
    tokens = committed + third.get().sampled_token_ids[0] + fourth.get().sampled_token_ids[0]
    assert tokens == reference_greedy(model, PROMPT_B, 4)


def test_device_errors_surface_in_get(device: CpuDevice) -> None:
    model = tiny_model()
    runner = make_runner(device, model)

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("kernel fault")

    runner.model.forward = broken  # type: ignore[method-assign]
    handle = runner.execute_model(
        step_output(0, new=[new_req("A", PROMPT_A, [0, 1])], tokens={"A": 7})
    )
    with pytest.raises(RuntimeError, match="kernel fault"):
        handle.get()


def test_every_device_stage_becomes_a_timeline_slice(device: CpuDevice, tmp_path) -> None:
    from instrument.tracer import Tracer

    model = tiny_model()
    with Tracer(tmp_path / "t.pftrace") as tracer:
        limits = SchedulerConfig(max_num_seqs=2, max_model_len=32, max_num_batched_tokens=16)
        cache = CacheConfig(block_size=4, num_kv_blocks=8)
        runner = ModelRunner(model, device, limits, cache, tracer=tracer)
        first = runner.execute_model(
            step_output(0, new=[new_req("A", PROMPT_A, [0, 1])], tokens={"A": 7})
        )
        second = runner.execute_model(step_output(1, cached=[("A", [], 7)], tokens={"A": 1}))
        first.get(), second.get()
        runner.close()
        # h2d_inputs, input_prep, forward, sample, d2h_output per step
        assert runner.timeline.num_emitted == 10


SAMPLED = {  # per request: the sampling paths of a step (fused plain path and the generic one)
    "A": SamplingParams(temperature=0.8, seed=3, max_tokens=32),
    "B": SamplingParams(temperature=1.2, top_k=7, top_p=0.9, seed=4, max_tokens=32, logprobs=2),
    "C": SamplingParams(temperature=0.0, max_tokens=32),
}


def _sampled_schedule(runner: ModelRunner, params: dict[str, SamplingParams]) -> dict:
    outs = [
        step_output(0, new=[new_req("A", PROMPT_A, [3, 5], params["A"])], tokens={"A": 7}),
        step_output(
            1,
            new=[new_req("B", PROMPT_B, [7, 8], params["B"])],
            cached=[("A", [], 7)],
            tokens={"A": 1, "B": 5},
        ),
        step_output(2, cached=[("A", [], 8), ("B", [], 5)], tokens={"A": 1, "B": 1}),
        step_output(
            3,
            new=[new_req("C", PROMPT_C, [10], params["C"])],
            cached=[("B", [], 6)],
            tokens={"C": 3, "B": 1},
            finished={"A"},
        ),
        step_output(4, cached=[("C", [], 3), ("B", [], 7)], tokens={"B": 1, "C": 1}),
    ]
    got: dict[str, list] = {}
    for handle in [runner.execute_model(o) for o in outs]:
        result = handle.get()
        for b, req_id in enumerate(result.req_ids):
            got.setdefault(req_id, []).extend(result.sampled_token_ids[b])
            if result.logprobs is not None:
                got.setdefault(f"{req_id} logprobs", []).extend(result.logprobs[b])
    return got


@pytest.mark.parametrize(("penalised", "split_chunk"), [(False, None), (True, None), (False, 32)])
def test_triton_kernels_sample_the_torch_tokens(
    device: CpuDevice, penalised: bool, split_chunk: int | None
) -> None:
    """Fused input prep and sample + commit (Triton, interpreted) against the torch backend;
    with a penalised request the step takes the generic (unfused) sampling path. ``split_chunk``
    32: sampling and logprobs run the split-vocab kernels (V = 97: four chunks, the last of one
    token; engine/kernels/sampling_split.py)."""
    pytest.importorskip("triton")
    from engine.kernels.backend import TritonKernels

    params = dict(SAMPLED)
    if penalised:
        params["C"] = SamplingParams(temperature=0.9, presence_penalty=0.5, seed=9, max_tokens=32)
    model = tiny_model()
    want = _sampled_schedule(make_runner(device, model), params)
    kernels = None if split_chunk is None else TritonKernels(split_chunk=split_chunk)
    triton_runner = make_runner(device, tiny_model(use_triton=True), True, kernels)
    got = _sampled_schedule(triton_runner, params)
    assert [len(want[r]) for r in "ABC"] == [3, 4, 2]
    assert {r: got[r] for r in "ABC"} == {r: want[r] for r in "ABC"}
    assert [i for i, _ in got["B logprobs"][0]] == [i for i, _ in want["B logprobs"][0]]


def test_sampled_buffers_are_reused_once_read(device: CpuDevice) -> None:
    model = tiny_model()
    runner = make_runner(device, model)
    run_schedule(runner)  # six steps in flight before any output is read: six host buffers
    assert runner.sampled_buffers.num_allocated == 6
    first = step_output(
        6, new=[new_req("D", PROMPT_A, [12, 13, 14])], tokens={"D": 7}, finished={"B", "C"}
    )
    tokens = runner.execute_model(first).get().sampled_token_ids[0]
    for step in range(7, 11):  # one step in flight at a time: every buffer comes back
        out = step_output(step, cached=[("D", [], step)], tokens={"D": 1})
        tokens += runner.execute_model(out).get().sampled_token_ids[0]
    assert tokens == reference_greedy(model, PROMPT_A, 5)
    assert runner.sampled_buffers.num_allocated == 6
