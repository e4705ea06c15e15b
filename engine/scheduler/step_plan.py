"""The scheduler's scratch record of one step while it is being planned, and of it in flight."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.request import Request
from engine.scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput

__all__ = ["StepPlan", "InFlightStep"]


@dataclass
class InFlightStep:
    """What the scheduler promised for a step whose output has not come back yet.

    ``num_sampled_slots[req_id]`` is 1 + the drafts scheduled when the step samples the request,
    0 when it only computes a prefill chunk. The async scheduler added exactly this many output
    placeholders, and settles exactly this many when the output returns.
    """

    step: int
    num_sampled_slots: dict[str, int] = field(default_factory=dict)
    # A step that is one run of steady decodes (``StepPlan.add_decodes`` only): its requests and
    # their running-book slots in ``num_sampled_slots`` order, and ``RequestQueues.version`` when
    # it was planned. While the version is unchanged every one still runs in that slot, so the
    # commit needs no lookup per request.
    requests: list[Request] | None = None
    slots: np.ndarray | None = None
    queues_version: int = -1


@dataclass
class StepPlan:
    """Accumulates one step's decisions; ``build`` freezes them into a ``SchedulerOutput``."""

    step: int
    token_budget: int
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_req_ids: list[str] = field(default_factory=list)
    cached_new_block_ids: list[list[int]] = field(default_factory=list)
    cached_num_computed: list[int] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # The requests planned by ``add`` (not ``add_decodes``), in order: ``Scheduler`` advances
    # their books once planning is over.
    requests: list[Request] = field(default_factory=list)
    # Per scheduled request in ``num_scheduled_tokens`` order: the sampled slots it adds (see
    # ``InFlightStep``); 0 for ``add``'s requests until their books are advanced.
    num_sampled_slots: dict[str, int] = field(default_factory=dict)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_prefill_reqs: int = 0
    num_decode_reqs: int = 0
    num_decode_slots: int = 0  # sampled slots of ``add_decodes``' requests (one each)
    # Blocks of preempted or finished requests that return once their steps in flight settle
    # (less those already promised); a request short of blocks waits for them instead of
    # preempting another victim.
    num_blocks_returning: int = 0
    # A running request went short of blocks this step: admit no waiting request.
    short_of_blocks: bool = False
    # ``add_decodes``' runs: (requests, their slots), in order.
    decode_runs: list[tuple[list[Request], np.ndarray]] = field(default_factory=list)

    def add(
        self, request: Request, num_new_tokens: int, spec_tokens: list[int], num_pending: int
    ) -> None:
        """Record that the request advances ``num_new_tokens`` (spec tokens included).

        ``num_pending`` is the request's ``num_pending_tokens`` before this step (the caller has
        it already); one or none makes the request a decode, more a prefill.
        """
        self.num_scheduled_tokens[request.req_id] = num_new_tokens
        self.num_sampled_slots[request.req_id] = 0
        self.requests.append(request)
        self.token_budget -= num_new_tokens
        if spec_tokens:
            self.spec_tokens[request.req_id] = spec_tokens
        if num_pending <= 1:
            self.num_decode_reqs += 1
        else:
            self.num_prefill_reqs += 1

    def add_decodes(
        self,
        req_ids: list[str],
        num_computed_tokens: list[int],
        new_block_ids: list[list[int]] | None = None,
    ) -> None:
        """``add`` + ``add_cached`` of running requests that each advance one token, sample one
        (no drafts): the steady decode step. Their books are advanced by the scheduler at once,
        as columns (``num_computed_tokens``: the values before); ``new_block_ids``: per request,
        the blocks taken for it (None: no request needed one)."""
        ones = dict.fromkeys(req_ids, 1)
        self.num_scheduled_tokens.update(ones)
        self.num_sampled_slots.update(ones)
        num = len(req_ids)
        self.token_budget -= num
        self.num_decode_reqs += num
        self.num_decode_slots += num
        self.cached_req_ids += req_ids
        if new_block_ids is None:
            new_block_ids = [[]] * num  # one shared empty list: the records are read-only
        self.cached_new_block_ids += new_block_ids
        self.cached_num_computed += num_computed_tokens

    def add_spec_decodes(
        self,
        req_ids: list[str],
        num_new_tokens: list[int],
        num_computed_tokens: list[int],
        new_block_ids: list[list[int]] | None,
        spec_tokens: dict[str, list[int]],
    ) -> None:
        """``add`` + ``add_cached`` of running requests that each advance their one pending
        token and ``num_new_tokens[i] - 1`` drafts (``spec_tokens``, only those with any) and
        sample as many slots: the steady speculative decode step. Their books are advanced by
        the scheduler at once (``num_computed_tokens``: the values before); ``new_block_ids``:
        per request, the blocks taken for it (None: no request needed one)."""
        counts = dict(zip(req_ids, num_new_tokens, strict=True))
        self.num_scheduled_tokens.update(counts)
        self.num_sampled_slots.update(counts)
        num_tokens = sum(num_new_tokens)
        self.token_budget -= num_tokens
        self.num_decode_reqs += len(req_ids)
        self.num_decode_slots += num_tokens
        self.spec_tokens.update(spec_tokens)
        self.cached_req_ids += req_ids
        if new_block_ids is None:
            new_block_ids = [[]] * len(req_ids)  # one shared empty list: the records are read-only
        self.cached_new_block_ids += new_block_ids
        self.cached_num_computed += num_computed_tokens

    def add_cached(self, request: Request, new_block_ids: list[int]) -> None:
        self.cached_req_ids.append(request.req_id)
        self.cached_new_block_ids.append(new_block_ids)
        self.cached_num_computed.append(request.num_computed_tokens)

    def add_new(self, request: Request, block_ids: list[int]) -> None:
        self.new_reqs.append(
            NewRequestData(
                req_id=request.req_id,
                prompt_token_ids=list(request.prompt_token_ids),
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                block_ids=block_ids,
                num_computed_tokens=request.num_computed_tokens,
            )
        )

    def build(self, finished_req_ids: set[str]) -> SchedulerOutput:
        return SchedulerOutput(
            step=self.step,
            scheduled_new_reqs=self.new_reqs,
            scheduled_cached_reqs=CachedRequestData(
                req_ids=self.cached_req_ids,
                new_block_ids=self.cached_new_block_ids,
                num_computed_tokens=self.cached_num_computed,
            ),
            num_scheduled_tokens=self.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(self.num_scheduled_tokens.values()),
            scheduled_spec_decode_tokens=self.spec_tokens,
            finished_req_ids=finished_req_ids,
            num_prefill_reqs=self.num_prefill_reqs,
            num_decode_reqs=self.num_decode_reqs,
        )
