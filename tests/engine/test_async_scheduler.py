"""AsyncScheduler with a batch queue of depth 2: the five books, EOS overrun, max_tokens,
late arrivals, drafts on the device, abort in flight, prefix caching below the frontier."""

from __future__ import annotations

import pytest

from engine.request import RequestStatus
from engine.scheduler.async_scheduler import AsyncScheduler
from engine.scheduler.scheduler import Scheduler
from tests.engine.test_sched_harness import (
    EOS,
    FakeDevice,
    SchedulerParts,
    assert_drained,
    make_request,
    run_engine,
)


def _config(**overrides: object) -> SchedulerParts:
    base: dict[str, object] = dict(
        max_model_len=96,
        num_kv_blocks=64,
        block_size=4,
        max_num_batched_tokens=64,
        debug_invariants=True,
    )
    base.update(overrides)
    return SchedulerParts.of(**base)  # type: ignore[arg-type]


def _books(request) -> tuple[int, int, int, int]:
    return (
        request.num_computed_tokens,
        request.num_output_placeholders,
        request.num_output_tokens,
        request.confirmed_frontier,
    )


def test_placeholders_and_frontier_step_by_step() -> None:
    scheduler = _config().build(AsyncScheduler)
    device = FakeDevice(4, sync=False)
    request = make_request("a", prompt_len=6)
    scheduler.add_request(request)
    out0 = scheduler.schedule()
    run0 = device.execute(out0)
    assert _books(request) == (6, 1, 0, 5)  # (computed, placeholders, outputs, frontier)
    out1 = scheduler.schedule()  # step 1 before output 0: t0 is still on the device
    run1 = device.execute(out1)
    assert out1.num_scheduled_tokens == {"a": 1}
    assert out1.scheduled_cached_reqs.num_computed_tokens == [6]
    assert _books(request) == (7, 2, 0, 5)
    scheduler.update_from_output(out0, run0)
    assert _books(request) == (7, 1, 1, 6)
    assert scheduler.kv_cache_manager.num_cached_blocks("a") == 1  # positions 0..3 only
    out2 = scheduler.schedule()
    run2 = device.execute(out2)
    scheduler.update_from_output(out1, run1)
    assert _books(request) == (8, 1, 2, 7)
    scheduler.update_from_output(out2, run2)
    assert _books(request) == (8, 0, 3, 8)


def test_spec_placeholders_and_rejected_drafts_roll_back() -> None:
    scheduler = _config(num_spec_tokens=2).build(AsyncScheduler)
    device = FakeDevice(4, num_spec_tokens=2, sync=False)
    request = make_request("a", prompt_len=6, max_tokens=40)
    scheduler.add_request(request)
    out0 = scheduler.schedule()
    run0 = device.execute(out0)
    assert request.spec_token_ids == [-1, -1] and _books(request) == (6, 1, 0, 5)
    out1 = scheduler.schedule()
    run1 = device.execute(out1)
    assert out1.scheduled_spec_decode_tokens == {"a": [-1, -1]}
    assert out1.num_scheduled_tokens == {"a": 3} and _books(request) == (9, 4, 0, 5)
    scheduler.update_from_output(out0, run0)
    assert _books(request) == (9, 3, 1, 6)
    num_rejected_total = 0
    pending = (out1, run1)
    for _ in range(12):  # steady state: schedule N+1, then settle N
        nxt = scheduler.schedule()
        nxt_run = device.execute(nxt)
        computed_before = request.num_computed_tokens
        (output,) = scheduler.update_from_output(*pending)
        num_rejected = output.num_draft_tokens - output.num_accepted
        num_rejected_total += num_rejected
        assert request.num_computed_tokens == computed_before - num_rejected
        assert request.num_output_placeholders == 3  # exactly the step still in flight
        assert request.confirmed_frontier == request.num_tokens - 1
        pending = (nxt, nxt_run)
    assert num_rejected_total > 0  # the drafter is wrong about 1/3 of the time


@pytest.mark.parametrize("num_spec_tokens", [0, 2])
def test_eos_overrun_is_computed_but_never_returned(num_spec_tokens: int) -> None:
    results = {}
    for name, cls, depth in (("sync", Scheduler, 1), ("async", AsyncScheduler, 2)):
        scheduler = _config(num_spec_tokens=num_spec_tokens).build(cls)
        device = FakeDevice(4, num_spec_tokens, eos_at={"a": 5}, sync=depth == 1)
        result = run_engine(scheduler, device, {0: [make_request("a", max_tokens=30)]}, depth=depth)
        assert_drained(scheduler)
        results[name] = (result, device)
    sync, async_ = results["sync"][0], results["async"][0]
    assert async_.tokens == sync.tokens and len(sync.tokens["a"]) == 6
    assert sync.tokens["a"][-1] == EOS and async_.finish_reasons["a"] == "stop"
    # The async device ran one step past EOS and sampled a token nobody saw.
    assert (
        results["async"][1].steps_per_request["a"] == results["sync"][1].steps_per_request["a"] + 1
    )
    assert results["async"][1].num_sampled["a"] > 6


@pytest.mark.parametrize("num_spec_tokens", [0, 1, 3])
@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_never_adds_a_step(num_spec_tokens: int, max_tokens: int) -> None:
    scheduler = _config(num_spec_tokens=num_spec_tokens).build(AsyncScheduler)
    device = FakeDevice(4, num_spec_tokens, sync=False)
    request = make_request("a", max_tokens=max_tokens)
    result = run_engine(scheduler, device, {0: [request]}, depth=2)
    assert len(result.tokens["a"]) == max_tokens and result.finish_reasons["a"] == "length"
    assert device.num_sampled["a"] == max_tokens  # not one token sampled beyond max_tokens
    if num_spec_tokens == 0:
        assert device.steps_per_request["a"] == max_tokens
    assert_drained(scheduler)


def test_max_model_len_counts_placeholders() -> None:
    scheduler = _config(max_model_len=12, num_kv_blocks=4, num_spec_tokens=2).build(AsyncScheduler)
    device = FakeDevice(4, 2, sync=False)
    result = run_engine(scheduler, device, {0: [make_request("a", 8, max_tokens=50)]}, depth=2)
    assert len(result.tokens["a"]) == 4 and device.num_sampled["a"] == 4
    assert_drained(scheduler)


def test_late_arrival_joins_at_n_plus_2() -> None:
    scheduler = _config().build(AsyncScheduler)
    device = FakeDevice(4, sync=False)
    scheduler.add_request(make_request("a"))
    out_n = scheduler.schedule()
    run_n = device.execute(out_n)
    scheduler.add_request(make_request("early"))  # before N+1 is scheduled: joins N+1
    out_n1 = scheduler.schedule()
    run_n1 = device.execute(out_n1)
    scheduler.add_request(make_request("late"))  # after N+1 was scheduled
    scheduler.update_from_output(out_n, run_n)
    out_n2 = scheduler.schedule()
    assert [r.req_id for r in out_n1.scheduled_new_reqs] == ["early"]
    assert [r.req_id for r in out_n2.scheduled_new_reqs] == ["late"]
    assert "late" not in out_n1.num_scheduled_tokens
    scheduler.update_from_output(out_n1, run_n1)
    scheduler.update_from_output(out_n2, device.execute(out_n2))


def test_abort_in_flight_drops_tokens_and_frees_blocks_after_the_last_step() -> None:
    scheduler = _config().build(AsyncScheduler)
    device = FakeDevice(4, sync=False)
    request = make_request("a", prompt_len=10)
    scheduler.add_request(request)
    out_n = scheduler.schedule()
    run_n = device.execute(out_n)
    out_n1 = scheduler.schedule()
    run_n1 = device.execute(out_n1)
    final = scheduler.abort_request("a")
    assert final is not None and final.finish_reason == "abort"
    assert not scheduler.has_unfinished_requests()
    held = scheduler.kv_cache_manager.block_ids("a")
    assert held  # two steps still reference the blocks
    assert scheduler.update_from_output(out_n, run_n) == []
    assert scheduler.kv_cache_manager.block_ids("a") == held
    assert scheduler.update_from_output(out_n1, run_n1) == []
    assert request.output_token_ids == [] and request.status is RequestStatus.FINISHED_ABORTED
    assert_drained(scheduler)
    scheduler.add_request(make_request("b"))
    assert scheduler.schedule().finished_req_ids == {"a"}


def test_nothing_cached_beyond_the_confirmed_frontier() -> None:
    scheduler = _config(num_spec_tokens=3).build(AsyncScheduler)
    device = FakeDevice(4, num_spec_tokens=3, sync=False)
    owner = make_request("a", prompt_len=9, max_tokens=40)
    checks = {"n": 0}

    def probe(iteration: int) -> None:
        if owner.status is not RequestStatus.RUNNING:
            return
        num_cached = scheduler.kv_cache_manager.num_cached_blocks("a") * 4
        assert num_cached <= owner.confirmed_frontier <= owner.num_computed_tokens
        checks["n"] += 1
        if iteration == 12:  # share everything committed so far, plus a new tail
            scheduler.add_request(
                make_request("b", owner.num_tokens + 5, shared_prefix=owner.all_token_ids)
            )

    result = run_engine(scheduler, device, {0: [owner]}, depth=2, on_iteration=probe)
    assert checks["n"] > 10 and len(result.tokens["b"]) == 8
    hit = scheduler.get_stats().prefix_cache_hit_tokens
    assert 0 < hit < len(owner.all_token_ids)  # the device verified every hit block's KV
    assert_drained(scheduler)


def test_preempted_in_flight_request_keeps_its_blocks_until_the_step_settles() -> None:
    config = _config(num_kv_blocks=6, max_model_len=24)
    make = lambda: [make_request(f"r{i}", 6, max_tokens=16, arrival_time=i) for i in range(3)]  # noqa: E731
    reference = run_engine(config.build(), FakeDevice(4), {0: make()})
    scheduler = config.build(AsyncScheduler)
    result = run_engine(scheduler, FakeDevice(4, sync=False), {0: make()}, depth=2)
    assert scheduler.get_stats().num_preemptions > 0
    assert result.tokens == reference.tokens
    assert_drained(scheduler)


def test_async_refuses_cpu_drafts_and_a_third_step_in_flight() -> None:
    scheduler = _config(num_spec_tokens=1).build(AsyncScheduler)
    scheduler.add_request(make_request("a"))
    with pytest.raises(RuntimeError, match="on the device"):
        scheduler.update_draft_token_ids({"a": [1]})
    scheduler.schedule()
    scheduler.schedule()
    with pytest.raises(RuntimeError, match="already in flight"):
        scheduler.schedule()


@pytest.mark.parametrize(
    ("sampled", "params", "prior"),
    [
        ([10, 11, 12, 13], {}, 0),  # nothing can stop it: committed at once
        ([10, EOS, 12, 13], {}, 0),  # EOS among the accepted drafts
        ([10, EOS, 12], {"ignore_eos": True}, 0),
        ([10, 11, 12], {"stop_token_ids": (11,)}, 0),
        ([10, EOS, 12], {"min_tokens": 3}, 0),  # EOS suppressed below min_tokens
        ([10, 11, 12, 13], {}, 5),  # the length cap (max_tokens 8) inside the verify
        ([10, 11, 12], {}, 5),  # reaching it with the last token
        ([10, 11], {}, 5),
    ],
)
def test_verify_commit_matches_token_by_token_stop_checks(
    sampled: list[int], params: dict, prior: int
) -> None:
    """A verify's tokens committed at once (none can end the request) or one by one: the same
    tokens, status and stop reason as checking after every token (stop_conditions.check_stop)."""
    from engine.scheduler.stop_conditions import check_stop

    scheduler = _config(num_spec_tokens=3).build(AsyncScheduler)
    got, ref = (make_request("a", max_tokens=8, **params) for _ in range(2))
    for r in (got, ref):
        r.output_token_ids.extend(range(20, 20 + prior))
    committed = scheduler._append_tokens(got, list(sampled))
    want = []
    for t in sampled:
        ref.output_token_ids.append(t)
        want.append(t)
        if check_stop(ref, scheduler.max_model_len):
            break
    assert committed == want and got.output_token_ids == ref.output_token_ids
    assert (got.status, got.stop_reason) == (ref.status, ref.stop_reason)
