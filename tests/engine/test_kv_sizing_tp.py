"""Tensor-parallel ranks agree on one KV pool (the minimum) and warm up together (CPU, gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from analysis import load_trace
from engine.config import EngineConfig
from engine.distributed.parallel_state import destroy_tp_group, init_tp_group
from engine.executor.tp_driver import TPDriver, TPOptions
from engine.llm import LLM
from engine.memory_profile import agree_on_blocks
from engine.sampling_params import SamplingParams
from instrument.schema import ConfigArg
from instrument.tracer import Tracer
from tests.engine.conftest import TINY_QWEN3

TIMEOUT_S = 60.0


def _agree(rank: int, init_method: str, num_blocks: int) -> list[int]:
    group = init_tp_group(rank, 2, init_method, None, TIMEOUT_S)
    try:
        return agree_on_blocks(group, num_blocks)
    finally:
        destroy_tp_group()


def _rank1(index: int, init_method: str) -> None:
    assert _agree(index + 1, init_method, 500) == [700, 500]


def test_ranks_see_every_ranks_blocks(tmp_path: Path) -> None:
    """Each rank measured its own device: every rank gets the same list, so the same minimum."""
    init = f"file://{tmp_path / 'store'}"
    procs = mp.start_processes(_rank1, args=(init,), nprocs=1, join=False, start_method="spawn")
    assert _agree(0, init, 700) == [700, 500]
    assert procs.join(TIMEOUT_S)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tpkv") / "tiny.json"
    path.write_text(json.dumps(TINY_QWEN3))
    return str(path)


def test_tp2_ranks_size_and_warm_up_alike(tiny_config: str, tmp_path: Path) -> None:
    """The default pool on both ranks, warm-up on both (its collectives pair up), tokens as on one
    rank, and each rank's trace records the same pool and warm-up and no warm-up step."""
    kw: dict[str, object] = dict(
        model_config=tiny_config, random_weights=True, seed=7, max_num_seqs=4,
        max_num_batched_tokens=16, block_size=8, warmup=True,
    )  # fmt: skip
    prompts = [[3, 4, 5, 6, 7], [9, 10]]
    params = SamplingParams(temperature=0.0, max_tokens=5)
    with LLM(EngineConfig.from_flat(**kw)) as one:  # type: ignore[arg-type]
        expected = [o.output_token_ids for o in one.generate(prompts, params)]
    config = EngineConfig.from_flat(tensor_parallel_size=2, **kw)  # type: ignore[arg-type]
    tracer = Tracer(tmp_path / "run.rank0.pftrace")
    tp = TPDriver.start(config, tracer, TPOptions(timeout_s=TIMEOUT_S))
    with LLM(config, tracer=tracer, tp=tp) as llm:
        assert llm.engine.kv.rank_num_blocks == (1024, 1024)
        got = [o.output_token_ids for o in llm.generate(prompts, params)]
        num_steps = llm.engine.scheduler.next_step
    tracer.close()
    assert got == expected
    recorded = []
    for rank in (0, 1):
        frames = load_trace(tmp_path / f"run.rank{rank}.pftrace")
        c = frames.config
        recorded.append((c[ConfigArg.KV_NUM_BLOCKS.value], c[ConfigArg.WARMUP_STEPS.value]))
        forwards = frames.slices.query("name == 'forward'")
        assert set(forwards["step"]) <= set(range(num_steps))
    assert recorded[0] == recorded[1] and recorded[0][0] == 1024 and recorded[0][1] > 0
