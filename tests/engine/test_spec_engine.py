"""Speculative decoding end to end on the CPU device (fp32): greedy output is exactly greedy
without speculation for every proposer, async on and off; accepted counts and traces."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.workload import WorkloadRequest

# Repetitive prompts give the n-gram proposer something to find; one prompt spans several
# KV blocks and chunks so chunked prefill, block growth and lookahead blocks are exercised.
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7],
    [11, 12, 13],
    [20, 21, 22, 23, 20, 21],
    [40 + (i * 7) % 50 for i in range(37)],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
ENGINE = dict(num_kv_blocks=64, block_size=8, max_num_seqs=3, max_num_batched_tokens=32)


def _run(model: str, **kwargs) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
    """Outputs by id and (drafts, accepted) per update; the engine must end idle."""
    llm = LLM(model=model, debug_invariants=True, **ENGINE, **kwargs)
    counts: list[tuple[int, int]] = []
    update = llm.engine._update

    def counting_update(so, out):
        outputs = update(so, out)
        counts.append(
            (sum(o.num_draft_tokens for o in outputs), sum(o.num_accepted for o in outputs))
        )
        return outputs

    llm.engine._update = counting_update
    workload = [
        WorkloadRequest(f"r{i}", None, tuple(p), GREEDY, arrival_time_s=0.0)
        for i, p in enumerate(PROMPTS)
    ]
    outs = llm.run_workload(workload)
    llm.engine.drain()
    llm.engine.check_idle()
    llm.close()
    return {o.id: o.output_token_ids for o in outs}, counts


@pytest.fixture(scope="module")
def baseline(checkpoint) -> dict[str, list[int]]:
    return _run(checkpoint, async_scheduling=False)[0]


@pytest.mark.parametrize("async_on", [False, True])
@pytest.mark.parametrize("method", ["ngram", "draft", "eagle", "mtp"])
def test_greedy_spec_equals_greedy(checkpoint, models, baseline, method, async_on):
    outs, counts = _run(
        checkpoint,
        async_scheduling=async_on,
        spec_method=method,
        spec_model=models[method],
        num_spec_tokens=3,
    )
    assert outs == baseline
    assert sum(d for d, _ in counts) > 0  # drafts were really verified
    if method == "ngram":
        assert sum(a for _, a in counts) > 0  # and the repetitive outputs accepted some


@pytest.mark.parametrize("async_on", [False, True])
def test_target_as_its_own_draft_accepts_everything(checkpoint, baseline, async_on):
    """A draft model equal to the target proposes exactly the greedy continuation, so every
    draft must be accepted: this checks the draft's KV, chain positions and lookahead blocks."""
    outs, counts = _run(
        checkpoint,
        async_scheduling=async_on,
        spec_method="draft",
        spec_model=checkpoint,
        num_spec_tokens=4,
    )
    assert outs == baseline
    drafts, accepted = sum(d for d, _ in counts), sum(a for _, a in counts)
    assert drafts > 0 and accepted == drafts


def test_sync_accepted_waits_are_traced(checkpoint, tmp_path):
    from analysis import load_trace
    from instrument.tracer import Tracer

    path = tmp_path / "spec.pftrace"
    with Tracer(path) as tracer:
        llm = LLM(
            model=checkpoint,
            tracer=tracer,
            async_scheduling=True,
            spec_method="ngram",
            num_spec_tokens=3,
            spec_sync_accepted=True,
            **ENGINE,
        )
        outs = llm.generate(PROMPTS[:2], GREEDY)
        llm.engine.check_idle()
        llm.close()
    assert all(len(o.output_token_ids) == GREEDY.max_tokens for o in outs)
    slices = load_trace(path).slices
    waits = slices[slices["name"] == "wait_output"]
    assert len(waits) > 0 and set(waits["kind"]) == {"accepted_count"}
    names = set(slices["name"])
    assert {"verify", "draft", "update_from_output"} <= names


def test_default_async_spec_never_waits_for_accepted_counts(checkpoint, tmp_path):
    from analysis import load_trace
    from instrument.tracer import Tracer

    path = tmp_path / "spec.pftrace"
    with Tracer(path) as tracer:
        llm = LLM(
            model=checkpoint,
            tracer=tracer,
            async_scheduling=True,
            spec_method="ngram",
            num_spec_tokens=3,
            **ENGINE,
        )
        llm.generate(PROMPTS[:2], GREEDY)
        llm.close()
    frames = load_trace(path)
    waits = frames.slices[frames.slices["name"] == "wait_output"]
    assert set(waits["kind"]) == {"sampled"}
    accepted = frames.counters[frames.counters["name"] == "accepted_tokens"]
    assert len(accepted) > 0 and accepted["value"].max() > 0


SEEDED = [
    SamplingParams(temperature=0.9, seed=11 + i, max_tokens=16, ignore_eos=True) for i in range(4)
]


@pytest.mark.parametrize("async_on", [False, True])
@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_seeded_sampling_with_spec_is_batch_invariant(checkpoint, models, method, async_on):
    """Each seeded request alone and in a batch gives the same tokens. (Async on vs off may
    schedule fewer drafts near max_tokens, where placeholders are counted optimistically; the
    tokens there then follow the same law through a different draft, not the same values.)"""
    kwargs = dict(
        async_scheduling=async_on,
        spec_method=method,
        spec_model=models[method],
        num_spec_tokens=3,
        debug_invariants=True,
        **ENGINE,
    )
    llm = LLM(model=checkpoint, **kwargs)
    together = [o.output_token_ids for o in llm.generate(PROMPTS, SEEDED)]
    llm.engine.check_idle()
    alone = [
        llm.generate([p], [s])[0].output_token_ids for p, s in zip(PROMPTS, SEEDED, strict=True)
    ]
    llm.close()
    assert together == alone
    assert all(len(o) == 16 for o in together)


def test_penalties_count_drafts_inside_the_step(checkpoint):
    """Greedy with a repetition penalty: row l of a verify must see drafts d_1..d_l as already
    generated, or the penalised argmax (and so the output) would differ from plain decoding."""
    params = SamplingParams(
        temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
        frequency_penalty=0.4,
    )  # fmt: skip
    results = []
    draft = {"spec_method": "draft", "spec_model": checkpoint, "num_spec_tokens": 4}
    for spec in ({}, {"spec_method": "ngram", "num_spec_tokens": 3}, draft):
        llm = LLM(model=checkpoint, async_scheduling=True, **ENGINE, **spec)
        outs = llm.generate(PROMPTS, params)
        llm.close()
        results.append([o.output_token_ids for o in outs])
    assert results[0] == results[1] == results[2]
