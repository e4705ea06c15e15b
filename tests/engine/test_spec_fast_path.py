"""The columnar plan of steady speculative decodes (``Scheduler._plan_spec_decodes``).

Random speculative workloads (random k, max_tokens and max_model_len close to the prompt so
drafts get trimmed, a long-prefill threshold below 1 + k, small token budgets, small KV pools so
preemption happens, shared prefixes so the prefix cache hits, CPU drafts of random length in the
synchronous loop) run step by step with the fast path on and forced off (the general per-request
path plans every speculative decode). Every ``SchedulerOutput`` and every step's outputs must be
identical, and the committed tokens must equal those of the run without speculation (greedy: the
fake device's target model is deterministic in the history).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler.async_scheduler import AsyncScheduler
from engine.scheduler.outputs import SchedulerOutput
from engine.scheduler.scheduler import Scheduler
from tests.engine.test_sched_harness import EOS, FakeDevice, SchedulerParts, drive, prompt_tokens

BLOCK_SIZE = 4


def _config(seed: int) -> dict[str, Any]:
    rng = random.Random(f"config{seed}")
    k = rng.randint(1, 4)
    max_model_len = rng.choice((24, 32, 40))
    return {
        "k": k,
        "max_model_len": max_model_len,
        # tight: preemption happens (a pool must hold one request of max_model_len)
        "num_kv_blocks": max_model_len // BLOCK_SIZE + rng.randint(2, 8),
        "max_num_batched_tokens": rng.randint(1 + k, 20),
        "max_num_seqs": rng.randint(3, 8),
        "long_prefill_token_threshold": rng.choice((0, 0, 0, 2, 3)),
        "enable_prefix_caching": rng.random() < 0.8,
        "cpu_drafts": rng.random() < 0.5,  # sync loop only: drafts of random length from the CPU
    }


def _workload(seed: int, max_model_len: int) -> tuple[dict[int, list[Request]], dict[str, int]]:
    """Fresh requests (by arrival iteration) and their EOS positions."""
    rng = random.Random(f"workload{seed}")
    shared = prompt_tokens(f"shared{seed}", 8)
    arrivals: dict[int, list[Request]] = {}
    eos_at: dict[str, int] = {}
    for index in range(rng.randint(6, 14)):
        req_id = f"r{index}"
        prompt_len = rng.randint(2, max_model_len - 4)
        prompt = prompt_tokens(f"{seed}/{req_id}", prompt_len, shared[: rng.choice((0, 4, 8))])
        if rng.random() < 0.3:
            eos_at[req_id] = rng.randint(0, 10)
        params = SamplingParams(
            temperature=0.0,
            max_tokens=rng.randint(1, 14),
            ignore_eos=rng.random() < 0.2,
            stop_token_ids=(rng.randrange(100),) if rng.random() < 0.2 else (),
        )
        request = Request(req_id, prompt, params, arrival_time=float(index), eos_token_id=EOS)
        arrivals.setdefault(rng.randint(0, 10), []).append(request)
    return arrivals, eos_at


def _run(seed: int, depth: int, fast: bool, spec: bool = True) -> tuple[list, dict, Scheduler]:
    """Steps the scheduler; returns each step's (SchedulerOutput, outputs), per request its
    (tokens, finish reason), and the scheduler."""
    config = _config(seed)
    k = config["k"] if spec else 0
    arrivals, eos_at = _workload(seed, config["max_model_len"])
    parts = SchedulerParts.of(
        num_spec_tokens=k,
        max_model_len=config["max_model_len"],
        num_kv_blocks=config["num_kv_blocks"],
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=config["max_num_batched_tokens"],
        max_num_seqs=config["max_num_seqs"],
        long_prefill_token_threshold=config["long_prefill_token_threshold"],
        enable_prefix_caching=config["enable_prefix_caching"],
        debug_invariants=True,
    )
    scheduler = parts.build(Scheduler if depth == 1 else AsyncScheduler)
    scheduler.spec_fast_path = fast
    device = FakeDevice(BLOCK_SIZE, num_spec_tokens=k, eos_at=eos_at, sync=depth == 1)
    steps: list[tuple[SchedulerOutput, list]] = []
    results: dict[str, list] = {}
    for out, _, update in drive(scheduler, device, arrivals, depth, 3000):
        outputs = list(update)
        steps.append((out, outputs))
        for o in outputs:
            entry = results.setdefault(o.req_id, [[], None])
            entry[0].extend(o.new_token_ids)
            if o.finished:
                entry[1] = o.finish_reason
        if depth == 1 and k and config["cpu_drafts"]:
            # A CPU proposer: the device's drafts, cut to a length of 0..k (deterministic in
            # the request and the step, so both runs get the same ones).
            drafts = {}
            for req_id in out.num_scheduled_tokens:
                row = device.rows.get(req_id)
                if row is not None:
                    cut = random.Random(f"{seed}/{req_id}/{out.step}").randint(0, k)
                    drafts[req_id] = row.drafts[:cut]
            scheduler.update_draft_token_ids(drafts)
    scheduler.check_invariants()
    assert scheduler.num_requests == 0 and scheduler.get_stats().output_placeholders == 0
    return steps, {req_id: tuple(v) for req_id, v in results.items()}, scheduler


_SEEDS = range(12)
_COVERAGE: dict[tuple[int, int], tuple[int, int, int, int]] = {}


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("seed", _SEEDS)
def test_spec_fast_path_matches_the_general_path(
    seed: int, depth: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    num_fast_runs = 0
    plan_spec_decodes = Scheduler._plan_spec_decodes

    def counting(self: Scheduler, plan: Any, running: Any, *args: Any) -> int:
        nonlocal num_fast_runs
        index = args[-2]
        end = plan_spec_decodes(self, plan, running, *args)
        num_fast_runs += end > index
        return end

    monkeypatch.setattr(Scheduler, "_plan_spec_decodes", counting)
    steps, results, scheduler = _run(seed, depth, fast=True)
    fast_runs, num_fast_runs = num_fast_runs, 0
    reference_steps, reference_results, reference = _run(seed, depth, fast=False)
    assert num_fast_runs == 0, "the general path planned a run of speculative decodes"
    assert len(steps) == len(reference_steps)
    for (out, outputs), (ref_out, ref_outputs) in zip(steps, reference_steps, strict=True):
        assert out == ref_out, f"step {out.step}"
        assert outputs == ref_outputs, f"step {out.step}"
    assert results == reference_results
    # Greedy: speculation changes nothing in the tokens (nor in why each request finished).
    _, plain_results, _ = _run(seed, depth, fast=True, spec=False)
    assert results == plain_results
    k = _config(seed)["k"]
    trimmed = sum(
        1
        for out, _ in steps
        for req_id, drafts in out.scheduled_spec_decode_tokens.items()
        if len(drafts) < k
    )
    stats = scheduler.get_stats()
    _COVERAGE[seed, depth] = (
        fast_runs,
        trimmed,
        stats.num_preemptions,
        stats.prefix_cache_hit_tokens,
    )
    assert reference.get_stats() == stats


def test_the_spec_workloads_cover_the_hard_cases() -> None:
    """The runs above take the fast path, trim drafts, preempt and hit the prefix cache."""
    for seed in _SEEDS:
        for depth in (1, 2):
            if (seed, depth) not in _COVERAGE:
                with pytest.MonkeyPatch.context() as monkeypatch:
                    test_spec_fast_path_matches_the_general_path(seed, depth, monkeypatch)
    runs = list(_COVERAGE.values())
    print(runs)
    assert all(fast_runs > 0 for fast_runs, _, _, _ in runs)
    assert sum(trimmed for _, trimmed, _, _ in runs) > 0
    assert sum(preempted for _, _, preempted, _ in runs) > 0
    assert sum(hit for _, _, _, hit in runs) > 0
