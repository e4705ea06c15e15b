"""Speculative steps padded to token buckets (the bodies CUDA graphs capture) give exactly the
tokens of the eager speculative path and of decoding without speculation (docs/design.md §2.6,
"Speculative graphs"): ragged steps included (prefill chunks next to verifies, drafts trimmed
near max_tokens, padded requests).

On the CPU the bodies run eagerly (``SpecGraphs.replay_eagerly``): same persistent buffers, same
padded shapes, same host bounds as the captured graphs; tests/engine/test_spec_graphs_gpu.py
replays real graphs."""

from __future__ import annotations

import dataclasses

import pytest
from torch import full_like as torch_full_like

import engine.core
from engine.config import (
    EngineConfig,
    FeatureDecision,
    ResolvedFeatures,
    resolve_features,
)
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.scheduler.outputs import CachedRequestData, SchedulerOutput

PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7],
    [11, 12, 13],
    [20, 21, 22, 23, 20, 21],
    [40 + (i * 7) % 50 for i in range(37)],
    [3, 4, 3, 4, 3, 4, 3],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
SEEDED = [
    SamplingParams(temperature=0.9, seed=7 + i, max_tokens=14, ignore_eos=True)
    for i in range(len(PROMPTS))
]
# Buckets 16 and 32 tokens, both over 4 padded requests and 16 logits rows (k = 3).
ENGINE = dict(
    num_kv_blocks=64, block_size=8, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96
)
FORCED = {"cuda_graphs", "spec_cuda_graphs"}


def _force_spec_graphs(monkeypatch: pytest.MonkeyPatch, forced: set[str] = FORCED) -> None:
    """Resolve ``forced`` (default cuda_graphs and spec_cuda_graphs) on, as a CUDA device with
    Triton would."""

    def resolve(config: EngineConfig, cuda_available: bool | None = None) -> ResolvedFeatures:
        features = resolve_features(config, cuda_available)
        features.decisions = tuple(
            FeatureDecision(d.feature, None, True, "forced on for the test")
            if d.feature in forced
            else d
            for d in features.decisions
        )
        return features

    monkeypatch.setattr(engine.core, "resolve_features", resolve)


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
def test_graph_bodies_equal_greedy_without_speculation(
    checkpoint, models, baseline, method, monkeypatch
):
    """fp32 greedy, async on: the padded bodies emit exactly the tokens of decoding without
    speculation, and every step with drafts ran them."""
    _force_spec_graphs(monkeypatch)
    spec = dict(spec_method=method, spec_model=models[method], num_spec_tokens=3)
    outs, llm = _generate(checkpoint, GREEDY, async_scheduling=True, **spec)
    assert outs == baseline
    graphs = llm.engine.runner.spec_graphs
    assert llm.engine.features.spec_cuda_graphs
    assert graphs.buckets == [16, 32] and graphs.replay_eagerly
    assert graphs.num_replays > 10 and graphs.num_eager == 0


@pytest.mark.parametrize("method", ["ngram", "eagle", "draft"])
def test_graph_bodies_equal_eager_spec_when_sampling(checkpoint, models, method, monkeypatch):
    """Seeded random sampling: the same drafts verified at the same positions with the same
    noise, so the bodies give the eager speculative path's tokens exactly."""
    spec = dict(spec_method=method, spec_model=models[method], num_spec_tokens=3)
    eager, eager_llm = _generate(checkpoint, SEEDED, async_scheduling=False, **spec)
    assert not eager_llm.engine.features.spec_cuda_graphs  # the CPU resolves it off
    assert eager_llm.engine.runner.spec_graphs.num_replays == 0
    _force_spec_graphs(monkeypatch)
    got, llm = _generate(checkpoint, SEEDED, async_scheduling=False, **spec)
    assert llm.engine.runner.spec_graphs.num_replays > 0
    assert got == eager


def test_logprobs_steps_replay_and_match_the_eager_path(checkpoint, models, monkeypatch):
    """Requests asking for logprobs next to plain greedy ones (the bench's pycode workload has
    one in 16): the steps replay the logprobs variant (none eager), emitting the eager
    speculative path's tokens and, per token, the same (id, logprob) pairs."""
    params = [dataclasses.replace(GREEDY, logprobs=2 if i % 2 else None) for i in range(5)]
    spec = dict(spec_method="eagle", spec_model=models["eagle"], num_spec_tokens=3)

    def run() -> tuple[list, LLM]:
        llm = LLM(model=checkpoint, debug_invariants=True, **ENGINE, **spec)
        outs = llm.generate(PROMPTS, params)
        llm.close()
        return [(o.output_token_ids, o.logprobs) for o in outs], llm

    eager, _ = run()
    _force_spec_graphs(monkeypatch)
    got, llm = run()
    graphs = llm.engine.runner.spec_graphs
    assert graphs.num_replays > 10 and graphs.num_eager == 0
    for (ids, lps), (want_ids, want_lps) in zip(got, eager, strict=True):
        assert ids == want_ids and (lps is None) == (want_lps is None)
        for row, want in zip(lps or [], want_lps or [], strict=True):
            assert [t for t, _ in row] == [t for t, _ in want]
            assert [v for _, v in row] == pytest.approx([v for _, v in want], abs=1e-4)


def test_sync_accepted_runs_the_graph_bodies_too(checkpoint, models, baseline, monkeypatch):
    _force_spec_graphs(monkeypatch)
    spec = dict(spec_method="eagle", spec_model=models["eagle"], num_spec_tokens=3)
    outs, llm = _generate(checkpoint, GREEDY, spec_sync_accepted=True, **spec)
    assert outs == baseline and llm.engine.runner.spec_graphs.num_replays > 0


# ---- which steps replay -------------------------------------------------------------------------


def _verify_step(drafts: dict[str, int], tokens: dict[str, int] | None = None) -> SchedulerOutput:
    ids = list(drafts)
    scheduled = tokens or {r: 1 + n for r, n in drafts.items()}
    return SchedulerOutput(
        step=1,
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(ids, [[] for _ in ids], [0] * len(ids)),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={r: [-1] * n for r, n in drafts.items() if n},
    )


def test_shape_for_pads_to_a_bucket_unless_sampling_needs_more(checkpoint, monkeypatch) -> None:
    from engine.runner.spec_graphs import EAGER_GRAMMAR, EAGER_SAMPLING, EAGER_TOKENS, SpecShape
    from engine.scheduler.outputs import NewRequestData

    _force_spec_graphs(monkeypatch)
    engine = dict(ENGINE, max_num_seqs=5)  # buckets 16 and 32 over 5 padded requests
    llm = LLM(model=checkpoint, spec_method="ngram", num_spec_tokens=3, **engine)
    runner = llm.engine.runner
    graphs, states = runner.spec_graphs, runner.states
    for i, params in enumerate([GREEDY, GREEDY, SEEDED[0]]):
        states.add(NewRequestData(f"r{i}", [1, 2, 3], [], params, [0], 3))
    greedy16, greedy32 = SpecShape(16, 5, 16, True), SpecShape(32, 5, 20, True)
    assert graphs.shape_for(_verify_step({"r0": 3, "r1": 3}), True) == greedy16
    assert graphs.shape_for(_verify_step({"r0": 3, "r1": 2}), True) == greedy16  # trimmed
    assert graphs.shape_for(_verify_step({"r0": 3, "r1": 0}), True) == greedy16  # a decode
    prefill = _verify_step({"r0": 3}, {"r0": 4, "r1": 20})  # next to a 20-token chunk
    assert graphs.shape_for(prefill, True) == greedy32
    three = _verify_step({"r0": 3, "r1": 3, "r2": 3})  # r2 samples: the random variant
    assert graphs.shape_for(three, True) == SpecShape(16, 5, 16, False)
    assert graphs.num_eager == 0
    assert graphs.shape_for(_verify_step({"r0": 3}), False) is None  # a grammar mask
    assert graphs.shape_for(_verify_step({"r0": 0}), True) is None  # no drafts: not counted
    assert graphs.num_eager == 1
    states.add(
        NewRequestData(
            "pen", [1, 2], [], dataclasses.replace(GREEDY, repetition_penalty=1.2), [1], 2
        )  # fmt: skip
    )
    assert graphs.shape_for(_verify_step({"r0": 3, "pen": 3}), True) is None
    states.add(NewRequestData("top", [1, 2], [], dataclasses.replace(SEEDED[0], top_k=5), [2], 2))
    assert graphs.shape_for(_verify_step({"r0": 3, "top": 3}), True) is None
    assert graphs.num_eager == 3
    assert graphs.eager_reasons == {EAGER_GRAMMAR: 1, EAGER_SAMPLING: 2}
    states.apply(states.flush())  # the staged rows reach the device, as each step does
    states.remove({"pen"})
    states.add(NewRequestData("lp", [1, 2], [], dataclasses.replace(GREEDY, logprobs=2), [3], 2))
    with_logprobs = SpecShape(16, 5, 16, True, logprobs=True)  # the logprobs variant
    assert graphs.shape_for(_verify_step({"r0": 3, "lp": 3}), True) == with_logprobs
    assert graphs.shape_for(_verify_step({"r0": 3}, {"r0": 4, "lp": 40}), True) is None
    assert graphs.eager_reasons[EAGER_TOKENS] == 1  # 44 tokens: over the largest bucket
    llm.close()


def test_decision_needs_graphs_triton_and_a_method() -> None:
    base = dict(model_config="qwen3-0.6b", random_weights=True, max_num_seqs=64)

    def decision(cuda: bool, **kw) -> FeatureDecision:
        config = EngineConfig.from_flat(**base, **kw)
        features = resolve_features(config, cuda_available=cuda)
        return {d.feature: d for d in features.decisions}["spec_cuda_graphs"]

    assert "no speculative decoding" in decision(False).reason
    cpu = decision(False, spec_method="ngram", num_spec_tokens=2)
    assert (cpu.requested, cpu.resolved) == (None, False) and "cuda_graphs is off" in cpu.reason
    cuda = decision(True, device="cuda", spec_method="ngram", num_spec_tokens=2)
    triton = decision(True, device="cuda", spec_method="ngram", num_spec_tokens=2,
                      triton_kernels=False)  # fmt: skip
    assert triton.resolved is False and "triton_kernels is off" in triton.reason
    if cuda.resolved:  # triton importable
        assert "speculative steps of <= 384 tokens" in cuda.reason
    off = decision(True, device="cuda", spec_method="ngram", num_spec_tokens=2,
                   spec_cuda_graphs=False)  # fmt: skip
    assert off.reason == "off as requested"
    with pytest.raises(ValueError, match="spec_cuda_graphs=True cannot be honoured"):
        decision(False, spec_method="ngram", num_spec_tokens=2, spec_cuda_graphs=True)


@pytest.mark.parametrize("method", ["ngram", "eagle", "draft", "mtp"])
def test_graph_bodies_move_no_host_data(checkpoint, models, method, monkeypatch):
    """What a CUDA capture rejects and the CPU runs happily: the bodies (Triton kernels, both
    sampling variants) copy no host data to the device and read no device value on the host
    (engine.runner.capture_guard; the H200 found ``cu[bp + 1] = n`` in ``layout``)."""
    from engine.device import CpuDevice
    from engine.runner.capture_guard import HostDataGuard, device_tensors

    host: list = []  # every host buffer of the engine (pinned on CUDA)
    host_empty = CpuDevice.host_empty
    monkeypatch.setattr(
        CpuDevice, "host_empty", lambda self, *a: host.append(host_empty(self, *a)) or host[-1]
    )
    _force_spec_graphs(monkeypatch)
    spec = dict(spec_method=method, spec_model=models[method], num_spec_tokens=3)
    llm = LLM(model=checkpoint, triton_kernels=True, warmup=False, **ENGINE, **spec)
    runner = llm.engine.runner
    graphs = runner.spec_graphs
    assert llm.engine.features.triton_kernels and graphs.enabled and host
    shapes = graphs.bucket_shapes(graphs.buckets[0])  # greedy / random, without / with logprobs
    assert len(shapes) == 4 and shapes[-1].logprobs
    graphs.fill(shapes[0])
    with HostDataGuard(device_tensors(runner), host) as guard:
        graphs.run_bodies(shapes)
    llm.close()
    assert guard.num_ops > 500 and not guard.violations, "\n".join(map(str, guard.violations))


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_graph_bodies_survive_stale_memory_in_padding_rows(checkpoint, models, method, monkeypatch):
    """On CUDA the rejection scan leaves padding rows of its output as the allocator handed them
    over (stale memory: any int64); the logprobs verify body gathered logits by those ids and
    hit a device-side assert on the H200 (ScatterGatherKernel, index out of bounds). Here every
    buffer the scan allocates starts as an out-of-vocabulary id, as stale memory can, and the
    bodies of every variant must run and leave the padding rows at -1."""
    import engine.kernels.rejection as rejection

    stale = 1 << 40
    monkeypatch.setattr(
        rejection.torch, "empty_like", lambda t, **kw: torch_full_like(t, stale, **kw)
    )
    _force_spec_graphs(monkeypatch)
    spec = dict(spec_method=method, spec_model=models[method], num_spec_tokens=3)
    llm = LLM(model=checkpoint, triton_kernels=True, warmup=False, **ENGINE, **spec)
    graphs = llm.engine.runner.spec_graphs
    shapes = graphs.bucket_shapes(graphs.buckets[0])
    assert shapes[-1].logprobs
    graphs.fill(shapes[0])  # every request padded: every row is a padding row
    graphs.run_bodies(shapes)
    n = shapes[0].num_rows
    assert (graphs.tokens[:n] == -1).all()
    assert (graphs.logprob_ids[:n] >= 0).all()  # gathered at a clamped id, not at the stale one
    llm.close()
