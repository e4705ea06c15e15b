"""EngineCore end to end on the CPU device: async on == off, HF parity, clean books after runs."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.workload import WorkloadRequest


def _mixed_workload(vocab: int) -> list[WorkloadRequest]:
    """Random arrivals, shared prefixes, seeded sampling and greedy, one abort."""
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(2, vocab, (24,), generator=g).tolist()
    reqs = []
    for i in range(12):
        own = torch.randint(
            2, vocab, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g
        ).tolist()
        ids = (prefix + own) if i % 3 == 0 else own
        params = (
            SamplingParams(temperature=0.0, max_tokens=10 + i % 7, ignore_eos=True)
            if i % 2
            else SamplingParams(
                temperature=0.9,
                top_k=20,
                top_p=0.95,
                seed=100 + i,
                max_tokens=8 + i % 5,
                ignore_eos=True,
            )
        )
        reqs.append(
            WorkloadRequest(f"r{i}", None, tuple(ids), params, arrival_time_s=0.01 * (i % 4))
        )
    return reqs


@pytest.mark.parametrize("num_kv_blocks", [64, 12])  # 12 blocks of 16: forces preemption
def test_async_on_off_identical_tokens(tiny_hf_checkpoint, num_kv_blocks):
    results = {}
    for async_on in (False, True):
        llm = LLM(
            model=tiny_hf_checkpoint,
            async_scheduling=async_on,
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=6,
            max_num_batched_tokens=64,
            debug_invariants=True,
        )
        outs = llm.run_workload(_mixed_workload(128))
        llm.engine.drain()
        llm.engine.check_idle()
        results[async_on] = {o.id: o.output_token_ids for o in outs}
        assert all(o.finish_reason == "length" for o in outs)
        if num_kv_blocks == 12:
            assert llm.engine.scheduler.get_stats().num_preemptions > 0
        llm.close()
    assert results[False] == results[True]


def test_abort_in_flight_is_clean(tiny_hf_checkpoint):
    for async_on in (False, True):
        llm = LLM(model=tiny_hf_checkpoint, async_scheduling=async_on, num_kv_blocks=64)
        w = [
            WorkloadRequest(
                "keep",
                None,
                (5, 6, 7),
                SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
            ),
            WorkloadRequest(
                "drop",
                None,
                (8, 9),
                SamplingParams(temperature=0, max_tokens=400, ignore_eos=True),
                abort_after_s=0.05,
            ),
        ]
        outs = {o.id: o for o in llm.run_workload(w)}
        assert outs["keep"].finish_reason == "length" and len(outs["keep"].output_token_ids) == 40
        assert outs["drop"].finish_reason == "abort" and len(outs["drop"].output_token_ids) < 400
        llm.engine.check_idle()
        llm.close()


def test_greedy_matches_transformers_generate(tiny_hf_checkpoint):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        tiny_hf_checkpoint, attn_implementation="eager", torch_dtype=torch.float32
    )
    prompts = [[3, 17, 42, 99, 5], [64, 2, 8], list(range(10, 40))]
    llm = LLM(model=tiny_hf_checkpoint, dtype="float32", num_kv_blocks=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    llm.close()
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert out.output_token_ids == ref
    assert len({tuple(o.output_token_ids) for o in outs}) == 3  # not degenerate


def test_eos_and_stop_tokens(tiny_hf_checkpoint):
    llm = LLM(model=tiny_hf_checkpoint, num_kv_blocks=64)
    free = llm.generate(
        [[3, 17, 42]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )[0]
    stop_at = free.output_token_ids[4]
    first = free.output_token_ids.index(stop_at)
    out = llm.generate(
        [[3, 17, 42]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at])
    )[0]
    assert out.output_token_ids == free.output_token_ids[: first + 1]
    assert out.finish_reason == "stop"
    llm.engine.check_idle()
    llm.close()


def test_invalid_requests_fail_before_running(tiny_hf_checkpoint):
    from engine.config import ConfigError

    llm = LLM(model=tiny_hf_checkpoint, num_kv_blocks=64)
    with pytest.raises(ConfigError, match="outside the vocab"):
        llm.generate([[5, 1000]])
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        llm.generate(["text prompt"])
    llm.engine.check_idle()
    llm.close()


def test_heap_frozen_while_the_engine_lives(tiny_hf_checkpoint):
    """docs/design.md §2.14: construction ends with gc.freeze (start-up objects out of the
    collector's walks); close() unfreezes, so a closed engine's cycles can be collected."""
    import gc

    gc.unfreeze()
    llm = LLM(model=tiny_hf_checkpoint, num_kv_blocks=64)
    try:
        assert gc.get_freeze_count() > 1000
        (out,) = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4))
        assert len(out.output_token_ids) == 4  # runs as usual while frozen
    finally:
        llm.close()
    assert gc.get_freeze_count() == 0
