"""The scheduler's columnar books (RunningBooks) and the columnar commit of plain steps.

Random stop configurations (EOS, ignore_eos, stop token ids, stop strings, min_tokens, max_tokens,
max_model_len), chunked prefill, prefix caching and preemption, both engine loops. Checked
against (a) a straightforward per-request reference of the stop rules, run on each request's
own token stream, and (b) the scheduler's per-request path (forced by a runner that returns its
rows out of schedule order), step by step.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.request import FINISH_REASON_LENGTH, FINISH_REASON_STOP, Request
from engine.sampling_params import SamplingParams
from engine.scheduler.async_scheduler import AsyncScheduler
from engine.scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from engine.scheduler.request_output import RequestOutput
from engine.scheduler.running_books import RunningBooks
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.step_outputs import StepOutputs
from tests.engine.test_sched_harness import (
    EOS,
    FakeDevice,
    SchedulerParts,
    drive,
    prompt_tokens,
    target_token,
)

STOP_STRING = "zz"
MAX_MODEL_LEN = 40


def _stop_string(request: Request) -> str | None:
    """The 'detokenizer': the stop string appears when the last two tokens sum to 0 mod 13."""
    if STOP_STRING not in request.sampling_params.stop:
        return None
    return STOP_STRING if sum(request.output_token_ids[-2:]) % 13 == 0 else None


def _stop_string_in(output_token_ids: list[int]) -> bool:
    return sum(output_token_ids[-2:]) % 13 == 0


def _reference(
    req_id: str, prompt: list[int], params: SamplingParams, eos_at: int | None
) -> tuple[list[int], str, int | str | None]:
    """The stop rules one token at a time on the request's own stream: (tokens, reason, stop)."""
    outputs: list[int] = []
    while True:
        token = target_token(req_id, prompt + outputs, len(prompt), eos_at)
        outputs.append(token)
        if len(outputs) >= params.min_tokens:
            if not params.ignore_eos and token == EOS:
                return outputs, FINISH_REASON_STOP, None
            if token in params.stop_token_ids:
                return outputs, FINISH_REASON_STOP, token
            if params.stop and _stop_string_in(outputs):
                return outputs, FINISH_REASON_STOP, STOP_STRING
        if len(outputs) >= params.max_tokens or len(prompt) + len(outputs) >= MAX_MODEL_LEN:
            return outputs, FINISH_REASON_LENGTH, None


def _workload(seed: int) -> tuple[dict[int, list[Request]], dict[str, int], dict[str, tuple]]:
    """Random requests: arrivals by iteration, EOS positions, and each one's reference."""
    rng = random.Random(seed)
    shared = prompt_tokens("shared", 8)
    arrivals: dict[int, list[Request]] = {}
    eos_at: dict[str, int] = {}
    expected: dict[str, tuple] = {}
    for index in range(14):
        req_id = f"r{index}"
        prompt_len = rng.randint(2, 20)
        prompt = prompt_tokens(req_id, prompt_len, shared[: rng.choice((0, 4, 8))])
        if rng.random() < 0.4:
            eos_at[req_id] = rng.randint(0, 12)
        # Stop ids taken from the request's own stream, so some of them do fire.
        stream, _, _ = _reference(
            req_id, prompt, SamplingParams(max_tokens=MAX_MODEL_LEN), eos_at.get(req_id)
        )
        stop_ids = tuple(rng.sample(stream, k=min(len(stream), rng.randint(0, 3))))
        max_tokens = rng.randint(1, 30)
        params = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=rng.random() < 0.2,
            min_tokens=min(max_tokens, rng.choice((0, 0, 0, 2, 5))),
            stop_token_ids=stop_ids if rng.random() < 0.5 else (),
            stop=(STOP_STRING,) if rng.random() < 0.3 else (),
        )
        request = Request(req_id, prompt, params, arrival_time=float(index), eos_token_id=EOS)
        arrivals.setdefault(rng.randint(0, 12), []).append(request)
        expected[req_id] = _reference(req_id, prompt, params, eos_at.get(req_id))
    return arrivals, eos_at, expected


class _ShuffledDevice(FakeDevice):
    """Returns its rows reversed: the scheduler then takes its per-request path (steps of two
    or more requests)."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = super().execute(out)
        return ModelRunnerOutput(
            result.step,
            result.req_ids[::-1],
            result.sampled_token_ids[::-1],
            result.num_accepted[::-1],
        )


_STATS: dict[tuple[int, int, str], tuple[int, int]] = {}  # (seed, depth, device) -> counts


def _run(seed: int, depth: int, device_cls: type[FakeDevice]) -> tuple[list[list], int, dict]:
    """Steps the scheduler; returns every update's outputs (materialised), how many updates
    came back as ``StepOutputs``, and per request (tokens, finish reason, stop reason). Notes
    the run's preemptions and prefix-hit tokens in ``_STATS``."""
    arrivals, eos_at, _ = _workload(seed)
    parts = SchedulerParts.of(
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=24,  # tight: preemption happens
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=6,
        debug_invariants=True,
    )
    cls = Scheduler if depth == 1 else AsyncScheduler
    scheduler = parts.build(cls, _stop_string)
    device = device_cls(4, eos_at=eos_at, sync=depth == 1)
    steps: list[list[RequestOutput]] = []
    num_columnar = 0
    results: dict[str, list] = {}
    for _, _, outputs in drive(scheduler, device, arrivals, depth, 2000):
        if isinstance(outputs, StepOutputs):
            num_columnar += 1
            # The columns and the explicit outputs are the materialised list, split.
            assert len(outputs) == len(outputs.explicit) + len(outputs.plain_req_ids)
            by_id = {o.req_id: o for o in outputs}
            for req_id, token_id in zip(
                outputs.plain_req_ids, outputs.plain_token_ids, strict=True
            ):
                assert by_id[req_id].new_token_ids == [token_id]
                assert not by_id[req_id].finished
        steps.append(list(outputs))
        for o in outputs:
            entry = results.setdefault(o.req_id, [[], None, None])
            entry[0].extend(o.new_token_ids)
            if o.finished:
                entry[1], entry[2] = o.finish_reason, o.stop_reason
    scheduler.check_invariants()
    stats = scheduler.get_stats()
    assert scheduler.num_requests == 0 and stats.output_placeholders == 0
    _STATS[seed, depth, device_cls.__name__] = (
        stats.num_preemptions,
        stats.prefix_cache_hit_tokens,
    )
    return steps, num_columnar, {k: tuple(v) for k, v in results.items()}


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("seed", range(5))
def test_columnar_commit_matches_reference_and_per_request_path(seed: int, depth: int) -> None:
    _, _, expected = _workload(seed)
    steps, num_columnar, results = _run(seed, depth, FakeDevice)
    assert num_columnar > 0, "no step took the columnar commit"
    assert results == {k: (v[0], v[1], v[2]) for k, v in expected.items()}
    reference_steps, num_reference_columnar, _ = _run(seed, depth, _ShuffledDevice)
    # (a one-request step reversed is still in schedule order: columnar there too)
    assert num_reference_columnar < num_columnar
    # Every step: the same outputs, in the same order, as the per-request path gives.
    assert steps == reference_steps


def test_the_workloads_preempt_and_hit_the_prefix_cache() -> None:
    """The cases above are not all easy ones: some runs preempt, some hit the prefix cache."""
    for seed in range(5):
        _run(seed, 2, FakeDevice)
    runs = [v for (_, depth, device), v in _STATS.items() if device == "FakeDevice"]
    assert sum(num_preempted for num_preempted, _ in runs) > 0
    assert sum(num_hit for _, num_hit in runs) > 0


def test_step_outputs_merges_in_row_order() -> None:
    finished = RequestOutput("b", [7], True, FINISH_REASON_STOP, 7)
    outputs = StepOutputs([finished], [1], ["a", "c"], [5, 9], [0, 2], np.array([0, 4]))
    assert len(outputs) == 3
    assert list(outputs) == [
        RequestOutput("a", [5], num_cached_tokens=0),
        finished,
        RequestOutput("c", [9], num_cached_tokens=4),
    ]
    assert outputs[1] is finished and outputs == list(outputs)
    assert isinstance(outputs[0].num_cached_tokens, int)


def test_running_books_adopt_and_release_move_the_counters() -> None:
    books = RunningBooks(2)
    request = Request("a", [3, 4, 5], SamplingParams(stop_token_ids=(8, 9)), 0.0, EOS)
    request.num_computed_tokens = 2
    books.adopt(request, num_cached_blocks=0)
    assert request.slot >= 0 and books.num_computed[request.slot] == 2
    request.num_output_placeholders += 1
    request.num_steps_in_flight = 1
    assert books.num_placeholders[request.slot] == 1 and books.num_with_stop_ids == 1
    slot = request.slot
    books.release(request)
    assert request.slot == -1 and books.num_with_stop_ids == 0
    assert (request.num_computed_tokens, request.num_output_placeholders) == (2, 1)
    assert request.num_steps_in_flight == 1 and books.num_free_slots == 2
    assert (books.stop_ids[slot] == -1).all()
    other = Request("b", [1], SamplingParams(), 0.0, None)
    books.adopt(request, 0)
    books.adopt(other, 0)
    with pytest.raises(RuntimeError, match="full"):
        books.adopt(Request("c", [1], SamplingParams(), 0.0, None), 0)
    with pytest.raises(ValueError, match="already holds"):
        books.adopt(other, 0)


def test_a_runner_returning_the_wrong_token_counts_is_refused() -> None:
    """Two tokens for one row and none for another sum to one each: still an error."""
    parts = SchedulerParts.of(
        max_model_len=64, num_kv_blocks=32, block_size=4, max_num_batched_tokens=64
    )
    scheduler = parts.build()
    for req_id in "ab":
        scheduler.add_request(
            Request(req_id, prompt_tokens(req_id, 5), SamplingParams(max_tokens=9), 0.0, EOS)
        )
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput(out.step, ["a", "b"], [[11], [12]]))
    out = scheduler.schedule()
    bad = ModelRunnerOutput(out.step, ["a", "b"], [[11, 12], []])
    with pytest.raises(ValueError, match="runner returned 2 tokens"):
        scheduler.update_from_output(out, bad)
