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
from typing import Any, Protocol

from engine.sampling_params import SamplingParams

__all__ = [
    "Request",
    "CounterColumns",
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


class CounterColumns(Protocol):
    """The columns a running request's counters live in (the scheduler's ``RunningBooks``)."""

    num_computed_view: memoryview  # [slots] int64, read and written as Python ints
    num_placeholders_view: memoryview
    num_in_flight_view: memoryview
    has_drafts: Any  # [slots] bool (a NumPy array)


class Request:
    """A prompt, how to sample it, and where the scheduler stands with it.

    ``confirmed_frontier`` is the number of leading positions whose token values are committed
    and whose KV has been scheduled: ``num_computed_tokens - num_output_placeholders``. For a
    decoding request it is one less than ``num_tokens`` (the newest committed token's KV is
    written by the next step). Only KV blocks entirely below it may enter the prefix cache.

    While the request runs it holds ``slot`` (>= 0) in the scheduler's columnar
    :class:`~engine.scheduler.running_books.RunningBooks`, where ``num_computed_tokens``,
    ``num_output_placeholders`` and ``num_steps_in_flight`` live (the properties read and write
    them there), so a steady decode step advances every running request with array operations.
    Otherwise (waiting, preempted, finished) they are plain fields here.
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
        # Stop conditions beyond stop token ids and the length caps (stop strings, min_tokens):
        # without them a committed token that is no EOS or stop id and reaches no length cap
        # cannot end the request, so the scheduler skips its per-token stop check (check_stop).
        self.has_extra_stop_conditions = bool(sampling_params.stop or sampling_params.min_tokens)

        # The running books' slot (-1: none; see the class docstring). Set before the books.
        self.slot = -1
        self._books: CounterColumns | None = None

        # The five books (the fifth, KV block ids, lives in KVCacheManager).
        self.output_token_ids: list[int] = []
        self._num_output_placeholders = 0
        self._spec_token_ids: list[int] = []
        self._num_computed_tokens = 0

        self._num_steps_in_flight = 0  # scheduled steps whose output has not been processed
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until admitted
        self.num_preemptions = 0

    # -- the counters, in the running books while the request holds a slot --------------------
    @property
    def num_computed_tokens(self) -> int:
        slot = self.slot
        if slot < 0:
            return self._num_computed_tokens
        return self._books.num_computed_view[slot]  # type: ignore[union-attr]

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        slot = self.slot
        if slot < 0:
            self._num_computed_tokens = value
        else:
            self._books.num_computed_view[slot] = value  # type: ignore[union-attr]

    @property
    def num_output_placeholders(self) -> int:
        slot = self.slot
        if slot < 0:
            return self._num_output_placeholders
        return self._books.num_placeholders_view[slot]  # type: ignore[union-attr]

    @num_output_placeholders.setter
    def num_output_placeholders(self, value: int) -> None:
        slot = self.slot
        if slot < 0:
            self._num_output_placeholders = value
        else:
            self._books.num_placeholders_view[slot] = value  # type: ignore[union-attr]

    @property
    def num_steps_in_flight(self) -> int:
        slot = self.slot
        if slot < 0:
            return self._num_steps_in_flight
        return self._books.num_in_flight_view[slot]  # type: ignore[union-attr]

    @num_steps_in_flight.setter
    def num_steps_in_flight(self, value: int) -> None:
        slot = self.slot
        if slot < 0:
            self._num_steps_in_flight = value
        else:
            self._books.num_in_flight_view[slot] = value  # type: ignore[union-attr]

    @property
    def spec_token_ids(self) -> list[int]:
        return self._spec_token_ids

    @spec_token_ids.setter
    def spec_token_ids(self, value: list[int]) -> None:
        self._spec_token_ids = value
        if self.slot >= 0:
            self._books.has_drafts[self.slot] = bool(value)  # type: ignore[union-attr]

    def attach_books(self, books: CounterColumns, slot: int) -> None:
        """Called by ``RunningBooks.adopt`` once the slot holds this request's values."""
        self._books = books
        self.slot = slot

    def detach_books(self) -> None:
        """Called by ``RunningBooks.release``: the counters come back here."""
        books, slot = self._books, self.slot
        if books is None or slot < 0:
            return
        self._num_computed_tokens = books.num_computed_view[slot]
        self._num_output_placeholders = books.num_placeholders_view[slot]
        self._num_steps_in_flight = books.num_in_flight_view[slot]
        self.slot = -1
        self._books = None

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
