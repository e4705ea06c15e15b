"""One generation request and its scheduler-side books.

The scheduler owns every mutable field here; the runner only ever sees copies carried by
``SchedulerOutput``. Following docs/design.md §2.3, a request keeps five books that are never mixed:

==========================  ==============================================================
``output_token_ids``         tokens returned by the device and committed
``num_output_placeholders``  sampled positions scheduled but not yet returned by the device
``spec_token_ids``           drafts for the target to verify (``-1`` while on the device)
``num_computed_tokens``      the scheduler's logical frontier, in-flight work included
KV block ids                 physical state, owned by ``KVCacheManager`` (not stored here)
==========================  ==============================================================
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from engine.sampling_params import SamplingParams

__all__ = [
    "Request",
    "RequestStatus",
    "FINISH_REASON_STOP",
    "FINISH_REASON_LENGTH",
    "FINISH_REASON_ABORT",
]

FINISH_REASON_STOP = "stop"
FINISH_REASON_LENGTH = "length"
FINISH_REASON_ABORT = "abort"


class RequestStatus(enum.IntEnum):
    """Life cycle of a request. Every status after ``PREEMPTED`` is terminal."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """The user-facing reason (``"stop"``, ``"length"``, ``"abort"``), None if not finished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: FINISH_REASON_ABORT,
}


class Request:
    """A prompt, how to sample it, and where the scheduler stands with it.

    ``confirmed_frontier`` is the number of leading positions whose token values are committed
    and whose KV has been scheduled: ``num_computed_tokens - num_output_placeholders``. For a
    decoding request it is one less than ``num_tokens`` (the newest committed token's KV is
    written by the next step). Only KV blocks entirely below it may enter the prefix cache.
    """

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        arrival_time: float,
        eos_token_id: int | None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {req_id!r}: prompt must hold at least one token")
        self.req_id = req_id
        self.prompt_token_ids: list[int] = [int(t) for t in prompt_token_ids]
        # The prompt never changes, so its length is kept rather than recounted: the scheduler
        # reads it several times per request per step.
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.eos_token_id = eos_token_id
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None  # the stop token id or stop string, if any
        # Stop conditions beyond EOS and the length caps (stop ids or strings, min_tokens): a
        # committed token that is not EOS and reaches no length cap cannot end a request
        # without them, so the scheduler's per-token stop check is skipped (check_stop).
        self.has_extra_stop_conditions = bool(
            sampling_params.stop or sampling_params.stop_token_ids or sampling_params.min_tokens
        )

        # The five books (the fifth, KV block ids, lives in KVCacheManager).
        self.output_token_ids: list[int] = []
        self.num_output_placeholders = 0
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0

        self.num_steps_in_flight = 0  # scheduled steps whose output has not been processed
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until admitted
        self.num_preemptions = 0

    # -- derived views -----------------------------------------------------------------------
    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus committed output tokens (placeholders and drafts excluded)."""
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """A fresh list: prompt followed by committed outputs."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_pending_tokens(self) -> int:
        """Tokens known (or sampled and still on the device) whose KV is not scheduled yet."""
        return (
            self.num_prompt_tokens
            + len(self.output_token_ids)
            + self.num_output_placeholders
            - self.num_computed_tokens
        )

    @property
    def confirmed_frontier(self) -> int:
        return self.num_computed_tokens - self.num_output_placeholders

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens},"
            f" out={self.num_output_tokens}, computed={self.num_computed_tokens},"
            f" placeholders={self.num_output_placeholders}, spec={len(self.spec_token_ids)},"
            f" in_flight={self.num_steps_in_flight})"
        )
