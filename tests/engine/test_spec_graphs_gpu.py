"""Speculative CUDA graphs on a CUDA device (run on the H200; docs/design.md §2.6, "Speculative
graphs"): with real captured graphs, fp32 greedy speculation emits exactly the tokens of the run
without speculation for every proposer, and exactly the tokens of the eager speculative path;
seeded random sampling gives the eager path's tokens too, and steps with logprobs requests
replay as well."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7],
    [11, 12, 13],
    [20, 21, 22, 23, 20, 21],
    [40 + (i * 7) % 50 for i in range(37)],
    [3, 4, 3, 4, 3, 4, 3],
    [60 + (i * 3) % 17 for i in range(21)],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = [
    SamplingParams(temperature=0.9, seed=5 + i, max_tokens=16, ignore_eos=True)
    for i in range(len(PROMPTS))
]
# fp32, Triton kernels, graphs on (the CUDA defaults); buckets 16 and 32 tokens over 4 requests.
# No warm-up: graphs are captured when the runner is built, and the test runs short.
ENGINE = dict(
    device="cuda", dtype="float32", num_kv_blocks=64, block_size=8, max_num_seqs=4,
    max_num_batched_tokens=32, max_model_len=96, warmup=False,
)  # fmt: skip


def _generate(model: str, params, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=model, debug_invariants=True, **ENGINE, **kwargs)
    outs = llm.generate(PROMPTS, params)
    llm.engine.check_idle()
    llm.close()
    return [o.output_token_ids for o in outs], llm


@pytest.fixture(scope="module")
def baseline(checkpoint) -> list[list[int]]:
    return _generate(checkpoint, GREEDY)[0]


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle", "mtp"])
def test_replayed_spec_graphs_equal_no_speculation_and_eager(checkpoint, models, baseline, method):
    spec = dict(spec_method=method, spec_model=models[method], num_spec_tokens=3)
    got, llm = _generate(checkpoint, GREEDY, **spec)
    graphs = llm.engine.runner.spec_graphs
    assert llm.engine.features.spec_cuda_graphs, graphs.failure
    assert not graphs.replay_eagerly and graphs.buckets == [16, 32]
    assert graphs.num_replays > 10 and graphs.num_eager == 0
    eager, eager_llm = _generate(checkpoint, GREEDY, spec_cuda_graphs=False, **spec)
    assert eager_llm.engine.runner.spec_graphs.num_replays == 0
    assert got == eager == baseline


@pytest.mark.parametrize("method", ["ngram", "eagle", "draft"])
def test_replayed_spec_graphs_sample_as_eager(checkpoint, models, method):
    spec = dict(spec_method=method, spec_model=models[method], num_spec_tokens=3)
    got, llm = _generate(checkpoint, SEEDED, **spec)
    assert llm.engine.runner.spec_graphs.num_replays > 0
    eager, _ = _generate(checkpoint, SEEDED, spec_cuda_graphs=False, **spec)
    assert got == eager


def test_bench_like_steps_replay_logprobs_included(checkpoint, models):
    """The bench's pycode workload in small: more requests than ``max_num_seqs`` (prefill chunks
    join verify steps), greedy, some asking for logprobs (before the logprobs variant ~92% of
    the bench's speculative steps ran eagerly). Every step with drafts replays; tokens equal
    the eager path's and logprobs match it."""
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2 if i % 3 else None
        )
        for i in range(len(PROMPTS))
    ]
    spec = dict(spec_method="eagle", spec_model=models["eagle"], num_spec_tokens=3)

    def run(**kw) -> tuple[list, LLM]:
        llm = LLM(model=checkpoint, debug_invariants=True, **ENGINE, **spec, **kw)
        outs = llm.generate(PROMPTS, params)
        llm.close()
        return [(o.output_token_ids, o.logprobs) for o in outs], llm

    got, llm = run()
    graphs = llm.engine.runner.spec_graphs
    assert graphs.num_replays > 10 and graphs.num_eager == 0, dict(graphs.eager_reasons)
    eager, _ = run(spec_cuda_graphs=False)
    for (ids, lps), (want_ids, want_lps) in zip(got, eager, strict=True):
        assert ids == want_ids and (lps is None) == (want_lps is None)
        for row, want in zip(lps or [], want_lps or [], strict=True):
            assert [t for t, _ in row] == [t for t, _ in want]
            assert [v for _, v in row] == pytest.approx([v for _, v in want], abs=1e-4)


def test_sync_accepted_replays_too(checkpoint, models, baseline):
    spec = dict(spec_method="mtp", spec_model=models["mtp"], num_spec_tokens=3)
    got, llm = _generate(checkpoint, GREEDY, spec_sync_accepted=True, **spec)
    assert got == baseline and llm.engine.runner.spec_graphs.num_replays > 0


if __name__ == "__main__":  # the GPU machine may lack pytest
    raise SystemExit(pytest.main([__file__, "-q", "-m", "gpu"]))
