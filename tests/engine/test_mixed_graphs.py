"""Mixed/prefill steps padded to token buckets (the path CUDA graphs capture) give the same tokens
as the unpadded eager path (docs/design.md §2.6).

On the CPU the padded path runs as the plain function a graph would capture
(``CudaGraphRunner(replay_eagerly=True)``): same persistent buffers, same padded shapes, same host
bounds. Tokens are compared exactly (fp32, greedy) with the eager runner and with a full
recompute of each sequence (``reference_greedy``, an independent reference)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import engine.core
from analysis import analyze_trace, compare_reports, load_trace
from engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    FeatureDecision,
    ResolvedFeatures,
    SchedulerConfig,
    resolve_features,
)
from engine.device import CpuDevice
from engine.kernels.attention import paged_attention_torch, paged_attention_triton
from engine.kernels.backend import create_kernel_backend
from engine.llm import LLM
from engine.model.paged_batch import build_attention_metadata
from engine.runner.cuda_graphs import CudaGraphRunner, GraphShape, capture_sizes, mixed_buckets
from engine.runner.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from instrument.tracer import Tracer
from tests.engine.runner_harness import new_req, reference_greedy, step_output, tiny_model
from tests.engine.test_attention import make_case


@pytest.mark.parametrize(
    "max_tokens,expected",
    [
        (0, []),
        (8, [8]),
        (16, [16]),
        (100, [16, 32, 64, 100]),
        (300, [16, 32, 64, 128, 256, 300]),
        (1024, [16, 32, 64, 128, 256, 512, 768, 1024]),
        (2048, [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]),
    ],
)
def test_mixed_buckets(max_tokens: int, expected: list[int]) -> None:
    assert mixed_buckets(max_tokens) == expected


@pytest.mark.parametrize(
    "max_batch,expected",
    [
        (1, [1]),
        (7, [1, 2, 4, 7]),
        (20, [1, 2, 4, 8, 16, 20]),
        (300, [1, 2, 4, *range(8, 257, 8), 272, 288, 300]),
    ],
)
def test_decode_capture_sizes(max_batch: int, expected: list[int]) -> None:
    assert capture_sizes(max_batch) == expected


def test_device_sized_batches_capture_wider_steps_past_256() -> None:
    sizes = capture_sizes(1024)
    assert len(sizes) == 83 and sizes[-1] == 1024
    # every batch pads to a captured size: by < 8 rows up to 256, by < 16 past it
    for batch in range(1, 1025):
        padded = next(s for s in sizes if s >= batch)
        assert padded - batch < (8 if batch <= 256 else 16)


def test_mixed_buckets_refuses_negative() -> None:
    with pytest.raises(ValueError, match="max_tokens must be >= 0"):
        mixed_buckets(-1)


def test_shape_for_pads_tokens_to_a_bucket_and_requests_to_the_bucket_or_max() -> None:
    graphs = CudaGraphRunner(True, max_batch=4, mixed_max_tokens=64)
    assert graphs.buckets == [16, 32, 64]
    assert graphs.shape_for(3, 3, uniform_decode=True) == GraphShape(4, 4, True)
    assert graphs.shape_for(1, 5, uniform_decode=False) == GraphShape(16, 4, False)
    assert graphs.shape_for(4, 32, uniform_decode=False) == GraphShape(32, 4, False)  # exact fit
    assert graphs.shape_for(2, 33, uniform_decode=False) == GraphShape(64, 4, False)
    assert graphs.num_mixed_eager == 0
    assert graphs.shape_for(2, 65, uniform_decode=False) is None  # beyond the largest bucket
    assert graphs.num_mixed_eager == 1
    small = CudaGraphRunner(True, max_batch=64, mixed_max_tokens=64)
    assert small.shape_for(5, 16, uniform_decode=False) == GraphShape(16, 16, False)
    off = CudaGraphRunner(True, max_batch=4)
    assert off.shape_for(1, 5, uniform_decode=False) is None and off.num_mixed_eager == 0
    with pytest.raises(ValueError, match="need decode graphs"):
        CudaGraphRunner(False, max_batch=4, mixed_max_tokens=64)


def test_runner_checks_the_mixed_bound() -> None:
    limits = SchedulerConfig(max_num_seqs=2, max_model_len=32, max_num_batched_tokens=16)
    cache = CacheConfig(block_size=4, num_kv_blocks=8)
    with pytest.raises(ValueError, match="mixed_graph_max_tokens must be in"):
        ModelRunner(None, CpuDevice(), limits, cache, cuda_graphs=True, mixed_graph_max_tokens=17)
    with pytest.raises(ValueError, match="needs cuda_graphs=True"):
        ModelRunner(None, CpuDevice(), limits, cache, mixed_graph_max_tokens=16)


# ---- runner: padded path vs eager vs full recompute ---------------------------------------------

P1 = [5, 17, 3, 44, 9, 61, 2, 30, 71, 8, 13]  # 11 tokens
P2 = [11, 12, 80, 7, 33]  # 5
P3 = [90, 4, 25, 66, 1, 19, 50]  # 7
P4 = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 60, 67]  # 19


def _runner(model, mixed_max_tokens: int, graphs: bool = True, triton: bool = False, device=None):
    """A runner on ``device`` (default: the CPU, where the padded path runs eagerly)."""
    limits = SchedulerConfig(max_num_seqs=4, max_model_len=48, max_num_batched_tokens=32)
    kernels = create_kernel_backend("triton" if triton else "torch")
    return ModelRunner(
        model,
        device or CpuDevice(),
        limits,
        CacheConfig(block_size=4, num_kv_blocks=64),
        kernels=kernels,
        cuda_graphs=graphs,
        mixed_graph_max_tokens=mixed_max_tokens,
    )


def _mixed_schedule() -> list:
    """A batch of one (R1's first 3-token chunk), chunked prefill next to decodes, odd lengths,
    a step of exactly 16 tokens (fills the bucket), one of 19 tokens (beyond a 16-token largest
    bucket), and decode steps in between."""
    return [
        # a batch of one: R1 prefills 3 of 11 tokens
        step_output(0, new=[new_req("R1", P1, [0, 1, 2, 12])], tokens={"R1": 3}),
        # R1's last 8 tokens + R2 whole (5) + R3's first 3 of 7: 16 tokens, fills bucket 16
        step_output(
            1,
            new=[new_req("R2", P2, [3, 4]), new_req("R3", P3, [5, 6])],
            cached=[("R1", [], 3)],
            tokens={"R1": 8, "R2": 5, "R3": 3},
        ),
        # R3's last 4 tokens next to two decodes: 6 tokens
        step_output(
            2,
            cached=[("R1", [], 11), ("R2", [], 5), ("R3", [], 3)],
            tokens={"R1": 1, "R2": 1, "R3": 4},
        ),  # fmt: skip
        step_output(
            3,
            cached=[("R1", [], 12), ("R2", [], 6), ("R3", [], 7)],
            tokens={"R1": 1, "R2": 1, "R3": 1},
        ),  # fmt: skip
        # R4 prefills whole (19) next to a decode: 20 tokens
        step_output(
            4,
            new=[new_req("R4", P4, [7, 8, 9, 10, 11])],
            cached=[("R1", [], 13), ("R2", [], 7)],
            tokens={"R1": 1, "R4": 19},
            finished={"R3"},
        ),
        step_output(5, cached=[("R1", [], 14), ("R4", [], 19)], tokens={"R1": 1, "R4": 1}),
    ]


def _run(runner: ModelRunner, outs: list) -> dict[str, list[int]]:
    handles = [runner.execute_model(o) for o in outs]
    got: dict[str, list[int]] = {}
    for handle in handles:
        result = handle.get()
        for req_id, toks in zip(result.req_ids, result.sampled_token_ids, strict=True):
            got.setdefault(req_id, []).extend(toks)
    if not runner.device.is_cuda:
        runner.device.close()
    return got


def _reference(model) -> dict[str, list[int]]:
    return {
        "R1": reference_greedy(model, P1, 5),
        "R2": reference_greedy(model, P2, 3),
        "R3": reference_greedy(model, P3, 2),
        "R4": reference_greedy(model, P4, 2),
    }


@pytest.mark.parametrize("max_tokens", [32, 16], ids=["all_in_buckets", "largest_16"])
def test_padded_buckets_match_eager_and_full_recompute(max_tokens: int) -> None:
    model = tiny_model()
    eager = _run(_runner(model, 0, graphs=False), _mixed_schedule())
    padded_runner = _runner(model, max_tokens)
    padded = _run(padded_runner, _mixed_schedule())
    assert padded == eager == _reference(model)
    graphs = padded_runner.graphs
    # mixed steps 0, 1, 2, 4; decode steps 3, 5
    if max_tokens == 32:
        assert (graphs.num_mixed_replays, graphs.num_mixed_eager) == (4, 0)
    else:  # step 4 has 20 tokens > 16: it runs eagerly
        assert (graphs.num_mixed_replays, graphs.num_mixed_eager) == (3, 1)
    assert graphs.num_replays - graphs.num_mixed_replays == 2
    assert graphs.describe()["mixed_graph_buckets"] == ",".join(map(str, graphs.buckets))


def test_padded_buckets_with_triton_kernels_match_eager() -> None:
    """The Triton path (interpreter): varlen attention over the padded shape, input prep."""
    model = tiny_model(use_triton=True)
    eager = _run(_runner(model, 0, graphs=False, triton=True), _mixed_schedule()[:2])
    padded_runner = _runner(model, 32, triton=True)
    padded = _run(padded_runner, _mixed_schedule()[:2])
    assert padded == eager
    assert eager["R1"] == reference_greedy(model, P1, 1)
    assert eager["R2"] == reference_greedy(model, P2, 1)
    assert padded_runner.graphs.num_mixed_replays == 2


def test_padding_tokens_write_no_kv() -> None:
    """After a padded step the KV cache differs from the eager run's nowhere: padding tokens
    (slot -1) write nothing, and real tokens write the same values."""
    model = tiny_model()
    eager, padded = _runner(model, 0, graphs=False), _runner(model, 32)
    outs = _mixed_schedule()[:2]
    _run(eager, outs)
    _run(padded, _mixed_schedule()[:2])
    for a, b in zip(eager.fwd.kv_caches, padded.fwd.kv_caches, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    used = torch.zeros(64, dtype=torch.bool)
    used[:7] = True  # blocks 0..6 hold R1, R2, R3
    assert torch.all(padded.fwd.kv_caches[0][:, ~used] == 0)


def test_varlen_triton_under_graph_bounds_matches_reference() -> None:
    """The captured attention call: padded requests (query_len 0) up to the shape's request
    count, padding tokens up to the bucket, ``max_query_len`` = the bucket and ``max_seq_len``
    = max_model_len; real rows equal the torch reference on the unpadded batch, padding rows 0."""
    q_lens, seq_lens = [1, 7, 1, 3], [9, 7, 30, 20]
    padded = make_case(q_lens, seq_lens, 4, 2, 16, 4, seed=3, num_padded_tokens=32,
                       num_padded_reqs=8)  # fmt: skip
    md = dataclasses.replace(padded.metadata, max_query_len=32, max_seq_len=64)
    out = paged_attention_triton(padded.q, padded.kv_cache, md, 0.25)
    real = sum(q_lens)
    md_real, _ = build_attention_metadata(
        [s - q for s, q in zip(seq_lens, q_lens, strict=True)], q_lens,
        padded.metadata.block_table[: len(q_lens)].tolist(), 4, "cpu",
    )  # fmt: skip
    ref = paged_attention_torch(padded.q[:real], padded.kv_cache, md_real, 0.25)
    torch.testing.assert_close(out[:real], ref, rtol=1e-4, atol=1e-5)
    assert torch.all(out[real:] == 0)


# ---- engine: the decision and a scheduler-driven workload ---------------------------------------


def _decisions(config: EngineConfig, cuda: bool) -> dict[str, FeatureDecision]:
    return {d.feature: d for d in resolve_features(config, cuda_available=cuda).decisions}


def test_decision_follows_graphs_triton_and_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    base = dict(model_config="qwen3-0.6b", random_weights=True)
    cpu = _decisions(EngineConfig.from_flat(**base), cuda=False)["mixed_cuda_graphs"]
    assert (cpu.requested, cpu.resolved) == (None, False)
    assert "cuda_graphs is off" in cpu.reason
    cuda = EngineConfig.from_flat(**base, device="cuda")
    d = _decisions(cuda, cuda=True)["mixed_cuda_graphs"]
    if _decisions(cuda, cuda=True)["triton_kernels"].resolved:
        assert d.resolved is True and "<= 2048 tokens" in d.reason
    off = _decisions(
        EngineConfig.from_flat(**base, device="cuda", mixed_graph_max_tokens=0), cuda=True
    )
    assert off["mixed_cuda_graphs"].reason == "off as requested"
    torch_kernels = EngineConfig.from_flat(**base, device="cuda", triton_kernels=False)
    d = _decisions(torch_kernels, cuda=True)["mixed_cuda_graphs"]
    assert d.resolved is False and "triton_kernels is off" in d.reason
    spec = EngineConfig.from_flat(**base, device="cuda", spec_method="ngram", num_spec_tokens=2)
    if _decisions(spec, cuda=True)["triton_kernels"].resolved:
        assert "speculative decoding" in _decisions(spec, cuda=True)["mixed_cuda_graphs"].reason
    with pytest.raises(ConfigError, match="mixed_cuda_graphs=True cannot be honoured"):
        resolve_features(
            EngineConfig.from_flat(**base, mixed_graph_max_tokens=64), cuda_available=False
        )
    with pytest.raises(ConfigError, match="mixed_graph_max_tokens must be in"):
        EngineConfig.from_flat(**base, mixed_graph_max_tokens=4096)


def _force_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolve cuda_graphs and mixed_cuda_graphs on, as a CUDA device with Triton would."""

    def resolve(config, cuda_available=None) -> ResolvedFeatures:
        features = resolve_features(
            dataclasses.replace(
                config,
                requested=dataclasses.replace(config.requested, mixed_graph_max_tokens=None),
            ),
            cuda_available,
        )
        forced = {"cuda_graphs", "mixed_cuda_graphs"}
        features.decisions = tuple(
            FeatureDecision(d.feature, None, True, "forced on for the test")
            if d.feature in forced
            else d
            for d in features.decisions
        )
        return features

    monkeypatch.setattr(engine.core, "resolve_features", resolve)


def _generate(llm: LLM) -> list[list[int]]:
    """Odd prompt lengths, chunked prefill (a 45-token prompt over 32-token steps), then a
    second wave whose prompts share a 32-token prefix with the first (prefix-cache hits)."""
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prefix = [(7 * i + 3) % 120 + 2 for i in range(32)]
    first = [prefix + [9, 4, 77, 5, 31, 8, 100, 3, 15, 6, 90, 1, 2], [5, 6, 7], [40] * 9]
    second = [prefix + [11, 12, 13], prefix + [50, 51, 52, 53, 54], [3]]
    out = llm.generate(first, params) + llm.generate(second, params)
    return [o.output_token_ids for o in out]


def test_engine_workload_padded_matches_eager(
    tiny_model_config: str, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    kwargs = dict(model_config=tiny_model_config, random_weights=True, num_kv_blocks=64,
                  max_num_seqs=4, max_num_batched_tokens=32, block_size=4)  # fmt: skip
    eager_path = str(tmp_path / "eager.pftrace")
    eager_tracer = Tracer(eager_path)
    eager = LLM(tracer=eager_tracer, **kwargs)
    want = _generate(eager)
    assert not eager.engine.features.mixed_cuda_graphs
    eager.close()
    eager_tracer.close()
    _force_graphs(monkeypatch)
    path = str(tmp_path / "mixed.pftrace")
    tracer = Tracer(path)
    llm = LLM(tracer=tracer, **kwargs, mixed_graph_max_tokens=16)
    got = _generate(llm)
    graphs = llm.engine.runner.graphs
    assert llm.engine.scheduler.get_stats().prefix_cache_hit_tokens >= 64  # both hit 32 tokens
    llm.close()
    tracer.close()
    assert got == want
    assert graphs.buckets == [16]
    assert graphs.num_mixed_replays > 0 and graphs.num_mixed_eager > 0
    trace = load_trace(path)
    assert trace.config["mixed_graph_buckets"] == "16"
    assert trace.config["cuda_graph_sizes"] == "1,2,4"
    decisions = trace.decisions.set_index("feature")
    assert decisions.loc["mixed_cuda_graphs", "reason"] == "forced on for the test"
    # A/B: the one variable is mixed_graph_max_tokens; the captured shapes follow from it
    comparison = compare_reports(analyze_trace(eager_path), analyze_trace(path))
    assert set(comparison.differences) == {"mixed_graph_max_tokens"}
    assert comparison.contract_ok


def test_has_key_is_has_and_follows_the_captured_shapes() -> None:
    """``has_key`` (the traced step's ``graph_replay`` lookup, memoised on a tuple) answers as
    ``has`` of the same shape for every shape asked, also after mixed graphs are disabled and
    after all graphs are (its memo is cleared with the captured set)."""
    graphs = CudaGraphRunner(True, max_batch=4, mixed_max_tokens=32, replay_eagerly=True)
    graphs.capture(None, lambda shape: torch.empty(0), lambda shape: None)  # type: ignore[arg-type]
    asked = [(t, r, u) for t in (1, 2, 4, 8, 16, 32, 64) for r in (1, 2, 4) for u in (True, False)]

    def agree() -> list[bool]:
        got = [graphs.has_key(*key) for key in asked]
        assert got == [graphs.has(GraphShape(*key)) for key in asked]
        return got

    first = agree()
    assert any(first) and graphs.has_key(16, 4, False)
    graphs.disable_mixed("test")
    after_mixed = agree()
    assert not graphs.has_key(16, 4, False) and graphs.has_key(4, 4, True)
    assert sum(after_mixed) < sum(first)
    graphs.disable("test")
    assert not any(agree())
