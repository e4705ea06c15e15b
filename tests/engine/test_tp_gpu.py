"""Tensor parallelism on 2 GPUs (NCCL, NVLS off): greedy tokens == TP=1, CUDA graphs, traces.

Run on ``nvidia-h200-x2``: ``NCCL_NVLS_ENABLE=0 pytest -m gpu tests/engine/test_tp_gpu.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from analysis import load_trace
from analysis.ranks.report import analyze_ranks
from instrument.tracer import Tracer
from tests.engine.test_tp import _config, _run, odd_vocab_config  # noqa: F401 -- fixture

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


@pytest.mark.parametrize("async_on", [False, True])
def test_greedy_tp2_equal_tp1_cuda(odd_vocab_config: str, tmp_path: Path, async_on: bool) -> None:  # noqa: F811
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # before the first NCCL communicator
    kw = {"device": "cuda", "async_scheduling": async_on, "cuda_graphs": None}
    expected = _run(_config(odd_vocab_config, 1, **kw))
    tracer = Tracer(tmp_path / "run.rank0.pftrace")
    assert _run(_config(odd_vocab_config, 2, **kw), tracer) == expected
    tracer.close()
    for rank in (0, 1):
        frames = load_trace(tmp_path / f"run.rank{rank}.pftrace")
        assert f"gpu:{rank} compute" in set(frames.slices["track"])
    report = analyze_ranks([str(tmp_path)], window="all")
    assert len(report.tables["stragglers"]) > 0


def test_ngram_spec_tp2_cuda(odd_vocab_config: str) -> None:  # noqa: F811
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    kw = {"device": "cuda", "async_scheduling": True, "spec_method": "ngram", "num_spec_tokens": 3}
    assert _run(_config(odd_vocab_config, 2, **kw)) == _run(_config(odd_vocab_config, 1, **kw))
