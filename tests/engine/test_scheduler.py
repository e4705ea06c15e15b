"""Synchronous Scheduler: budget, chunking, max_num_seqs, prefix caching, preemption, abort,
stop conditions. Driven by the deterministic fake device of test_sched_harness."""

from __future__ import annotations

import pytest

from engine.request import RequestStatus
from engine.scheduler.outputs import ModelRunnerOutput
from engine.scheduler.request_output import RequestOutput
from tests.engine.test_sched_harness import (
    EOS,
    FakeDevice,
    SchedulerParts,
    make_request,
    prompt_tokens,
    run_engine,
)


def _config(**overrides: object) -> SchedulerParts:
    base: dict[str, object] = dict(
        max_model_len=64,
        num_kv_blocks=64,
        block_size=4,
        max_num_batched_tokens=64,
        debug_invariants=True,
    )
    base.update(overrides)
    return SchedulerParts.of(**base)  # type: ignore[arg-type]


def _steps(config: SchedulerParts, prompt_lens: list[int], num_steps: int) -> list[dict[str, int]]:
    scheduler = config.build()
    device = FakeDevice(config.cache.block_size)
    for index, prompt_len in enumerate(prompt_lens):
        scheduler.add_request(make_request("abcdefgh"[index], prompt_len, max_tokens=20))
    plans = []
    for _ in range(num_steps):
        out = scheduler.schedule()
        plans.append(dict(out.num_scheduled_tokens))
        if out.total_num_scheduled_tokens:
            scheduler.update_from_output(out, device.execute(out))
    return plans


@pytest.mark.parametrize(
    ("overrides", "prompt_lens", "expected"),
    [
        # Running first, then waiting ones chunked into what is left of the budget.
        (
            dict(max_num_batched_tokens=10),
            [8, 8],
            [{"a": 8, "b": 2}, {"a": 1, "b": 6}, {"a": 1, "b": 1}],
        ),
        # Without chunked prefill a prompt waits for a step with room for all of it.
        (
            dict(
                max_num_batched_tokens=10,
                max_model_len=10,
                num_kv_blocks=8,
                enable_chunked_prefill=False,
            ),
            [8, 8],
            [{"a": 8}, {"a": 1, "b": 8}, {"b": 1}],  # "a" hit max_model_len = 10
        ),
        (dict(max_num_seqs=1), [8, 8], [{"a": 8}, {"a": 1}, {"a": 1}]),
        (dict(max_num_seqs=2), [3, 3, 3], [{"a": 3, "b": 3}, {"a": 1, "b": 1}]),
        # The long-prefill cap chunks every prompt, running ones included.
        (
            dict(long_prefill_token_threshold=3),
            [8, 5],
            [{"a": 3, "b": 3}, {"a": 3, "b": 2}, {"a": 2, "b": 1}],
        ),
        (
            dict(max_num_batched_tokens=4),
            [3, 3],
            [{"a": 3, "b": 1}, {"a": 1, "b": 2}, {"a": 1, "b": 1}],
        ),
    ],
)
def test_budget_chunking_and_max_num_seqs(
    overrides: dict[str, object], prompt_lens: list[int], expected: list[dict[str, int]]
) -> None:
    assert _steps(_config(**overrides), prompt_lens, len(expected)) == expected


def test_chunk_that_misses_the_prompt_end_samples_nothing() -> None:
    scheduler = _config(max_num_batched_tokens=5).build()
    device = FakeDevice(4)
    scheduler.add_request(make_request("a", prompt_len=12))
    for expected_tokens in (0, 0, 1):
        out = scheduler.schedule()
        outputs = scheduler.update_from_output(out, device.execute(out))
        assert sum(len(o.new_token_ids) for o in outputs) == expected_tokens


def test_prefix_cache_hit_on_shared_prefix() -> None:
    config = _config()
    shared = prompt_tokens("shared", 13)
    scheduler = config.build()
    device = FakeDevice(config.cache.block_size)
    first = make_request("a", prompt_len=16, max_tokens=3, shared_prefix=shared)
    second = make_request("b", prompt_len=20, max_tokens=3, shared_prefix=shared)
    # The device checks the KV every hit points at is exactly the request's own prefix.
    result = run_engine(scheduler, device, {0: [first], 5: [second]})
    assert second.num_cached_tokens == 12  # three full shared blocks of 4
    assert first.num_cached_tokens == 0
    assert result.outputs[-1].num_cached_tokens == 12
    assert scheduler.get_stats().prefix_cache_hit_tokens == 12


def test_prefix_cache_hit_covers_committed_outputs_of_a_finished_request() -> None:
    config = _config()
    scheduler = config.build()
    device = FakeDevice(config.cache.block_size)
    first = make_request("a", prompt_len=6, max_tokens=7)
    run_engine(scheduler, device, {0: [first]})
    # 6 prompt + 7 outputs = 13 tokens; the last output's KV was never computed.
    follow_up = make_request("b", prompt_len=20, shared_prefix=first.all_token_ids)
    run_engine(scheduler, device, {0: [follow_up]})
    assert follow_up.num_cached_tokens == 12


def test_preemption_resumes_and_continues_exactly() -> None:
    requests = lambda: [make_request(f"r{i}", prompt_len=6 + i, max_tokens=20) for i in range(4)]  # noqa: E731
    roomy = _config(num_kv_blocks=64).build()
    reference = run_engine(roomy, FakeDevice(4), {0: requests()})
    tight = _config(num_kv_blocks=16, max_model_len=64).build()
    result = run_engine(tight, FakeDevice(4), {0: requests()})
    assert tight.get_stats().num_preemptions > 0
    assert result.tokens == reference.tokens
    assert all(len(tokens) == 20 for tokens in result.tokens.values())
    assert tight.kv_cache_manager.num_free_blocks == 16


def test_preemption_picks_the_most_recent_arrival() -> None:
    scheduler = _config(num_kv_blocks=4, max_model_len=16).build()
    device = FakeDevice(4)
    old = make_request("old", prompt_len=7, max_tokens=8, arrival_time=1.0)
    new = make_request("new", prompt_len=7, max_tokens=8, arrival_time=2.0)
    scheduler.add_request(old)
    scheduler.add_request(new)
    while scheduler.has_unfinished_requests():
        was_running = new.status is RequestStatus.RUNNING
        out = scheduler.schedule()
        if was_running and new.status is RequestStatus.PREEMPTED:
            assert "new" in out.finished_req_ids  # the runner drops its row before this step
        scheduler.update_from_output(out, device.execute(out))
    assert old.num_preemptions == 0 and new.num_preemptions >= 1


def test_abort_waiting_and_running() -> None:
    scheduler = _config(max_num_seqs=1).build()
    device = FakeDevice(4)
    running, waiting = make_request("run"), make_request("wait")
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    out = scheduler.schedule()
    scheduler.update_from_output(out, device.execute(out))
    final = scheduler.abort_request("wait")
    assert final is not None and final.finish_reason == "abort" and final.finished
    assert scheduler.abort_request("wait") is None
    scheduler.abort_request("run")
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == 64
    follower = make_request("next")
    scheduler.add_request(follower)
    out = scheduler.schedule()
    assert out.finished_req_ids == {"run"}  # the runner never held "wait"
    assert [n.req_id for n in out.scheduled_new_reqs] == ["next"]


@pytest.mark.parametrize(
    ("params", "eos_at", "expected_len", "reason", "stop_reason"),
    [
        (dict(), 3, 4, "stop", None),
        (dict(ignore_eos=True), 3, 8, "length", None),
        (dict(min_tokens=6), 3, 8, "length", None),  # EOS at index 3 suppressed, no other EOS
        (dict(), None, 8, "length", None),
    ],
)
def test_stop_conditions(
    params: dict[str, object],
    eos_at: int | None,
    expected_len: int,
    reason: str,
    stop_reason: object,
) -> None:
    scheduler = _config().build()
    device = FakeDevice(4, eos_at={"a": eos_at} if eos_at is not None else {})
    request = make_request("a", max_tokens=8, **params)
    result = run_engine(scheduler, device, {0: [request]})
    assert len(result.tokens["a"]) == expected_len
    assert result.finish_reasons["a"] == reason
    assert request.stop_reason == stop_reason
    if reason == "stop":
        assert result.tokens["a"][-1] == EOS


def test_stop_token_ids_and_max_model_len() -> None:
    config = _config(max_model_len=12, num_kv_blocks=8)
    probe = run_engine(config.build(), FakeDevice(4), {0: [make_request("a", prompt_len=8)]})
    assert probe.finish_reasons["a"] == "length" and len(probe.tokens["a"]) == 4  # 8 + 4 = 12
    third = probe.tokens["a"][2]
    request = make_request("a", prompt_len=8, stop_token_ids=[third])
    result = run_engine(config.build(), FakeDevice(4), {0: [request]})
    assert result.tokens["a"] == probe.tokens["a"][:3]
    assert result.finish_reasons["a"] == "stop" and request.stop_reason == third


def test_stop_string_checker_hook() -> None:
    def checker(request):  # stands in for the detokenizer: "stop" after the 2nd output token
        return "STOP" if request.num_output_tokens == 2 else None

    scheduler = _config().build(stop_string_checker=checker)
    request = make_request("a", stop=["STOP"])
    result = run_engine(scheduler, FakeDevice(4), {0: [request]})
    assert len(result.tokens["a"]) == 2 and request.stop_reason == "STOP"


def test_sync_scheduler_rejects_overlap_and_validates_requests() -> None:
    scheduler = _config().build()
    scheduler.add_request(make_request("a"))
    with pytest.raises(ValueError, match="already exists"):
        scheduler.add_request(make_request("a"))
    with pytest.raises(ValueError, match="no room for output"):
        scheduler.add_request(make_request("long", prompt_len=64))
    scheduler.schedule()
    with pytest.raises(RuntimeError, match="synchronous"):
        scheduler.schedule()


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(num_spec_tokens=-1), "num_spec_tokens"),
        (dict(max_num_batched_tokens=2, num_spec_tokens=2), "one decode step"),
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=32), "chunked prefill"),
        (dict(num_kv_blocks=8), "cannot hold one request"),
        (dict(long_prefill_token_threshold=-1), "long_prefill"),
        (
            dict(
                long_prefill_token_threshold=4,
                enable_chunked_prefill=False,
                max_num_batched_tokens=64,
            ),
            "needs chunked prefill",
        ),
    ],
)
def test_config_validation(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _config(**overrides).build()


def test_finish_request_from_outside_is_stop() -> None:
    scheduler = _config().build()
    scheduler.add_request(make_request("a"))
    final = scheduler.finish_request("a", RequestStatus.FINISHED_STOPPED)
    assert final is not None and final.finish_reason == "stop"
    with pytest.raises(ValueError, match="not a finished status"):
        scheduler.finish_request("a", RequestStatus.RUNNING)


def test_cpu_drafts_replace_device_placeholders_in_sync_mode() -> None:
    scheduler = _config(num_spec_tokens=2).build()
    device = FakeDevice(4, num_spec_tokens=2)
    scheduler.add_request(make_request("a"))
    out = scheduler.schedule()
    scheduler.update_from_output(out, device.execute(out))
    assert scheduler.get_request("a").spec_token_ids == [-1, -1]  # drafts on the device
    scheduler.update_draft_token_ids({"a": [5, 6, 7], "gone": [1]})  # a CPU proposer's drafts
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [5, 6]} and out.num_scheduled_tokens == {
        "a": 3
    }


@pytest.mark.parametrize("num_spec_tokens", [0, 2])
def test_runner_rows_are_matched_by_id_not_position(num_spec_tokens: int) -> None:
    """A runner output listing the step's requests in another order commits the same."""

    def run(reorder: bool) -> list[RequestOutput]:
        scheduler = _config(num_spec_tokens=num_spec_tokens).build()
        device = FakeDevice(4, num_spec_tokens=num_spec_tokens)
        for req_id, prompt_len in zip("abc", [5, 3, 7], strict=True):
            scheduler.add_request(make_request(req_id, prompt_len, max_tokens=6))
        outputs: list[RequestOutput] = []
        while scheduler.has_unfinished_requests():
            out = scheduler.schedule()
            runner_out = device.execute(out)
            if reorder:
                runner_out = ModelRunnerOutput(
                    runner_out.step,
                    runner_out.req_ids[::-1],
                    runner_out.sampled_token_ids[::-1],
                    runner_out.num_accepted[::-1],
                )
            outputs += scheduler.update_from_output(out, runner_out)
        return outputs

    in_order = run(reorder=False)
    assert run(reorder=True) == in_order
    assert sum(len(o.new_token_ids) for o in in_order) == 18


def test_counter_values_are_get_stats_in_counter_order() -> None:
    """The engine's per-step counters (Scheduler.counter_values, no SchedulerStats built) equal
    get_stats()'s fields named by instrument.schema.Counter, at every iteration of a run with
    preemptions."""
    from instrument.schema import Counter

    requests = [make_request(f"r{i}", prompt_len=6 + i, max_tokens=20) for i in range(4)]
    tight = _config(num_kv_blocks=16, max_model_len=64).build()
    seen: list[tuple[object, ...]] = []

    def check(_: int) -> None:
        stats = tight.get_stats()
        expected = tuple(getattr(stats, c.value) for c in Counter)
        assert tight.counter_values() == expected
        seen.append(expected)

    run_engine(tight, FakeDevice(4), {0: requests}, on_iteration=check)
    assert tight.get_stats().num_preemptions > 0
    assert len(set(seen)) > 10  # the values moved
