"""Request books and status helpers."""

from __future__ import annotations

import pytest

from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams


def _request() -> Request:
    return Request("r", [5, 6, 7], SamplingParams(max_tokens=4), arrival_time=1.0, eos_token_id=2)


def test_fresh_request_books() -> None:
    request = _request()
    assert request.status is RequestStatus.WAITING
    assert request.num_tokens == 3 and request.num_tokens_with_spec == 3
    assert request.output_token_ids == [] and request.spec_token_ids == []
    assert request.num_output_placeholders == 0 and request.num_computed_tokens == 0
    assert request.confirmed_frontier == 0
    assert request.finish_reason is None and not request.is_finished


def test_all_token_ids_is_a_fresh_view() -> None:
    request = _request()
    request.output_token_ids.append(9)
    view = request.all_token_ids
    assert view == [5, 6, 7, 9]
    view.append(100)
    assert request.num_tokens == 4


def test_confirmed_frontier_counts_only_settled_positions() -> None:
    request = _request()
    request.num_computed_tokens = 7
    request.num_output_placeholders = 3
    request.spec_token_ids = [-1, -1]
    assert request.confirmed_frontier == 4
    assert request.num_tokens_with_spec == 5


@pytest.mark.parametrize(
    ("status", "finished", "reason"),
    [
        (RequestStatus.WAITING, False, None),
        (RequestStatus.RUNNING, False, None),
        (RequestStatus.PREEMPTED, False, None),
        (RequestStatus.FINISHED_STOPPED, True, "stop"),
        (RequestStatus.FINISHED_LENGTH_CAPPED, True, "length"),
        (RequestStatus.FINISHED_ABORTED, True, "abort"),
    ],
)
def test_status_finish_reasons(status: RequestStatus, finished: bool, reason: str | None) -> None:
    assert status.is_finished is finished
    assert status.finish_reason == reason


def test_empty_prompt_rejected() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        Request("r", [], SamplingParams(), arrival_time=0.0, eos_token_id=None)
