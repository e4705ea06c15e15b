"""ModelRunner on a CUDA device: real streams, Triton kernels, CUDA graphs (run on the H200)."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.device import CudaDevice
from engine.kernels.backend import create_kernel_backend
from engine.runner.model_runner import ModelRunner
from tests.engine.runner_harness import reference_greedy, tiny_model
from tests.engine.test_runner import PROMPT_A, PROMPT_B, PROMPT_C, run_schedule

pytestmark = pytest.mark.gpu


CASES = [(False, False), (True, True), (False, True)]


@pytest.mark.parametrize("use_triton,graphs", CASES)
def test_cuda_runner_matches_full_recompute(use_triton: bool, graphs: bool) -> None:
    device = CudaDevice(0)
    model = tiny_model("cuda", use_triton=use_triton)
    runner = ModelRunner(
        model,
        device,
        SchedulerConfig(max_num_seqs=2, max_model_len=32, max_num_batched_tokens=16),
        CacheConfig(block_size=4, num_kv_blocks=32),
        kernels=create_kernel_backend("triton" if use_triton else "torch"),
        cuda_graphs=graphs,
    )
    got = run_schedule(runner)
    assert got["A"] == reference_greedy(model, PROMPT_A, 2)
    assert got["B"] == reference_greedy(model, PROMPT_B, 4)
    assert got["C"] == reference_greedy(model, PROMPT_C, 3)
    assert runner.graphs.failure is None and runner.graphs.enabled is graphs
    # steps 2, 4 and 5 are uniform decode batches: replayed graphs when graphs are on
    assert runner.graphs.num_replays == (3 if graphs else 0)


if __name__ == "__main__":  # the GPU machine may lack pytest
    for case in CASES:
        torch.manual_seed(0)
        test_cuda_runner_matches_full_recompute(*case)
        print("ok", case)
