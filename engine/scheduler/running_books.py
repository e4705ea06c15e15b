"""Columnar books of the running requests: one slot (an array index) per running request.

A running request's step counters (``num_computed_tokens``, ``num_output_placeholders``,
``num_steps_in_flight``) live here rather than on the :class:`Request`, beside copies of what its
stop checks read (prompt length, committed output count, ``max_tokens``, EOS and stop token ids)
and two flags (drafts pending, stop conditions that need Python). The ``Request`` properties read
and write the slot while the request runs, so the scheduler's general path is unchanged; the
steady decode step (every running request advances one token and commits one) is then planned and
committed with array operations over the batch's slots, and only the few requests a token can end
get Python work (docs/design.md §2.3: the books are the same five, only their storage differs).

A slot is taken when a request is admitted (``adopt``) and given back when it is preempted or
finished (``release``, which copies the counters back onto the request). ``RequestStatus.RUNNING``
and holding a slot go together.
"""

from __future__ import annotations

import operator

import numpy as np

from engine.request import Request

__all__ = ["RunningBooks"]

_NO_TOKEN = -1  # never a token id: an absent EOS, a stop-id table's padding
_slot_of = operator.attrgetter("slot")


class RunningBooks:
    """Owned by the scheduler; ``capacity`` is ``max_num_seqs`` (one slot per running request)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        # Counters: the request properties index these through memoryviews (a Python int per
        # read, ~40 ns), the vectorised paths through the arrays (the same memory).
        self.num_computed = np.zeros(capacity, np.int64)  # [slots]
        self.num_placeholders = np.zeros(capacity, np.int64)  # [slots]
        self.num_in_flight = np.zeros(capacity, np.int64)  # [slots]
        self.num_computed_view = self.num_computed.data
        self.num_placeholders_view = self.num_placeholders.data
        self.num_in_flight_view = self.num_in_flight.data
        # What the stop checks and the steady-step test read, kept as they change.
        self.num_output = np.zeros(capacity, np.int64)  # len(output_token_ids)
        self.num_prompt = np.zeros(capacity, np.int64)
        self.max_tokens = np.zeros(capacity, np.int64)
        self.eos = np.full(capacity, _NO_TOKEN, np.int64)
        self.stop_ids = np.full((capacity, 1), _NO_TOKEN, np.int64)  # [slots, widest stop set]
        self.num_with_stop_ids = 0  # slots with any stop token id (else no compare at all)
        # Stop strings or min_tokens: every committed token goes through ``check_stop``.
        self.always_check = np.zeros(capacity, np.bool_)
        self.has_drafts = np.zeros(capacity, np.bool_)  # spec_token_ids not empty
        # Leading blocks offered to the prefix cache (KVCacheManager.num_cached_blocks): a commit
        # whose confirmed frontier fills no block beyond these has nothing to cache.
        self.num_cached_blocks = np.zeros(capacity, np.int64)
        self.num_cached_tokens = np.zeros(capacity, np.int64)  # prefix hit at first admission
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def adopt(self, request: Request, num_cached_blocks: int) -> None:
        """Give the (just admitted) request a slot; its counters move there."""
        if request.slot >= 0:
            raise ValueError(f"request {request.req_id!r} already holds slot {request.slot}")
        if not self._free:
            raise RuntimeError(f"running books full ({self.capacity} slots)")
        slot = self._free.pop()
        params = request.sampling_params
        self.num_computed[slot] = request.num_computed_tokens
        self.num_placeholders[slot] = request.num_output_placeholders
        self.num_in_flight[slot] = request.num_steps_in_flight
        self.num_output[slot] = len(request.output_token_ids)
        self.num_prompt[slot] = request.num_prompt_tokens
        self.max_tokens[slot] = params.max_tokens
        eos = request.eos_token_id
        self.eos[slot] = _NO_TOKEN if eos is None else eos
        stop_ids = params.stop_token_ids
        if len(stop_ids) > self.stop_ids.shape[1]:
            wider = np.full((self.capacity, len(stop_ids)), _NO_TOKEN, np.int64)
            wider[:, : self.stop_ids.shape[1]] = self.stop_ids
            self.stop_ids = wider
        self.stop_ids[slot] = _NO_TOKEN
        self.stop_ids[slot, : len(stop_ids)] = stop_ids
        self.num_with_stop_ids += bool(stop_ids)
        self.always_check[slot] = request.has_extra_stop_conditions
        self.has_drafts[slot] = bool(request.spec_token_ids)
        self.num_cached_blocks[slot] = num_cached_blocks
        self.num_cached_tokens[slot] = max(request.num_cached_tokens, 0)
        request.attach_books(self, slot)

    def release(self, request: Request) -> None:
        """Take the slot back (preempted or finished); the counters return to the request."""
        slot = request.slot
        if slot < 0:
            return
        request.detach_books()
        self.num_with_stop_ids -= bool(self.stop_ids[slot, 0] != _NO_TOKEN)
        self.stop_ids[slot] = _NO_TOKEN
        self._free.append(slot)

    def slots_of(self, requests: list[Request]) -> np.ndarray:
        """``[len(requests)]`` int64: each request's slot (-1 for one without)."""
        return np.fromiter(map(_slot_of, requests), np.int64, len(requests))
