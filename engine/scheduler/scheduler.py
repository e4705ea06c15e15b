"""The CPU scheduler: continuous batching under a token budget, chunked prefill, paged KV blocks
with prefix caching, preemption by recompute, abort.

It decides how many tokens each request advances and which KV blocks it uses; nothing else.
Synchronous contract: ``update_from_output(N)`` runs before ``schedule()`` of N+1
(``AsyncScheduler`` lifts it). The request books are kept the same way in both modes, so the
invariants of DESIGN.md §1 hold at every instant: while a step is in flight its sampled
positions are output placeholders, and its drafts are ``-1`` (they live on the device).
"""

from __future__ import annotations

from collections import deque
from typing import ClassVar

from engine.request import Request, RequestStatus
from engine.scheduler.invariants import check_request_books
from engine.scheduler.kv_cache_manager import KVCacheManager
from engine.scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from engine.scheduler.request_output import RequestOutput, SchedulerStats, StopStringChecker
from engine.scheduler.request_queues import RequestQueues
from engine.scheduler.scheduler_config import SchedulerConfig
from engine.scheduler.step_plan import InFlightStep, StepPlan
from engine.scheduler.stop_conditions import check_stop

__all__ = ["Scheduler", "SchedulerConfig"]


class Scheduler:
    """Owns every request's books and the KV block pool (through ``KVCacheManager``)."""

    allows_overlapping_steps: ClassVar[bool] = False

    def __init__(
        self, config: SchedulerConfig, stop_string_checker: StopStringChecker | None = None
    ) -> None:
        self.config = config
        self.kv_cache_manager = KVCacheManager(
            config.num_gpu_blocks, config.block_size, config.enable_prefix_caching
        )
        self._stop_string_checker = stop_string_checker
        self._queues = RequestQueues()
        self._in_flight: deque[InFlightStep] = deque()
        self._next_step = 0
        self._num_preemptions = 0
        self._num_prefix_hit_tokens = 0
        self._last_accepted = 0
        self._last_batch_tokens = 0

    # -- requests in and out -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request; it is scheduled at the next ``schedule()`` at the earliest."""
        if self._queues.get(request.req_id) is not None:
            raise ValueError(f"request {request.req_id!r} already exists")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"request {request.req_id!r}: prompt of {request.num_prompt_tokens} tokens leaves"
                f" no room for output within max_model_len={self.config.max_model_len}"
            )
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.req_id!r} is not fresh: {request!r}")
        self._queues.add(request)

    def abort_request(self, req_id: str) -> RequestOutput | None:
        """Finish a live request as ``"abort"``; returns its final output (None if unknown or
        already finished). Steps in flight still compute it; their tokens are dropped."""
        return self.finish_request(req_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, req_id: str, status: RequestStatus) -> RequestOutput | None:
        """Finish a live request from outside (abort, or a stop string the detokenizer found)."""
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished status")
        request = self._queues.get(req_id)
        if request is None or request.is_finished:
            return None
        request.status = status
        self._finish(request)
        return RequestOutput(req_id, [], finished=True, finish_reason=status.finish_reason)

    def get_request(self, req_id: str) -> Request | None:
        """The live request (read it; only the scheduler writes it)."""
        return self._queues.get(req_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._queues.running or self._queues.waiting)

    @property
    def num_steps_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def num_requests(self) -> int:
        """Requests the scheduler still tracks (finished ones until their blocks are released)."""
        return len(self._queues)

    # -- schedule ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan the next step: running requests first (decode plus their drafts), then waiting
        ones while budget, ``max_num_seqs`` and blocks allow. An empty step (no tokens) is not
        in flight: do not execute it, do not pass it to ``update_from_output``."""
        if self._in_flight and not self.allows_overlapping_steps:
            raise RuntimeError("Scheduler is synchronous: update_from_output(N) before schedule()")
        plan = StepPlan(step=self._next_step, token_budget=self.config.max_num_batched_tokens)
        plan.num_blocks_returning = sum(
            self.kv_cache_manager.num_releasable_blocks(r.req_id)
            for r in self._queues.awaiting_release()
        )
        self._next_step += 1
        self._schedule_running(plan)
        if not plan.short_of_blocks:
            self._schedule_waiting(plan)
        # An empty step is never run, so the rows to drop wait for the next real one.
        output = plan.build(
            self._queues.take_rows_to_drop() if plan.num_scheduled_tokens else set()
        )
        self._last_batch_tokens = output.total_num_scheduled_tokens
        if output.num_scheduled_tokens:
            self._in_flight.append(self._after_schedule(output))
        self._check_invariants_if_debug()
        return output

    def _schedule_running(self, plan: StepPlan) -> None:
        running = self._queues.running
        index = 0
        while index < len(running) and plan.token_budget > 0:
            request = running[index]
            num_new, spec_tokens = self._num_new_tokens(request, plan.token_budget)
            if num_new <= 0:  # every token it may still produce is already in flight
                index += 1
                continue
            new_blocks = self._allocate_or_preempt(request, num_new, plan)
            if request.status is not RequestStatus.RUNNING:
                continue  # it was its own victim; the list shrank under index
            index += 1
            if new_blocks is not None:
                plan.add(request, num_new, spec_tokens)
                plan.add_cached(request, new_blocks)

    def _num_new_tokens(self, request: Request, token_budget: int) -> tuple[int, list[int]]:
        """Tokens to schedule for a running request and the drafts among them.

        Pending tokens (known, or sampled and still on the device) come first; drafts only if the
        step reaches the end. Drafts are trimmed so the step can never produce a token beyond
        ``max_tokens`` or ``max_model_len``, counting outputs still in flight.
        """
        num_pending = request.num_tokens + request.num_output_placeholders
        num_pending -= request.num_computed_tokens
        num_in_flight_out = request.num_output_tokens + request.num_output_placeholders
        room = min(
            request.max_tokens - num_in_flight_out,
            self.config.max_model_len - request.num_tokens - request.num_output_placeholders,
        )
        if room <= 0 or num_pending <= 0:
            return 0, []
        num_spec = min(len(request.spec_token_ids), room - 1)
        num_new = self._cap_chunk(num_pending + num_spec, token_budget)
        num_spec = max(0, num_new - num_pending)
        return num_new, request.spec_token_ids[:num_spec]

    def _cap_chunk(self, num_new: int, token_budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            num_new = min(num_new, threshold)
        return min(num_new, token_budget)

    def _allocate_or_preempt(
        self, request: Request, num_new: int, plan: StepPlan
    ) -> list[int] | None:
        """Blocks for the request's step, preempting the newest running requests if needed.

        A victim with a step in flight keeps its blocks until that step settles; the request then
        waits one step for them (None) rather than preempting more victims.
        """
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks
            num_needed = self.kv_cache_manager.num_blocks_needed(request, num_new)
            if plan.num_blocks_returning >= num_needed:
                plan.num_blocks_returning -= num_needed
                plan.short_of_blocks = True
                return None
            victim = self._queues.running[-1]
            returning = self._preempt(victim, plan)
            if victim is request:
                return None
            plan.num_blocks_returning += returning

    def _preempt(self, request: Request, plan: StepPlan) -> int:
        """Preempt by recompute: back to the front of the queue with only its committed tokens.
        Returns how many blocks will come back once its in-flight steps settle (0 if freed now)."""
        self._queues.preempt(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self._num_preemptions += 1
        plan.short_of_blocks = True
        returning = self.kv_cache_manager.num_releasable_blocks(request.req_id)
        self._release_if_idle(request)
        return 0 if request.num_steps_in_flight == 0 else returning

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Admit queued requests in order (head-of-line: stop at the first that cannot go)."""
        waiting = self._queues.waiting
        while waiting and plan.token_budget > 0:
            if len(self._queues.running) >= self.config.max_num_seqs:
                return
            request = waiting[0]
            if request.num_steps_in_flight > 0:
                return  # preempted with a step in flight: its last tokens are not back yet
            hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_new > plan.token_budget:
                return
            num_new = self._cap_chunk(num_new, plan.token_budget)
            if self.kv_cache_manager.allocate_slots(request, num_new, hit_blocks) is None:
                return
            self._admit(request, num_hit)
            plan.add(request, num_new, [])
            plan.add_new(request, self.kv_cache_manager.block_ids(request.req_id))

    def _admit(self, request: Request, num_hit: int) -> None:
        self._queues.admit(request)
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        self._num_prefix_hit_tokens += num_hit

    def _after_schedule(self, output: SchedulerOutput) -> InFlightStep:
        """Advance each scheduled request's frontier and note what the step will sample."""
        record = InFlightStep(step=output.step)
        for req_id, num_new in output.num_scheduled_tokens.items():
            request = self._tracked(req_id)
            request.num_computed_tokens += num_new
            request.num_steps_in_flight += 1
            samples = request.num_computed_tokens >= (
                request.num_tokens + request.num_output_placeholders
            )
            num_slots = (
                1 + len(output.scheduled_spec_decode_tokens.get(req_id, ())) if samples else 0
            )
            record.num_sampled_slots[req_id] = num_slots
            if samples:  # the device proposes the next drafts right after sampling
                request.spec_token_ids = [-1] * self.config.num_spec_tokens
            request.num_output_placeholders += num_slots
        return record

    # -- update --------------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Commit what step N returned (outputs must come back in schedule order): append tokens,
        roll back rejected drafts, apply stop conditions, free finished requests."""
        if not scheduler_output.num_scheduled_tokens:
            return []
        if not self._in_flight or self._in_flight[0].step != scheduler_output.step:
            raise RuntimeError(
                f"output of step {scheduler_output.step} is not the oldest in flight"
            )
        if runner_output.step != scheduler_output.step:
            raise ValueError(f"runner output step {runner_output.step} != {scheduler_output.step}")
        record = self._in_flight.popleft()
        row_of = {req_id: row for row, req_id in enumerate(runner_output.req_ids)}
        self._last_accepted = 0
        outputs: list[RequestOutput] = []
        for req_id, num_slots in record.num_sampled_slots.items():
            request = self._tracked(req_id)
            request.num_steps_in_flight -= 1
            row = row_of.get(req_id)
            sampled = runner_output.sampled_token_ids[row] if row is not None else []
            logprobs = (
                runner_output.logprobs[row] if runner_output.logprobs and row is not None else None
            )
            output = self._commit(request, scheduler_output, num_slots, sampled, logprobs)
            if output is not None:
                outputs.append(output)
            self._release_if_idle(request)
        self._check_invariants_if_debug()
        return outputs

    def _commit(
        self,
        request: Request,
        scheduler_output: SchedulerOutput,
        num_slots: int,
        sampled: list[int],
        logprobs: list[list[tuple[int, float]]] | None,
    ) -> RequestOutput | None:
        """Settle one request's share of a returned step; None when there is nothing to report."""
        request.num_output_placeholders -= num_slots
        if request.is_finished:
            return None  # finished while this step was in flight: computed, never returned
        num_drafts = len(scheduler_output.scheduled_spec_decode_tokens.get(request.req_id, ()))
        if not (num_slots == 0 and not sampled) and not 1 <= len(sampled) <= num_slots:
            raise ValueError(
                f"request {request.req_id!r}: runner returned {len(sampled)} tokens for a step with"
                f" {num_slots} sampled slots"
            )
        num_accepted = len(sampled) - 1 if num_drafts and sampled else 0
        if request.status is RequestStatus.RUNNING:
            request.num_computed_tokens -= num_drafts - num_accepted
        self._last_accepted += num_accepted
        was_running = request.status is RequestStatus.RUNNING
        new_token_ids = self._append_tokens(request, sampled)
        if was_running:
            self.kv_cache_manager.cache_full_blocks(request, request.confirmed_frontier)
        if request.is_finished:
            self._finish(request)
        elif not new_token_ids:
            return None
        return RequestOutput(
            req_id=request.req_id,
            new_token_ids=new_token_ids,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_draft_tokens=num_drafts,
            num_accepted=num_accepted,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            new_logprobs=logprobs[: len(new_token_ids)] if logprobs is not None else None,
        )

    def _append_tokens(self, request: Request, sampled: list[int]) -> list[int]:
        """Commit tokens one by one until a stop condition ends the request."""
        new_token_ids: list[int] = []
        for token_id in sampled:
            request.output_token_ids.append(token_id)
            new_token_ids.append(token_id)
            if check_stop(request, self.config.max_model_len, self._stop_string_checker):
                break
        return new_token_ids

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Sync mode with a CPU proposer: replace the ``-1`` drafts with real ones (at most
        ``num_spec_tokens`` each). The async path keeps drafts on the device."""
        for req_id, drafts in draft_token_ids.items():
            request = self._queues.get(req_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            request.spec_token_ids = list(drafts[: self.config.num_spec_tokens])

    # -- finishing and releasing ---------------------------------------------------------------
    def _finish(self, request: Request) -> None:
        self._queues.finish(request)
        request.spec_token_ids = []
        self._release_if_idle(request)

    def _tracked(self, req_id: str) -> Request:
        """A request a step in flight references: tracked until that step settles."""
        request = self._queues.get(req_id)
        assert request is not None, f"request {req_id!r} released while a step references it"
        return request

    def _release_if_idle(self, request: Request) -> None:
        """Give the blocks back once no step in flight references the request."""
        if self._queues.take_release(request):
            self.kv_cache_manager.free(request)

    # -- observability -------------------------------------------------------------------------
    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            running_requests=len(self._queues.running),
            waiting_requests=len(self._queues.waiting),
            kv_usage=self.kv_cache_manager.usage,
            output_placeholders=sum(r.num_output_placeholders for r in self._queues),
            accepted_tokens=self._last_accepted,
            batch_tokens=self._last_batch_tokens,
            num_preemptions=self._num_preemptions,
            prefix_cache_hit_tokens=self._num_prefix_hit_tokens,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if any book disagrees with another (debug; O(requests + blocks))."""
        self._queues.check(self.config.max_num_seqs)
        for request in self._queues:
            check_request_books(request, self.kv_cache_manager, self._in_flight)
        self.kv_cache_manager.check_consistency()

    def _check_invariants_if_debug(self) -> None:
        if self.config.debug:
            self.check_invariants()
