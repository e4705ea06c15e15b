"""Tensor parallelism on the CPU with 2 gloo ranks: logits, greedy tokens, traces, failures.

Each TP=2 case spawns one process (rank 1; the test process is rank 0): a few seconds each.
References are the same model run on one rank in this process.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from analysis import load_trace
from analysis.ranks.report import analyze_ranks
from engine.config import ConfigError, EngineConfig
from engine.executor.tp_driver import TensorParallelError, TPDriver, TPOptions
from engine.llm import LLM
from engine.model.loader import load_model
from engine.sampling_params import SamplingParams
from instrument.tracer import Tracer
from tests.engine.conftest import TINY_QWEN3
from tests.engine.tp_logits import TIMEOUT_S, paged_logits, rank1_logits, tp_logits


@pytest.fixture(scope="module")
def odd_vocab_config(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Qwen3 with a vocab of 127: the vocab shards are padded (64 + 63 rows)."""
    path = tmp_path_factory.mktemp("tpcfg") / "tiny127.json"
    path.write_text(json.dumps({**TINY_QWEN3, "vocab_size": 127}))
    return str(path)


# ---- logits (rank 1 runs tests/engine/tp_logits.py) -------------------------------------------
def test_logits_tp2_equal_tp1(tiny_hf_checkpoint: str, tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'store'}"
    procs = mp.start_processes(
        rank1_logits, args=(init, tiny_hf_checkpoint), nprocs=1, join=False,
        start_method="spawn",
    )  # fmt: skip
    got = tp_logits(0, init, tiny_hf_checkpoint)
    assert procs.join(TIMEOUT_S)
    reference = paged_logits(load_model(tiny_hf_checkpoint, torch.float32, "cpu")[0])
    assert got.shape == reference.shape == (19 + 9, TINY_QWEN3["vocab_size"])
    rel = (got - reference).abs().max() / reference.abs().max()
    print(f"TP=2 vs TP=1 logits: max rel diff {rel:.2e}")
    assert rel <= 1e-5, f"TP=2 logits differ from TP=1 by {rel:.2e} (relative)"


# ---- greedy tokens through the engine ----------------------------------------------------------
def _mixed_workload(llm: LLM) -> list[list[int]]:
    """Chunked prefills beside decodes, a shared prefix, different lengths, greedy."""
    prefix = [5, 9, 17, 33, 2, 8, 71, 64, 99, 12, 3, 44, 61, 7, 19, 23, 81]
    prompts = [prefix + [1 + i, 2 + i] for i in range(3)] + [list(range(10, 70)), [42], [7, 7]]
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0.0) for i in range(len(prompts))]
    return [o.output_token_ids for o in llm.generate(prompts, params)]


def _config(model_config: str, tp: int, **kw: object) -> EngineConfig:
    return EngineConfig.from_flat(
        model_config=model_config, random_weights=True, seed=7, tensor_parallel_size=tp,
        num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=32, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def _run(config: EngineConfig, tracer: Tracer | None = None) -> list[list[int]]:
    options = TPOptions(timeout_s=TIMEOUT_S)
    tp = (
        TPDriver.start(config, tracer or Tracer(enabled=False), options)
        if config.parallel.tensor_parallel_size > 1
        else None
    )
    with LLM(config, tracer=tracer, tp=tp) as llm:
        return _mixed_workload(llm)


def test_greedy_sync_tp2_equal_tp1(odd_vocab_config: str) -> None:
    expected = _run(_config(odd_vocab_config, 1, async_scheduling=False))
    assert sum(map(len, expected)) == sum(6 + 3 * i for i in range(6))
    assert _run(_config(odd_vocab_config, 2, async_scheduling=False)) == expected


def test_greedy_async_tp2_equal_tp1_with_rank_traces(odd_vocab_config: str, tmp_path: Path) -> None:
    """Async on; both ranks write traces; the merged analysis has every rank and step."""
    expected = _run(_config(odd_vocab_config, 1, async_scheduling=True))
    tracer = Tracer(tmp_path / "run.rank0.pftrace")
    got = _run(_config(odd_vocab_config, 2, async_scheduling=True), tracer)
    tracer.close()
    assert got == expected
    for rank in (0, 1):
        frames = load_trace(tmp_path / f"run.rank{rank}.pftrace")
        assert frames.metadata["rank"] == rank and frames.metadata["world_size"] == 2
        tracks = set(frames.slices["track"])
        assert f"gpu:{rank} compute" in tracks and f"gpu:{1 - rank} compute" not in tracks
        names = set(frames.slices["name"])
        assert {"forward", "all_reduce", "all_gather", "broadcast_step"} <= names
    report = analyze_ranks([str(tmp_path)], window="all")
    stragglers = report.tables["stragglers"]
    steps = set(
        load_trace(tmp_path / "run.rank0.pftrace").slices.query("name == 'forward'")["step"]
    )
    assert set(stragglers["step"]) == steps - {min(steps)}  # all but the warm-up step
    assert set(stragglers["straggler_rank"]) <= {0, 1}
    ranks = report.tables["ranks"]
    assert list(ranks["rank"]) == [0, 1]
    assert (ranks["collective_ms"] > 0).all() and ranks["overlap"].notna().all()
    # 2 layers x 2 all-reduces + the embedding's + the logits all-gather per forward
    coll = report.tables["collectives"]
    assert (coll["num_collectives"] == 6).all()


def test_ngram_spec_tp2_equal_tp1(odd_vocab_config: str) -> None:
    kw = {"async_scheduling": True, "spec_method": "ngram", "num_spec_tokens": 3}
    expected = _run(_config(odd_vocab_config, 1, **kw))
    assert _run(_config(odd_vocab_config, 2, **kw)) == expected


# ---- failures ----------------------------------------------------------------------------------
def test_worker_failure_stops_the_run(odd_vocab_config: str) -> None:
    """Rank 1 raises at step 3: rank 0 raises (no hang), close() reports rank 1's error."""
    config = _config(odd_vocab_config, 2, async_scheduling=True)
    driver = TPDriver.start(config, Tracer(enabled=False), TPOptions(timeout_s=20, fail_at=(1, 3)))
    llm = LLM(config, tp=driver)
    # Timed from after the ranks started (spawning is slow on a loaded machine): no hang means
    # the failure ends the run well before the 20 s collective timeout would.
    start = time.monotonic()
    with pytest.raises(TensorParallelError):
        _mixed_workload(llm)
    with pytest.raises(TensorParallelError, match="injected failure on rank 1 at step 3"):
        llm.close()
    assert time.monotonic() - start < 20
    assert not any(p.is_alive() for p in driver._processes.processes)


def test_config_errors_before_spawning(odd_vocab_config: str) -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size must be >= 1"):
        _config(odd_vocab_config, 0)
    start = time.monotonic()
    with pytest.raises(ConfigError, match="does not divide num_attention_heads=4"):
        LLM(_config(odd_vocab_config, 3))
    assert time.monotonic() - start < 2  # refused before any process was started
