"""KV pool sizing (engine/kv_sizing.py): the arithmetic with numbers, and the CPU path end to end."""

from __future__ import annotations

import math

import pytest

from engine.config import CPU_MAX_NUM_SEQS, ConfigError, EngineConfig
from engine.kv_sizing import (
    CPU_DEFAULT_NUM_BLOCKS,
    KvCapacity,
    kv_budget,
    max_concurrency,
    max_useful_blocks,
)
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from instrument.schema import ConfigArg

GIB = 2**30
MIB = 2**20

# (total, free, weights, runner, graphs, peak, utilization, bytes per block) -> blocks, computed
# by hand: usable = u * total; used = total - free; kv = usable - used - runner - graphs - peak.
BUDGET_CASES = [
    # an H200-like device, nothing else on it: 140 GiB, 138.5 free after 1.2 GiB of weights
    # 0.9 * 140 = 126; used 1.5; kv = 126 - 1.5 - 0.5 - 0.25 - 2 = 121.75 GiB; 1.75 MiB/block
    (140 * GIB, 138.5 * GIB, 1.2 * GIB, 0.5 * GIB, 0.25 * GIB, 2 * GIB, 0.9, 1.75 * MIB, 71241),
    # another process holds 60 GiB: it counts against the same 0.9 * total
    (140 * GIB, 78.5 * GIB, 1.2 * GIB, 0.5 * GIB, 0.25 * GIB, 2 * GIB, 0.9, 1.75 * MIB, 36132),
    # utilization 1.0, no graphs: every free byte but the runner and the peak
    (16 * GIB, 12 * GIB, 3 * GIB, 1 * GIB, 0, 1 * GIB, 1.0, 64 * MIB, 160),
    # the others already hold more than utilization allows: no blocks at all
    (80 * GIB, 4 * GIB, 2 * GIB, 0, 0, 0, 0.9, 1 * MIB, 0),
]


@pytest.mark.parametrize(
    ("total", "free", "weights", "runner", "graphs", "peak", "util", "per_block", "blocks"),
    BUDGET_CASES,
)
def test_kv_budget_by_hand(
    total: float,
    free: float,
    weights: float,
    runner: float,
    graphs: float,
    peak: float,
    util: float,
    per_block: float,
    blocks: int,
) -> None:
    b = kv_budget(
        total_bytes=int(total),
        free_bytes=int(free),
        weights_bytes=int(weights),
        peak_activation_bytes=int(peak),
        graph_bytes=int(graphs),
        utilization=util,
        bytes_per_block=int(per_block),
        runner_bytes=int(runner),
    )
    assert b.num_blocks == blocks
    # the terms add up: KV + everything else = utilization x total (to the byte)
    used = b.total_bytes - b.free_bytes
    assert b.kv_bytes + used + b.runner_bytes + b.graph_bytes + b.peak_activation_bytes == (
        b.usable_bytes
    )
    assert b.other_bytes == max(0, int(total) - int(free) - int(weights))
    if blocks:
        assert blocks * b.bytes_per_block <= b.kv_bytes < (blocks + 1) * b.bytes_per_block


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("utilization", 0.0, "utilization"),
        ("utilization", 1.5, "utilization"),
        ("bytes_per_block", 0, "bytes_per_block"),
        ("free_bytes", 2 * GIB, "free_bytes"),
        ("graph_bytes", -1, "graph_bytes"),
        ("weights_bytes", GIB, "weights_bytes"),
    ],
)
def test_kv_budget_refuses_impossible_inputs(field: str, value: float, match: str) -> None:
    args = dict(
        total_bytes=GIB,
        free_bytes=GIB // 2,
        weights_bytes=0,
        peak_activation_bytes=0,
        graph_bytes=0,
        utilization=0.9,
        bytes_per_block=MIB,
    )
    args[field] = value
    with pytest.raises(ValueError, match=match):
        kv_budget(**args)  # type: ignore[arg-type]


def test_max_concurrency_counts_whole_blocks() -> None:
    # 1000 blocks of 16: a 256-token request takes 16 blocks, a 257-token one 17
    assert max_concurrency(1000, 16, 256) == pytest.approx(1000 / 16)
    assert max_concurrency(1000, 16, 257) == pytest.approx(1000 / 17)
    with pytest.raises(ValueError):
        max_concurrency(1000, 16, 0)


def test_measured_pool_cap() -> None:
    # 2 x 8 requests x ceil(100 / 16) = 7 blocks each
    assert max_useful_blocks(8, 100, 16) == 112
    kv = KvCapacity(112, 16, "gpu_memory_utilization", capped_from=5_000_000)
    assert "capped from 5000000" in kv.describe(100)


def test_too_little_memory_for_one_request_names_the_numbers() -> None:
    budget = kv_budget(
        total_bytes=16 * GIB,
        free_bytes=int(1.5 * GIB),
        weights_bytes=14 * GIB,
        peak_activation_bytes=0,
        graph_bytes=0,
        utilization=0.5,
        bytes_per_block=MIB,
    )
    assert budget.num_blocks == 0
    kv = KvCapacity(budget.num_blocks, 16, "gpu_memory_utilization", budget)
    with pytest.raises(
        ConfigError,
        match=r"holds 0 blocks .* max_model_len=4096 tokens \(256 blocks\) .* KV -6.50 GiB",
    ):
        kv.check_fits(4096)
    # one block short of one request, then exactly one request
    KvCapacity(256, 16, "gpu_memory_utilization", budget).check_fits(4096)
    with pytest.raises(ConfigError, match="less than one request"):
        KvCapacity(255, 16, "gpu_memory_utilization", budget).check_fits(4096)


def test_gpu_memory_utilization_is_validated() -> None:
    for bad in (0.0, -0.1, 1.01):
        with pytest.raises(ConfigError, match="gpu_memory_utilization"):
            EngineConfig.from_flat(
                model_config="qwen3-0.6b", random_weights=True, gpu_memory_utilization=bad
            )
    with pytest.raises(ConfigError, match="num_kv_blocks"):
        EngineConfig.from_flat(model_config="qwen3-0.6b", random_weights=True, num_kv_blocks=0)


@pytest.mark.parametrize(
    ("num_kv_blocks", "blocks", "source"),
    [(None, CPU_DEFAULT_NUM_BLOCKS, "cpu default"), (40, 40, "num_kv_blocks")],
)
def test_cpu_pool_default_small_and_flag_wins(
    tiny_model_config: str, num_kv_blocks: int | None, blocks: int, source: str
) -> None:
    """The CPU keeps its small default; an explicit --num-kv-blocks wins (scheduler, runner and
    the limit on request length all follow it)."""
    with LLM(
        model_config=tiny_model_config,
        random_weights=True,
        num_kv_blocks=num_kv_blocks,
        block_size=8,
        max_num_seqs=4,
    ) as llm:
        engine = llm.engine
        assert (engine.kv.num_blocks, engine.kv.source) == (blocks, source)
        assert engine.scheduler.kv_cache_manager.pool.num_blocks == blocks
        assert engine.runner.fwd.kv_caches[0].shape[1] == blocks
        # max_model_len: the model's 512 positions, or what 40 blocks x 8 slots hold
        assert engine.max_model_len == min(512, blocks * 8)
        per_request = engine.kv.concurrency(engine.max_model_len)
        assert per_request == pytest.approx(blocks / math.ceil(engine.max_model_len / 8))


def test_trace_config_records_the_pool(tiny_model_config: str, tmp_path) -> None:
    from analysis import load_trace
    from instrument.tracer import Tracer

    path = tmp_path / "t.pftrace"
    tracer = Tracer(path)
    config = EngineConfig.from_flat(
        model_config=tiny_model_config, random_weights=True, num_kv_blocks=40, block_size=8
    )
    with LLM(config, tracer=tracer) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2))
    tracer.close()
    recorded = load_trace(str(path)).config
    assert recorded[ConfigArg.KV_NUM_BLOCKS.value] == 40
    assert recorded[ConfigArg.KV_NUM_TOKENS.value] == 320
    assert recorded[ConfigArg.KV_SOURCE.value] == "num_kv_blocks"
    assert recorded[ConfigArg.MAX_MODEL_LEN_RESOLVED.value] == 320
    assert recorded[ConfigArg.KV_MAX_CONCURRENCY.value] == pytest.approx(1.0)
    assert recorded[ConfigArg.WARMUP_STEPS.value] == 0
    # max_num_seqs was not given: the CPU's default, with where it came from
    assert recorded["max_num_seqs"] == CPU_MAX_NUM_SEQS == llm.engine.config.scheduler.max_num_seqs
    assert recorded[ConfigArg.MAX_NUM_SEQS_SOURCE.value] == "auto: CPU device"
