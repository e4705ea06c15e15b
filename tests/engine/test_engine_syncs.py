"""The engine's step loop makes no host<-device sync outside its one intended wait."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from instrument.sync_detect import SyncDetector
from instrument.tracer import Tracer

PROMPTS = [[5, 6, 7, 8] * 4, [9, 10, 11], list(range(20, 50))]
PARAMS = SamplingParams(
    temperature=0.7, seed=1, max_tokens=16, logprobs=2, repetition_penalty=1.1, ignore_eos=True
)


def _hot_hits(llm: LLM) -> list:
    llm.generate(PROMPTS[:1], PARAMS)  # warm-up
    with SyncDetector(Tracer(enabled=False)) as detector:
        llm.generate(PROMPTS, PARAMS)
    return [h for h in detector.hits if h.hot]


@pytest.mark.parametrize("spec", [{}, {"spec_method": "ngram", "num_spec_tokens": 3}])
@pytest.mark.parametrize("async_on", [False, True])
def test_no_hot_syncs_on_cpu(tiny_hf_checkpoint, spec, async_on):
    llm = LLM(model=tiny_hf_checkpoint, num_kv_blocks=64, async_scheduling=async_on, **spec)
    assert _hot_hits(llm) == []
    llm.close()


@pytest.mark.gpu
@pytest.mark.parametrize("async_on", [False, True])
def test_no_hot_syncs_on_cuda(tiny_hf_checkpoint, async_on):
    llm = LLM(
        model=tiny_hf_checkpoint,
        num_kv_blocks=64,
        async_scheduling=async_on,
        device="cuda",
        dtype="bfloat16",
    )
    llm.generate(PROMPTS[:1], PARAMS)  # warm-up: graphs captured, kernels compiled
    with SyncDetector(Tracer(enabled=False)) as detector:
        llm.generate(PROMPTS, PARAMS)
    hot = [(h.op, h.where) for h in detector.hits if h.hot]
    assert hot == []
    waits = [h for h in detector.hits if not h.hot]
    assert waits, "the intended wait for each output should be seen (cold)"
    assert torch.cuda.is_available()
    llm.close()
