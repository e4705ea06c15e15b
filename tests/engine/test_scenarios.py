"""The randomized scenario suite in CI: a fixed range of seeds, each a real engine run on a tiny
model checked after every step and against a reference (tests/engine/fuzz/). A failing seed's
message starts with the command that replays it; ``scripts/fuzz.sh N`` runs more seeds.

Mutation tests break the engine on purpose (a lost token, a leaked block, a placeholder never
settled, a token sent after the final output) and require the suite to catch each one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from engine.scheduler.kv_cache_manager import KVCacheManager
from engine.scheduler.request_output import RequestOutput
from engine.scheduler.scheduler import Scheduler
from tests.engine.fuzz.check import Coverage, check_seed
from tests.engine.fuzz.runner import ScenarioFailure, run_scenario
from tests.engine.fuzz.scenario import make_scenario
from tests.engine.fuzz.world import HAS_XGRAMMAR, world

NUM_CI_SEEDS = 500
NUM_THREADED_SEEDS = 12


@pytest.fixture(autouse=True)
def _quiet_refused_grammars() -> Iterator[None]:
    logger = logging.getLogger("stepscope")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def _run_seeds(seeds: range, threaded: bool = False) -> Coverage:
    coverage = Coverage()
    failures = []
    for seed in seeds:
        try:
            check_seed(seed, coverage, threaded)
        except ScenarioFailure as err:
            failures.append(str(err))
    assert not failures, f"{len(failures)} seeds failed:\n" + "\n".join(failures[:5])
    return coverage


def test_scenarios() -> None:
    coverage = _run_seeds(range(NUM_CI_SEEDS))
    # The seeds must really reach what the suite claims to cover.
    assert coverage.preemptions > 0 and coverage.prefix_hit_tokens > 0
    assert coverage.drafts > coverage.accepted > 0
    assert set(coverage.abort_states) >= {"queued", "prefilling", "decoding", "verifying"}
    assert {"stop", "length", "abort"} <= set(coverage.finish_reasons)
    if HAS_XGRAMMAR:
        assert coverage.finish_reasons["error"] > 0  # invalid structured requests
    assert len(coverage.spec_methods) == 5  # none, ngram, and the three drafts
    # vLLM's async races: preemption with the request's step (and drafts) still on the device,
    # a request stopping while its next step is in flight.
    assert coverage.events["preempted_in_flight"] > 0
    assert coverage.events["preempted_with_drafts_in_flight"] > 0
    assert coverage.events["finished_stop_with_next_step_in_flight"] > 0


def test_scenarios_on_worker_threads() -> None:
    """The real ``CpuDevice`` (worker threads; device work overlaps the scheduler)."""
    coverage = _run_seeds(range(NUM_THREADED_SEEDS), threaded=True)
    assert coverage.scenarios == NUM_THREADED_SEEDS


def test_a_seed_replays_exactly() -> None:
    w = world()
    scenario = make_scenario(7, w)
    assert make_scenario(7, w) == scenario
    first = run_scenario(scenario, w, async_on=True)
    again = run_scenario(scenario, w, async_on=True)
    assert first.tokens == again.tokens and first.finish_reasons == again.finish_reasons
    assert first.events == again.events and first.abort_states == again.abort_states


# ---- mutations: each breaks one rule, and the suite must say so -----------------------------
# Seeds with preemption, prefix hits, drafts and aborts among them.
MUTATION_SEEDS = range(0, 12)


def _assert_caught(monkeypatch: pytest.MonkeyPatch, expected: str) -> None:
    for seed in MUTATION_SEEDS:
        try:
            check_seed(seed)
        except ScenarioFailure as err:
            message = str(err)
            assert message.startswith(
                f"replay: PYTHONPATH=. python -m tests.engine.fuzz --seed {seed}"
            )
            assert expected in message, message
            return
    raise AssertionError(f"no seed caught the mutation (expected {expected!r})")


def test_catches_a_lost_token(monkeypatch: pytest.MonkeyPatch) -> None:
    commit = Scheduler._commit

    def losing_commit(self, request, *args):  # type: ignore[no-untyped-def]
        out = commit(self, request, *args)
        if out is not None and len(request.output_token_ids) == 3 and not out.finished:
            return RequestOutput(out.req_id, [], False, None)  # the user never sees token 3
        return out

    monkeypatch.setattr(Scheduler, "_commit", losing_commit)
    _assert_caught(monkeypatch, "user got")


def test_catches_a_leaked_block(monkeypatch: pytest.MonkeyPatch) -> None:
    free = KVCacheManager.free

    def leaky_free(self, request):  # type: ignore[no-untyped-def]
        if request.req_id != "r1":
            free(self, request)

    monkeypatch.setattr(KVCacheManager, "free", leaky_free)
    _assert_caught(monkeypatch, "block")


def test_catches_an_unsettled_placeholder(monkeypatch: pytest.MonkeyPatch) -> None:
    commit = Scheduler._commit

    def sticky_commit(self, request, num_drafts, num_slots, *args):  # type: ignore[no-untyped-def]
        out = commit(self, request, num_drafts, num_slots, *args)
        if num_slots and request.req_id == "r0" and len(request.output_token_ids) == 1:
            request.num_output_placeholders += 1  # one placeholder never settles
        return out

    monkeypatch.setattr(Scheduler, "_commit", sticky_commit)
    _assert_caught(monkeypatch, "placeholder")


def test_catches_a_token_after_the_final_output(monkeypatch: pytest.MonkeyPatch) -> None:
    commit = Scheduler._commit

    def late_commit(self, request, *args):  # type: ignore[no-untyped-def]
        out = commit(self, request, *args)
        if request.is_finished and out is None:  # a dropped in-flight token: send it anyway
            return RequestOutput(request.req_id, [5], False, None)
        return out

    monkeypatch.setattr(Scheduler, "_commit", late_commit)
    _assert_caught(monkeypatch, "after its final one")


# ---- seeds that found bugs, replayed ---------------------------------------------------------
# A seed names a scenario only for one version of tests/engine/fuzz/scenario.py: each bug's test
# below also puts the bug back and requires its seeds to catch it, so a generator change that
# moves them fails loudly (pick new seeds with the bug put back).
LOGPROBS_SEEDS = (40000, 40001, 40015)


def _batch_logprobs(request, logprobs, num_tokens):  # type: ignore[no-untyped-def]
    """The bug: every request got the batch's logprobs (largest k), asked for or not."""
    return None if logprobs is None else logprobs[:num_tokens]


@pytest.mark.parametrize("seed", LOGPROBS_SEEDS)
def test_logprobs_are_the_requests_own(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    check_seed(seed)
    monkeypatch.setattr(Scheduler, "_own_logprobs", staticmethod(_batch_logprobs))
    with pytest.raises(ScenarioFailure, match="logprobs=None but got"):
        check_seed(seed)
