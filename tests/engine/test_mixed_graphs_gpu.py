"""Mixed-step CUDA graphs on a CUDA device: replayed graphs give the tokens eager steps give
(run on the H200; docs/design.md §2.6)."""

from __future__ import annotations

import pytest
import torch

from engine.device import CudaDevice
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.runner_harness import tiny_model
from tests.engine.test_mixed_graphs import _mixed_schedule, _reference, _run, _runner

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("max_tokens", [32, 16], ids=["all_in_buckets", "largest_16"])
def test_replayed_mixed_graphs_match_eager_on_cuda(max_tokens: int) -> None:
    """fp32, Triton kernels: the schedule of the CPU test (a batch of one, chunked prefill next
    to decodes, odd lengths, a step that fills bucket 16, a 20-token step) replayed from graphs."""
    device = CudaDevice(0)
    model = tiny_model("cuda", use_triton=True)
    eager = _run(_runner(model, 0, graphs=False, triton=True, device=device), _mixed_schedule())
    runner = _runner(model, max_tokens, triton=True, device=device)
    graphs = runner.graphs
    assert graphs.failure is None and graphs.mixed_failure is None
    assert not graphs.replay_eagerly  # real graphs, captured
    got = _run(runner, _mixed_schedule())
    assert got == eager == _reference(model)
    expected = (4, 0) if max_tokens == 32 else (3, 1)
    assert (graphs.num_mixed_replays, graphs.num_mixed_eager) == expected


def test_engine_default_flags_capture_mixed_graphs(tiny_model_config: str) -> None:
    """Default flags on CUDA resolve mixed graphs on; outputs equal a run with them off."""
    prompts = [[(5 * i + j) % 120 + 2 for j in range(n)] for i, n in enumerate([3, 17, 40, 9, 64])]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kwargs = dict(model_config=tiny_model_config, random_weights=True, device="cuda",
                  max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=128)  # fmt: skip
    outs = {}
    for max_tokens in (None, 0):
        llm = LLM(**kwargs, mixed_graph_max_tokens=max_tokens)
        outs[max_tokens] = [o.output_token_ids for o in llm.generate(prompts, params)]
        graphs = llm.engine.runner.graphs
        assert llm.engine.features.mixed_cuda_graphs is (max_tokens is None)
        if max_tokens is None:
            assert graphs.buckets == [16, 32, 64] and graphs.num_mixed_replays > 0
        else:
            assert graphs.num_mixed_replays == 0
        llm.close()
    assert outs[None] == outs[0]


if __name__ == "__main__":  # the GPU machine may lack pytest
    for case in (32, 16):
        torch.manual_seed(0)
        test_replayed_mixed_graphs_match_eager_on_cuda(case)
        print("ok", case)
