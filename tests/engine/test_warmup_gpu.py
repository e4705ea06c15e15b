"""On a CUDA device: the KV pool sized from memory, and a run that compiles nothing after warm-up."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

GIB = 2**30


def _config(**kw: object) -> EngineConfig:
    base: dict[str, object] = dict(
        model_config="qwen3-0.6b",
        random_weights=True,
        dtype="bfloat16",
        device="cuda",
        max_num_seqs=32,
        max_num_batched_tokens=512,
        max_model_len=4096,
    )
    base.update(kw)
    return EngineConfig.from_flat(**base)  # type: ignore[arg-type]


def test_auto_kv_pool_fills_the_budget() -> None:
    with LLM(_config(gpu_memory_utilization=0.3, max_num_seqs=256)) as llm:
        kv = llm.engine.kv
        assert kv.source == "gpu_memory_utilization" and kv.budget is not None
        b = kv.budget
        assert kv.capped_from is None  # 2 x 256 x 256 blocks would be about 120 GiB
        assert kv.num_blocks == b.num_blocks > 1024
        assert b.bytes_per_block == llm.engine.runner.kv_bytes_per_block()
        # 28 layers x (K, V) x 16 slots x 8 KV heads x 128 x 2 bytes
        assert b.bytes_per_block == 28 * 2 * 16 * 8 * 128 * 2
        free, total = torch.cuda.mem_get_info()
        used = total - free
        # after warm-up the allocator still caches the peak temporaries: the engine holds about
        # its whole budget (fragmentation is not modelled: 1% of the device as slack), and not
        # much less (the probe measured what the real runner took)
        assert used <= b.usable_bytes + 0.01 * total
        assert used >= b.usable_bytes - b.peak_activation_bytes - 0.02 * total
        llm.generate([[5] * 100] * 8, SamplingParams(temperature=0.0, max_tokens=8))
        free, total = torch.cuda.mem_get_info()
        assert total - free <= b.usable_bytes + 0.01 * total


def test_tiny_model_pool_is_capped(tiny_model_config: str) -> None:
    with LLM(_config(model_config=tiny_model_config, dtype="float32", max_model_len=512)) as llm:
        kv = llm.engine.kv
        assert kv.capped_from is not None and kv.capped_from > kv.num_blocks
        assert kv.num_blocks == 2 * 32 * 512 // 16


def test_explicit_blocks_win_on_cuda() -> None:
    with LLM(_config(num_kv_blocks=300)) as llm:
        assert (llm.engine.kv.num_blocks, llm.engine.kv.source) == (300, "num_kv_blocks")


def test_too_little_memory_is_a_startup_error() -> None:
    from engine.config import ConfigError

    with pytest.raises(ConfigError, match="less than one request"):
        LLM(_config(gpu_memory_utilization=0.12, max_model_len=40960, model_config="qwen3-8b"))


def test_run_after_warmup_compiles_nothing() -> None:
    prompts = [[(7 * i + j) % 1000 + 2 for j in range(n)] for i, n in enumerate([3, 40, 130, 700])]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20),
        SamplingParams(temperature=0.8, seed=1, max_tokens=20),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=2, max_tokens=20),
        SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=3, max_tokens=20),
    ]
    with LLM(_config(num_kv_blocks=2048)) as llm:
        assert llm.engine.features.warmup and llm.engine.warmup.num_steps > 0
        # compiles_at_start may be 0 here: earlier tests in this process compiled the same
        # specializations (the count is per process); test_compile_counter_counts_on_cuda shows
        # the hook fires on this Triton, so an empty in-run list is evidence, not silence.
        assert llm.engine.compiles.counted
        llm.generate(prompts, params)
        llm.generate(prompts * 8, params * 8)
        assert llm.engine.compiles_in_run == []


def test_compile_counter_counts_on_cuda() -> None:
    """The hook fires on this Triton: a kernel new to the process counts once per signature."""
    import triton
    import triton.language as tl

    from engine.kernels.compile_counter import CompileCounter

    @triton.jit
    def _add_one(x_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)

    counter = CompileCounter()
    assert counter.install()
    try:
        x = torch.zeros(100, device="cuda")
        _add_one[(1,)](x, 100, BLOCK=128)
        _add_one[(1,)](x, 100, BLOCK=128)  # same signature: no new specialization
        torch.cuda.synchronize()
        assert counter.count == 1 and "_add_one" in counter.names[0]
        assert float(x.sum()) == 200.0
    finally:
        counter.uninstall()
