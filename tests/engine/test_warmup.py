"""Warm-up before the workload (engine/warmup.py): the plan's coverage, and an engine left clean."""

from __future__ import annotations

import math

import pytest

from analysis import load_trace
from engine.cli import run_main
from engine.config import CacheConfig, SchedulerConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.warmup import (
    blocks_for,
    max_query_len,
    profile_plan,
    query_buckets,
    request_counts,
    warmup_plan,
)
from instrument.schema import ConfigArg, CpuSlice, DeviceSlice
from instrument.tracer import Tracer

# Small enough that the torch reference attention (padded to the longest query) stays fast.
SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32, block_size=8, num_kv_blocks=64)


def test_request_counts_and_query_buckets() -> None:
    assert request_counts(256) == [1, 2, 3, 4, 8, 16, 32, 64, 128, 256]
    assert request_counts(48) == [1, 2, 3, 4, 8, 16, 32, 48]
    assert request_counts(1) == [1]
    assert query_buckets(2046) == [2, 9, 16, 32, 64, 128, 256, 512, 1024, 2046]
    assert query_buckets(16) == [2, 9, 16]
    assert query_buckets(1) == []


def _parts(
    seqs: int, budget: int, model_len: int, blocks: int, block_size: int
) -> tuple[SchedulerConfig, CacheConfig]:
    """Resolved scheduler and cache parts, as the engine passes them on."""
    limits = SchedulerConfig(seqs, budget, model_len)
    return limits, CacheConfig(block_size, num_kv_blocks=blocks)


@pytest.mark.parametrize(
    ("parts", "k"),
    [
        (_parts(256, 2048, 40960, 70000, 16), 0),
        (_parts(64, 512, 300, 20, 16), 3),
        # the model length binds: the H200's default budget with k = 3 once asked for 129 blocks
        # of a 128-block table row
        (_parts(64, 2048, 2048, 16384, 16), 3),
        (_parts(4, 32, 512, 64, 8), 2),
        (_parts(1, 8, 16, 2, 8), 0),
    ],
)
def test_plan_covers_every_class_within_the_limits(
    parts: tuple[SchedulerConfig, CacheConfig], k: int
) -> None:
    limits, cache = parts
    plan = warmup_plan(limits, cache, k)
    max_q = max_query_len(limits, cache, k)
    for step in plan + profile_plan(limits, cache, k):
        lens = step.query_lens
        assert 1 <= len(lens) <= limits.max_num_seqs
        assert sum(lens) <= limits.max_num_batched_tokens
        assert max(lens) <= max_q
        # the longest request with its sampled token and verified drafts fits the model and pool
        assert max(lens) + 2 + 2 * k <= limits.resolved_max_model_len
        blocks = blocks_for(cache, max(lens), k)
        assert len(blocks) * cache.block_size >= max(lens) + 1 + k
        assert len(blocks) <= cache.resolved_num_kv_blocks
        # ... and in the runner's block-table row, which holds max_model_len tokens
        assert len(blocks) <= cache.blocks_for(limits.resolved_max_model_len)
        if step.verify:
            assert len(lens) * (1 + k) <= limits.max_num_batched_tokens
    decode_sizes = {len(s.query_lens) for s in plan if set(s.query_lens) == {1}}
    assert decode_sizes >= set(request_counts(limits.max_num_seqs)) - {
        r for r in request_counts(limits.max_num_seqs) if r > limits.max_num_batched_tokens
    }
    longest = {max(s.query_lens) for s in plan}
    assert longest >= set(query_buckets(max_q))
    params = {s.params for s in plan}
    assert len(params) >= 5  # greedy and the four sampling variants
    assert any(s.bitmask for s in plan) and any(s.deferred for s in plan)
    assert any(s.verify for s in plan) == (k > 0)


def test_profile_plan_fills_the_token_budget_and_the_sampler() -> None:
    (step,) = profile_plan(*_parts(256, 2048, 40960, 200, 16))
    assert sum(step.query_lens) == 2048 and len(step.query_lens) == 256
    assert step.params.logprobs and step.params.has_penalties and step.params.top_k


@pytest.mark.parametrize(
    ("seqs", "budget", "model_len", "k"), [(4, 32, 512, 0), (64, 2048, 300, 3)]
)
def test_memory_probe_pool_holds_the_profile_step(
    seqs: int, budget: int, model_len: int, k: int
) -> None:
    """engine/memory_profile.py sizes its probe's pool for the profile step, without a copy
    record: the plan from the probe config's parts writes only blocks inside that pool."""
    from engine.config import EngineConfig
    from engine.memory_profile import _probe_blocks

    spec = {"spec_method": "ngram", "num_spec_tokens": k} if k else {}
    config = EngineConfig.from_flat(
        model="unused", max_num_seqs=seqs, max_num_batched_tokens=budget, **spec
    )
    probe = config.resolved(model_len, _probe_blocks(config, model_len))
    (step,) = profile_plan(probe.scheduler, probe.cache, k)
    assert sum(step.query_lens) == budget and step.verify == (k > 0)
    longest = max(step.query_lens)
    # the probe's pool does not shorten the profile step: only the budget and model length do
    assert max_query_len(probe.scheduler, probe.cache, k) == min(budget, model_len - 2 - 2 * k)
    assert longest <= min(budget, model_len - 2 - 2 * k)
    blocks = blocks_for(probe.cache, longest, k)
    assert len(blocks) < probe.cache.resolved_num_kv_blocks  # one block to spare
    assert len(blocks) * probe.cache.block_size >= longest + 2 + 2 * k


WORKLOAD = [
    ([3, 4, 5, 6], SamplingParams(temperature=0.0, max_tokens=6)),
    ([7, 8, 9], SamplingParams(temperature=0.9, seed=11, max_tokens=6)),
    ([10, 11, 12, 13, 14], SamplingParams(temperature=0.9, max_tokens=6)),  # unseeded
    ([15, 16], SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3, max_tokens=6)),
    (list(range(20, 45)), SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=6)),
    ([50, 51, 52], SamplingParams(temperature=0.0, logprobs=2, max_tokens=4)),
]


def _generate(llm: LLM) -> list[tuple[list[int], object]]:
    prompts = [p for p, _ in WORKLOAD]
    outs = llm.generate(prompts, [s for _, s in WORKLOAD])
    return [(o.output_token_ids, o.logprobs) for o in outs]


def _assert_clean(llm: LLM) -> None:
    """Nothing of warm-up is left in the books a run reads."""
    engine = llm.engine
    pool = engine.scheduler.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert pool.num_cached_blocks == 0
    stats = engine.scheduler.get_stats()
    assert (stats.running_requests, stats.waiting_requests, stats.output_placeholders) == (0, 0, 0)
    assert stats.kv_usage == 0
    assert engine.scheduler.next_step == 0
    assert engine.scheduler.num_requests == 0
    assert engine.runner.states.num_free_rows == engine.config.scheduler.max_num_seqs
    assert engine.runner.states.row_of == {}
    summary = engine.requests.summary()
    assert not summary.ttft_ms and not summary.e2e_ms


@pytest.mark.parametrize("spec", [{}, {"spec_method": "ngram", "num_spec_tokens": 2}])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_warmup_leaves_the_engine_clean_and_tokens_unchanged(
    tiny_hf_checkpoint: str, spec: dict[str, object], async_scheduling: bool
) -> None:
    common = dict(model=tiny_hf_checkpoint, async_scheduling=async_scheduling, **SMALL, **spec)
    with LLM(warmup=True, **common) as warm:  # type: ignore[arg-type]
        report = warm.engine.warmup
        assert report.num_steps >= len(warmup_plan(*_limits(warm))) and report.seconds > 0
        _assert_clean(warm)
        warm_out = _generate(warm)
        warm.engine.check_idle()
    with LLM(warmup=False, **common) as cold:  # type: ignore[arg-type]
        assert cold.engine.warmup.num_steps == 0
        cold_out = _generate(cold)
    assert warm_out == cold_out


def _limits(llm: LLM) -> tuple[SchedulerConfig, CacheConfig, int]:
    """The parts the engine's runner was given (resolved), and its drafts per request."""
    runner = llm.engine.runner
    assert runner.limits.resolved_max_model_len == llm.engine.max_model_len
    assert runner.cache.resolved_num_kv_blocks == llm.engine.kv.num_blocks
    k = 0 if runner.spec is None else runner.spec.num_spec_tokens
    assert k == llm.engine.config.spec.num_spec_tokens
    return runner.limits, runner.cache, k


def test_warmup_is_not_in_the_trace(tiny_hf_checkpoint: str, tmp_path) -> None:
    path = tmp_path / "t.pftrace"
    tracer = Tracer(path)
    with LLM(model=tiny_hf_checkpoint, warmup=True, tracer=tracer, **SMALL) as llm:
        warmup_steps = llm.engine.warmup.num_steps
        llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=3))
        num_steps = llm.engine.scheduler.next_step
    tracer.close()
    frames = load_trace(str(path))
    slices = frames.slices
    scheduled = slices[slices["name"] == CpuSlice.SCHEDULE.value]["step"]
    forwards = slices[slices["name"] == DeviceSlice.FORWARD.value]
    assert sorted(scheduled) == list(range(num_steps))  # the workload's steps, from 0
    assert len(forwards) <= num_steps < warmup_steps
    assert frames.config[ConfigArg.WARMUP_STEPS.value] == warmup_steps
    assert frames.config[ConfigArg.WARMUP_S.value] > 0


def test_run_summary_prints_warmup_apart(tiny_hf_checkpoint: str, capsys) -> None:
    argv = [
        "--model", tiny_hf_checkpoint, "--workload", "synthetic:n=3,in=4-8,out=2-4,vocab=100,seed=1",
        "--warmup", "on", "--no-progress", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "32", "--block-size", "8", "--num-kv-blocks", "64",
    ]  # fmt: skip
    assert run_main(argv) == 0
    out = capsys.readouterr().out
    assert "KV cache: 64 blocks x 8 = 512 tokens (--num-kv-blocks)" in out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("warm-up           ")]
    seconds = float(line.split()[1])
    assert seconds > 0 and "not in the run's time" in line
    (conc,) = [ln for ln in out.splitlines() if "maximum concurrency at this workload" in ln]
    mean_tokens = int(conc.split("mean ")[1].split()[0])
    assert 6 <= mean_tokens <= 12  # prompts of 4-8 tokens, 2-4 output tokens
    expected = 64 / math.ceil(mean_tokens / 8)
    assert f"{expected:.2f}x" in conc


def test_ab_contract_ignores_what_start_up_measured(tiny_hf_checkpoint: str, tmp_path) -> None:
    """Two runs of one configuration differ in warm-up seconds (and, on CUDA, in the measured
    memory terms): the A/B contract still holds, with no differing key."""
    from analysis import analyze_trace
    from analysis.compare import compare_reports

    reports = []
    for tag in ("a", "b"):
        path = tmp_path / f"{tag}.pftrace"
        tracer = Tracer(path)
        with LLM(model=tiny_hf_checkpoint, warmup=True, tracer=tracer, **SMALL) as llm:
            llm.generate([[3, 4, 5]] * 3, SamplingParams(temperature=0.0, max_tokens=6))
        tracer.close()
        reports.append(analyze_trace(path, window="all"))
    a, b = reports
    key = ConfigArg.WARMUP_S.value
    # Two measured warm-ups rounded to ms may coincide (0.298 s twice once): make B's differ, so
    # the contract is tested against a start-up measurement that does differ.
    b.frames.config[key] = a.frames.config[key] + 1.0
    assert a.frames.config[key] != b.frames.config[key]
    comparison = compare_reports(a, b)
    assert comparison.contract_ok and comparison.differences == {}


def test_a_failing_warmup_stops_the_device_threads(tiny_hf_checkpoint: str, monkeypatch) -> None:
    """An error inside warm-up leaves LLM construction with the CPU streams' worker threads
    stopped: one still running a torch op at interpreter exit aborted the process (SIGABRT,
    "terminate called without an active exception") instead of printing the error."""
    import threading

    import engine.core

    def failing(*args: object, **kwargs: object) -> None:
        raise IndexError("injected warm-up failure")

    monkeypatch.setattr(engine.core, "warm_up", failing)
    before = {t for t in threading.enumerate() if t.name.startswith("cpu-stream-")}
    with pytest.raises(IndexError, match="injected"):
        LLM(model=tiny_hf_checkpoint, warmup=True, **SMALL)  # type: ignore[arg-type]
    after = {t for t in threading.enumerate() if t.name.startswith("cpu-stream-")}
    assert after - before == set()
