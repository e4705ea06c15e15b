"""The CPU scheduler: continuous batching under a token budget, chunked prefill, paged KV blocks
with prefix caching, preemption by recompute, abort.

It decides how many tokens each request advances and which KV blocks it uses; nothing else.
Synchronous contract: ``update_from_output(N)`` runs before ``schedule()`` of N+1
(``AsyncScheduler`` lifts it). The request books are kept the same way in both modes, so the
invariants of docs/design.md §2.3 hold at every instant: while a step is in flight its sampled
positions are output placeholders, and its drafts are ``-1`` (they live on the device).
"""

from __future__ import annotations

import bisect
import operator
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import chain
from typing import ClassVar, cast

import numpy as np

from engine.config import CacheConfig, ConfigError, SchedulerConfig
from engine.request import Request, RequestStatus
from engine.scheduler.invariants import check_request_books, check_running_books
from engine.scheduler.kv_cache_manager import KVCacheManager
from engine.scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from engine.scheduler.request_output import RequestOutput, SchedulerStats, StopStringChecker
from engine.scheduler.request_queues import RequestQueues
from engine.scheduler.running_books import RunningBooks
from engine.scheduler.step_outputs import StepOutputs
from engine.scheduler.step_plan import InFlightStep, StepPlan
from engine.scheduler.stop_conditions import check_stop

__all__ = ["Scheduler", "SchedulerConfig", "check_limits"]

_req_id_of = operator.attrgetter("req_id")
_output_ids_of = operator.attrgetter("output_token_ids")
_spec_of = operator.attrgetter("spec_token_ids")
# What ``Scheduler._steady_decodes`` makes of each running request.
_GENERAL, _PLAIN, _SPEC = 0, 1, 2


def check_limits(config: SchedulerConfig, cache: CacheConfig, num_spec_tokens: int) -> None:
    """What a scheduler needs across its parts (each part checked its own fields): a resolved
    ``max_model_len`` that one decode step, one step's budget and the KV pool can hold, and a
    resolved ``max_num_seqs``. Raises :class:`ConfigError` (a ValueError) naming the problem."""
    config.resolved_max_num_seqs  # noqa: B018 (raises when not resolved)
    max_model_len = config.resolved_max_model_len
    num_blocks = cache.resolved_num_kv_blocks
    if num_spec_tokens < 0:
        raise ConfigError(f"num_spec_tokens must be >= 0, got {num_spec_tokens}")
    if config.max_num_batched_tokens < 1 + num_spec_tokens:
        raise ConfigError(
            f"max_num_batched_tokens={config.max_num_batched_tokens} cannot hold one decode step"
            f" with {num_spec_tokens} spec tokens"
        )
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        raise ConfigError(
            f"without chunked prefill max_num_batched_tokens ({config.max_num_batched_tokens})"
            f" must be >= max_model_len ({max_model_len}) so every prompt fits one step"
        )
    if num_blocks * cache.block_size < max_model_len:
        raise ConfigError(
            f"{num_blocks} blocks of {cache.block_size} slots cannot hold one request"
            f" of max_model_len={max_model_len}"
        )


class Scheduler:
    """Owns every request's books and the KV block pool (through ``KVCacheManager``)."""

    allows_overlapping_steps: ClassVar[bool] = False
    # Plan steady speculative decodes as columns (``_plan_spec_decodes``); off, the general
    # path plans them one at a time (the tests compare the two).
    spec_fast_path: bool = True

    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheConfig,
        stop_string_checker: StopStringChecker | None = None,
        *,
        num_spec_tokens: int = 0,
    ) -> None:
        """``config``: the engine config's scheduler part, ``max_model_len`` resolved; ``cache``:
        its KV cache part; ``num_spec_tokens``: lookahead slots per request (0 without
        speculation)."""
        check_limits(config, cache, num_spec_tokens)
        self.config = config
        self.cache = cache
        self.max_model_len = config.resolved_max_model_len
        self.max_num_seqs = config.resolved_max_num_seqs
        self.num_spec_tokens = num_spec_tokens
        self.kv_cache_manager = KVCacheManager(
            cache.resolved_num_kv_blocks, cache.block_size, cache.enable_prefix_caching
        )
        self._stop_string_checker = stop_string_checker
        self._queues = RequestQueues()
        # The running requests' counters, as columns (docs/design.md §2.3; running_books.py).
        self._books = RunningBooks(self.max_num_seqs)
        self._slots_cache: tuple[int, np.ndarray] | None = None  # (queues version, slots)
        self._in_flight: deque[InFlightStep] = deque()
        self._next_step = 0
        # Σ num_output_placeholders over every request, kept as they change (get_stats runs
        # every traced step: summing over all live requests there cost O(requests) per step).
        self._num_placeholders = 0
        self._num_preemptions = 0
        self._num_prefix_hit_tokens = 0
        self._last_accepted = 0
        self._last_batch_tokens = 0

    # -- requests in and out -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request; it is scheduled at the next ``schedule()`` at the earliest."""
        if self._queues.get(request.req_id) is not None:
            raise ValueError(f"request {request.req_id!r} already exists")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"request {request.req_id!r}: prompt of {request.num_prompt_tokens} tokens leaves"
                f" no room for output within max_model_len={self.max_model_len}"
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
            self._in_flight.append(self._after_schedule(plan))
        self._check_invariants_if_debug()
        return output

    def _schedule_running(self, plan: StepPlan) -> None:
        running = self._queues.running
        slots, kind, needs_block, num_new = self._steady_decodes(running)
        # Where a run of one kind ends, and an end marker: a run of steady decodes at ``index``
        # ends at the first change of kind after it. (A Python list and bisect: NumPy's
        # searchsorted releases the GIL, and on the CPU device taking it back from the device's
        # worker thread costs up to a switch interval.)
        if num_new is None:  # no speculative decode: a run ends at the next general request
            breaks = np.flatnonzero(~kind).tolist()
        else:
            breaks = (np.flatnonzero(kind[1:] != kind[:-1]) + 1).tolist()
        breaks.append(len(running))
        kinds = kind.tolist()
        index = 0
        while index < len(running) and plan.token_budget > 0:
            run_kind = kinds[index]
            if run_kind:
                # (Preemptions may have shortened ``running`` since ``breaks`` was found.)
                next_break = min(len(running), breaks[bisect.bisect_right(breaks, index)])
                if run_kind == _PLAIN:
                    end = min(next_break, index + plan.token_budget)
                    end, run_blocks = self._decode_blocks(running, needs_block, index, end)
                    if end > index:
                        self._plan_decodes(plan, running[index:end], slots[index:end], run_blocks)
                        index = end
                        continue
                else:
                    end = self._plan_spec_decodes(plan, running, slots, num_new, index, next_break)
                    if end > index:
                        index = end
                        continue
                # The budget or the pool cannot give this request its tokens or blocks: the
                # general path (which may trim its drafts or preempt) plans it.
            request = running[index]
            num_new_tokens, spec_tokens, num_pending = self._num_new_tokens(
                request, plan.token_budget
            )
            if num_new_tokens <= 0:  # every token it may still produce is already in flight
                index += 1
                continue
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_blocks is None:
                new_blocks = self._make_room(request, num_new_tokens, plan)
            if request.status is not RequestStatus.RUNNING:
                continue  # it was its own victim; the list shrank under index
            index += 1
            if new_blocks is not None:
                plan.add(request, num_new_tokens, spec_tokens, num_pending)
                plan.add_cached(request, new_blocks)

    def _steady_decodes(
        self, running: list[Request]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """Each running request's slot, its kind (``_GENERAL``; ``_PLAIN``: a steady decode,
        one pending token, no drafts, room for an output; ``_SPEC``: a steady speculative decode,
        one pending token and its drafts), which plain ones start a block (their frontier is a
        multiple of the block size: the next position may need a new block; every other one's
        block is held, since every computed token has a KV slot), and the tokens each steady
        request schedules (None without speculation: one each). With speculation only plain
        frontiers inside a block count (the general path gives a sampling request its ``-1``
        drafts). A speculative decode schedules its pending token and its drafts, trimmed as
        ``_num_new_tokens`` trims them (room for outputs, the long-prefill threshold; the token
        budget is applied per run; the kinds are a bool array, True for ``_PLAIN``, when none is
        ``_SPEC``). Preemptions later in the step only shorten ``running`` from its end, so the
        arrays stay aligned."""
        books = self._books
        slots = self._running_slots(running)  # [num_running]
        num_computed = books.num_computed[slots]
        num_placeholders = books.num_placeholders[slots]
        num_outputs = books.num_output[slots] + num_placeholders  # committed and in flight
        num_tokens = books.num_prompt[slots] + num_outputs
        max_tokens = books.max_tokens[slots]
        has_drafts = books.has_drafts[slots]
        decode = (
            (num_tokens - num_computed == 1)
            & (num_outputs < max_tokens)
            & (num_tokens < self.max_model_len)
        )
        steady = decode & ~has_drafts
        needs_block = steady & (num_computed % self.cache.block_size == 0)
        num_new: np.ndarray | None = None
        if self.num_spec_tokens:
            steady &= ~needs_block
        kind = steady  # False: _GENERAL, True: _PLAIN (no speculative decode)
        if self.num_spec_tokens and self.spec_fast_path:
            spec = decode & has_drafts
            if spec.any():
                kind = steady.astype(np.int8)
                # ``_num_new_tokens``: room = min(max_tokens - outputs, max_model_len - tokens),
                # counting placeholders; drafts = min(len(drafts), room - 1), then the threshold.
                room = np.minimum(max_tokens - num_outputs, self.max_model_len - num_tokens)
                num_drafts = np.fromiter(map(len, map(_spec_of, running)), np.int64, len(running))
                num_new = 1 + np.minimum(num_drafts, room - 1)
                threshold = self.config.long_prefill_token_threshold
                if threshold > 0:
                    np.minimum(num_new, threshold, out=num_new)
                kind[spec] = _SPEC
        return slots, kind, needs_block, num_new

    def _running_slots(self, running: list[Request]) -> np.ndarray:
        """The running requests' slots, looked up again only after ``running`` changed."""
        version = self._queues.version
        if self._slots_cache is None or self._slots_cache[0] != version:
            slots = self._books.slots_of(running)
            slots.flags.writeable = False
            self._slots_cache = (version, slots)
        return self._slots_cache[1]

    def _decode_blocks(
        self, running: list[Request], needs_block: np.ndarray, index: int, end: int
    ) -> tuple[int, list[list[int]] | None]:
        """The next blocks of the steady decodes in ``running[index:end]`` that start a block,
        all taken at once (in order, as one request at a time would take them). When the pool
        cannot supply them all, the run ends before the first such request (nothing taken).
        Returns the run's end and, per request of the run, its new block ids (None: none)."""
        positions = np.flatnonzero(needs_block[index:end])
        if not positions.size:
            return end, None
        requests = [running[index + p] for p in positions.tolist()]
        taken = self.kv_cache_manager.allocate_next_blocks(requests)
        if taken is None:
            return index + int(positions[0]), None
        new_blocks: list[list[int]] = [[]] * (end - index)  # one shared, read-only empty list
        for position, block_ids in zip(positions.tolist(), taken, strict=True):
            new_blocks[position] = block_ids
        return end, new_blocks

    def _plan_decodes(
        self,
        plan: StepPlan,
        requests: list[Request],
        slots: np.ndarray,
        new_blocks: list[list[int]] | None,
    ) -> None:
        """Plan steady decodes (``_steady_decodes``) and advance their books at once, as
        ``_after_schedule`` would for one sampled token: no later decision of this step reads
        them (victims come from the end of running). ``new_blocks``: per request, the block ids
        ``_decode_blocks`` took for it (None: none for any)."""
        books = self._books
        num_computed = books.num_computed[slots]  # [n], before this step
        req_ids = list(map(_req_id_of, requests))
        plan.add_decodes(req_ids, num_computed.tolist(), new_blocks)
        plan.decode_runs.append((requests, slots))
        books.num_computed[slots] = num_computed + 1
        books.num_placeholders[slots] += 1
        books.num_in_flight[slots] += 1

    def _plan_spec_decodes(
        self,
        plan: StepPlan,
        running: list[Request],
        slots: np.ndarray,
        num_new: np.ndarray | None,
        index: int,
        end: int,
    ) -> int:
        """Plan the steady speculative decodes ``running[index:end]`` (``_steady_decodes``) that
        the token budget and the pool allow, and advance their books at once, as
        ``_after_schedule`` would: each schedules ``num_new`` tokens (its pending token and
        ``num_new - 1`` drafts), samples as many slots and gets fresh ``-1`` drafts. The run
        stops before the first request the budget cannot hold whole (the general path trims
        it) and, when the pool cannot give every request the blocks its new tokens need (taken
        at once, in order, all or nothing), before the first that needs one. Returns the run's
        end."""
        assert num_new is not None
        counts = num_new[index:end]
        budget_end = bisect.bisect_right(np.cumsum(counts).tolist(), plan.token_budget)
        if budget_end == 0:
            return index
        end = index + budget_end
        counts = counts[:budget_end]
        run_slots = slots[index:end]
        requests = running[index:end]
        books = self._books
        num_computed = books.num_computed[run_slots]  # [n], before this step
        req_ids = list(map(_req_id_of, requests))
        # Only a request whose new tokens cross into a block its computed ones do not reach may
        # need one (every computed token has a KV slot; a rolled-back verify may hold more).
        size = self.cache.block_size
        num_after = num_computed + counts
        crossing = np.flatnonzero(-(-num_after // size) > -(-num_computed // size)).tolist()
        new_blocks: list[list[int]] | None = None
        if crossing:
            kv = self.kv_cache_manager
            crossing_ids = [req_ids[i] for i in crossing]
            needs = kv.next_blocks_needed(crossing_ids, num_after[crossing].tolist())
            needing = [(i, need) for i, need in zip(crossing, needs, strict=True) if need]
            if needing:
                taken = kv.take_blocks([requests[i] for i, _ in needing], [n for _, n in needing])
                if taken is None:  # before the first that needs one: nothing taken
                    end = index + needing[0][0]
                    if end == index:
                        return index
                    return self._plan_spec_decodes(plan, running, slots, num_new, index, end)
                new_blocks = [[]] * len(requests)  # one shared, read-only empty list
                for (i, _), block_ids in zip(needing, taken, strict=True):
                    new_blocks[i] = block_ids
        count_list = counts.tolist()
        spec_tokens = {
            req_id: request.spec_token_ids[: count - 1]
            for req_id, request, count in zip(req_ids, requests, count_list, strict=True)
            if count > 1
        }
        plan.add_spec_decodes(req_ids, count_list, num_computed.tolist(), new_blocks, spec_tokens)
        plan.decode_runs.append((requests, run_slots))
        books.num_computed[run_slots] = num_computed + counts
        books.num_placeholders[run_slots] += counts
        books.num_in_flight[run_slots] += 1
        num_spec_tokens = self.num_spec_tokens
        for request in requests:  # the device proposes the next drafts right after sampling
            request.spec_token_ids = [-1] * num_spec_tokens
        return end

    def _num_new_tokens(self, request: Request, token_budget: int) -> tuple[int, list[int], int]:
        """Tokens to schedule for a running request, the drafts among them, and its
        ``num_pending_tokens``.

        Pending tokens (known, or sampled and still on the device) come first; drafts only if the
        step reaches the end. Drafts are trimmed so the step can never produce a token beyond
        ``max_tokens`` or ``max_model_len``, counting outputs still in flight.
        """
        # Runs for every running request every step: the request's counts are read once each.
        num_output = len(request.output_token_ids)
        num_placeholders = request.num_output_placeholders
        num_tokens = request.num_prompt_tokens + num_output
        num_pending = num_tokens + num_placeholders - request.num_computed_tokens
        room = min(
            request.sampling_params.max_tokens - num_output - num_placeholders,
            self.max_model_len - num_tokens - num_placeholders,
        )
        if room <= 0 or num_pending <= 0:
            return 0, [], num_pending
        spec_token_ids = request.spec_token_ids
        if not spec_token_ids:  # no drafts to verify (or trim): only the pending tokens
            return self._cap_chunk(num_pending, token_budget), [], num_pending
        num_spec = min(len(spec_token_ids), room - 1)
        num_new = self._cap_chunk(num_pending + num_spec, token_budget)
        num_spec = max(0, num_new - num_pending)
        return num_new, spec_token_ids[:num_spec], num_pending

    def _cap_chunk(self, num_new: int, token_budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            num_new = min(num_new, threshold)
        return min(num_new, token_budget)

    def _make_room(self, request: Request, num_new: int, plan: StepPlan) -> list[int] | None:
        """Blocks for the request's step once the pool alone could not supply them: preempt the
        newest running requests until it can.

        A victim with a step in flight keeps its blocks until that step settles; the request then
        waits one step for them (None) rather than preempting more victims.
        """
        while True:
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
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks

    def _preempt(self, request: Request, plan: StepPlan) -> int:
        """Preempt by recompute: back to the front of the queue with only its committed tokens.
        Returns how many blocks will come back once its in-flight steps settle (0 if freed now)."""
        self._queues.preempt(request)
        self._books.release(request)
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
            if len(self._queues.running) >= self.max_num_seqs:
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
            plan.add(request, num_new, [], request.num_pending_tokens)
            plan.add_new(request, self.kv_cache_manager.block_ids(request.req_id))

    def _admit(self, request: Request, num_hit: int) -> None:
        self._queues.admit(request)
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        self._books.adopt(request, self.kv_cache_manager.num_cached_blocks(request.req_id))
        self._num_prefix_hit_tokens += num_hit

    def _after_schedule(self, plan: StepPlan) -> InFlightStep:
        """Advance the frontier of each request planned by ``plan.add`` and note what the step
        will sample (``add_decodes``' requests were advanced as they were planned)."""
        record = InFlightStep(step=plan.step, num_sampled_slots=plan.num_sampled_slots)
        if not plan.requests and len(plan.decode_runs) == 1:  # one run of steady decodes
            record.requests, record.slots = plan.decode_runs[0]
            record.queues_version = self._queues.version
        num_sampled_slots = record.num_sampled_slots
        num_scheduled_tokens = plan.num_scheduled_tokens
        spec_tokens = plan.spec_tokens
        num_spec_tokens = self.num_spec_tokens
        total_slots = plan.num_decode_slots
        for request in plan.requests:
            num_computed = request.num_computed_tokens + num_scheduled_tokens[request.req_id]
            request.num_computed_tokens = num_computed
            request.num_steps_in_flight += 1
            num_placeholders = request.num_output_placeholders
            num_known = request.num_prompt_tokens + len(request.output_token_ids)
            if num_computed >= num_known + num_placeholders:  # it samples
                num_slots = 1 + len(spec_tokens.get(request.req_id, ())) if spec_tokens else 1
                if num_spec_tokens:  # the device proposes the next drafts right after sampling
                    request.spec_token_ids = [-1] * num_spec_tokens
            else:
                num_slots = 0
            num_sampled_slots[request.req_id] = num_slots
            request.num_output_placeholders = num_placeholders + num_slots
            total_slots += num_slots
        self._num_placeholders += total_slots
        return record

    # -- update --------------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> Sequence[RequestOutput]:
        """Commit what step N returned (outputs must come back in schedule order): append tokens,
        roll back rejected drafts, apply stop conditions, free finished requests.

        Returns the step's outputs in schedule order; a step without drafts or logprobs returns
        a :class:`StepOutputs` (its running one-token outputs kept as columns)."""
        if not scheduler_output.num_scheduled_tokens:
            return []
        if not self._in_flight or self._in_flight[0].step != scheduler_output.step:
            raise RuntimeError(
                f"output of step {scheduler_output.step} is not the oldest in flight"
            )
        if runner_output.step != scheduler_output.step:
            raise ValueError(f"runner output step {runner_output.step} != {scheduler_output.step}")
        record = self._in_flight.popleft()
        self._last_accepted = 0
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        all_sampled, all_logprobs = runner_output.sampled_token_ids, runner_output.logprobs
        rows = self._output_rows(record, runner_output)
        if not spec_tokens and not all_logprobs and isinstance(rows, range):
            # No drafts and no logprobs, the runner kept schedule order: the columnar commit.
            if (
                record.requests is not None
                and record.slots is not None
                and record.queues_version == self._queues.version
            ):
                requests, slots = record.requests, record.slots
            else:
                requests = self._tracked(record.num_sampled_slots)
                slots = self._books.slots_of(requests)  # -1: no longer running
            step_outputs = self._commit_plain_step(record, requests, slots, all_sampled)
            self._check_invariants_if_debug()
            return step_outputs
        requests = self._tracked(record.num_sampled_slots)
        outputs: list[RequestOutput] = []
        for request, num_slots, row in zip(
            requests, record.num_sampled_slots.values(), rows, strict=True
        ):
            request.num_steps_in_flight -= 1
            sampled = all_sampled[row] if row is not None else []
            req_id = request.req_id
            logprobs = all_logprobs[row] if all_logprobs and row is not None else None
            num_drafts = len(spec_tokens.get(req_id, ())) if spec_tokens else 0
            output = self._commit(request, num_drafts, num_slots, sampled, logprobs)
            if output is not None:
                outputs.append(output)
            # Skipped while a later step references the request: take_release would refuse.
            if request.num_steps_in_flight == 0:
                self._release_if_idle(request)
        self._check_invariants_if_debug()
        return outputs

    def _commit_plain_step(
        self,
        record: InFlightStep,
        requests: list[Request],
        slots: np.ndarray,
        all_sampled: list[list[int]],
    ) -> StepOutputs:
        """``update_from_output`` of a step without drafts or logprobs, as columns.

        A *plain* row (a running request with one sampled slot that got its one token) has its
        counters settled and its token appended with array operations. Python work is left to
        the rows a token can end (EOS, a stop token id, a length cap, stop strings or
        ``min_tokens``: ``check_stop`` then runs as before), rows whose confirmed frontier fills
        a block for the prefix cache, and the other rows (prefill chunks, requests finished or
        preempted while the step was in flight), which take ``_commit``: all of these in row
        order, so finishes and the prefix cache see the order the loop of one request at a time
        would give. ``slots``: ``[n]``, each request's running-book slot (-1: not running)."""
        books = self._books
        num_rows = len(requests)
        # Without drafts a row has 0 or 1 sampled slots: the sums (and no empty row, so that a
        # runner returning two tokens for a row and none for another still gets ``_commit``'s
        # error) tell whether every row has one slot and one token (the steady step) without a
        # Python loop.
        flat: list[int] = list(chain.from_iterable(all_sampled))  # the sampled tokens
        num_slots_total = sum(record.num_sampled_slots.values())
        if len(flat) == num_rows and num_slots_total == num_rows and all(all_sampled):
            plain = slots >= 0  # [n]
        else:
            num_slots = np.fromiter(record.num_sampled_slots.values(), np.int64, num_rows)
            num_sampled = np.fromiter(map(len, all_sampled), np.int64, num_rows)
            plain = (slots >= 0) & (num_slots == 1) & (num_sampled == 1)
        plain_rows = np.flatnonzero(plain)  # [p]
        all_plain = plain_rows.shape[0] == num_rows
        if all_plain:
            token_list = flat  # [p], the one sampled token of each plain row
        else:
            token_list = [all_sampled[row][0] for row in plain_rows.tolist()]
        tokens = np.array(token_list, np.int64)  # [p]
        ps = slots[plain_rows]  # [p]
        books.num_in_flight[ps] -= 1
        books.num_placeholders[ps] -= 1
        num_output = books.num_output[ps] + 1
        books.num_output[ps] = num_output
        self._num_placeholders -= plain_rows.shape[0]
        plain_requests = requests if all_plain else [requests[i] for i in plain_rows.tolist()]
        deque(map(list.append, map(_output_ids_of, plain_requests), token_list), maxlen=0)
        # The rows a token may end: the stop check's own conditions, as array compares.
        needs_stop = (
            books.always_check[ps]
            | (tokens == books.eos[ps])
            | (num_output >= books.max_tokens[ps])
            | (books.num_prompt[ps] + num_output >= self.max_model_len)
        )
        if books.num_with_stop_ids:
            needs_stop |= (books.stop_ids[ps] == tokens[:, None]).any(axis=1)
        needs_python = ~plain  # [n]
        stop_row = np.zeros(num_rows, np.bool_)
        stop_row[plain_rows] = needs_stop
        cache_row = np.zeros(num_rows, np.bool_)
        if self.kv_cache_manager.enable_caching:
            frontier = books.num_computed[ps] - books.num_placeholders[ps]
            cache_row[plain_rows] = frontier // self.cache.block_size > books.num_cached_blocks[ps]
        needs_python |= stop_row | cache_row
        explicit: list[RequestOutput] = []
        explicit_rows: list[int] = []
        num_cached = books.num_cached_tokens[ps]  # [p], read before any release
        finished_plain: list[int] = []  # indices into plain_rows
        python_rows: list[int] = np.flatnonzero(needs_python).tolist()
        if python_rows:
            plain_index = np.cumsum(plain) - 1  # [n]: a plain row's index into plain_rows
        for row in python_rows:
            request = requests[row]
            if plain[row]:
                self._settle_plain(request, bool(stop_row[row]), bool(cache_row[row]))
                status = request.status
                if status is not RequestStatus.RUNNING:
                    index = int(plain_index[row])
                    finished_plain.append(index)
                    self._finish(request)
                    explicit.append(
                        RequestOutput(
                            request.req_id,
                            [token_list[index]],
                            True,
                            status.finish_reason,
                            request.stop_reason,
                            0,
                            0,
                            int(num_cached[index]),
                        )  # fmt: skip
                    )
                    explicit_rows.append(row)
                continue
            request.num_steps_in_flight -= 1
            num_slots_row = record.num_sampled_slots[request.req_id]
            output = self._commit(request, 0, num_slots_row, all_sampled[row], None)
            if output is not None:
                explicit.append(output)
                explicit_rows.append(row)
            if request.num_steps_in_flight == 0:
                self._release_if_idle(request)
        req_ids = list(record.num_sampled_slots)
        if all_plain and not finished_plain:
            return StepOutputs(explicit, explicit_rows, req_ids, token_list, list(range(num_rows)), num_cached)  # fmt: skip
        keep = np.ones(plain_rows.shape[0], np.bool_)
        keep[finished_plain] = False
        kept = np.flatnonzero(keep).tolist()
        kept_rows = plain_rows[keep].tolist()
        return StepOutputs(
            explicit,
            explicit_rows,
            [req_ids[row] for row in kept_rows],
            [token_list[i] for i in kept],
            kept_rows,
            num_cached[keep],
        )

    def _settle_plain(self, request: Request, check: bool, cache: bool) -> None:
        """The Python share of a plain row's commit (counters and token already settled)."""
        if check:
            check_stop(request, self.max_model_len, self._stop_string_checker)
        if cache:
            self._cache_full_blocks(request, request.confirmed_frontier)

    def _cache_full_blocks(self, request: Request, num_confirmed_tokens: int) -> None:
        """``KVCacheManager.cache_full_blocks``, keeping the running books' copy of the count."""
        kv = self.kv_cache_manager
        kv.cache_full_blocks(request, num_confirmed_tokens)
        if request.slot >= 0:
            self._books.num_cached_blocks[request.slot] = kv.num_cached_blocks(request.req_id)

    @staticmethod
    def _output_rows(
        record: InFlightStep, runner_output: ModelRunnerOutput
    ) -> Sequence[int | None]:
        """The row of each of the step's requests (in record order) in the runner output; None
        for a request the runner did not return."""
        req_ids = list(record.num_sampled_slots)
        if runner_output.req_ids == req_ids:  # the runner kept schedule order: no lookup
            return range(len(req_ids))
        row_of = {req_id: row for row, req_id in enumerate(runner_output.req_ids)}
        return [row_of.get(req_id) for req_id in req_ids]

    def _commit(
        self,
        request: Request,
        num_drafts: int,
        num_slots: int,
        sampled: list[int],
        logprobs: list[list[tuple[int, float]]] | None,
    ) -> RequestOutput | None:
        """Settle one request's share of a returned step (``num_drafts`` of its ``num_slots``
        sampled slots were drafts to verify); None when there is nothing to report."""
        request.num_output_placeholders -= num_slots
        self._num_placeholders -= num_slots
        status = request.status
        if status.is_finished:
            return None  # finished while this step was in flight: computed, never returned
        if not (num_slots == 0 and not sampled) and not 1 <= len(sampled) <= num_slots:
            raise ValueError(
                f"request {request.req_id!r}: runner returned {len(sampled)} tokens for a step with"
                f" {num_slots} sampled slots"
            )
        num_accepted = len(sampled) - 1 if num_drafts and sampled else 0
        was_running = status is RequestStatus.RUNNING
        if was_running:
            request.num_computed_tokens -= num_drafts - num_accepted
        self._last_accepted += num_accepted
        if len(sampled) == 1:  # the common case: commit one token without the loop
            request.output_token_ids.append(sampled[0])
            check_stop(request, self.max_model_len, self._stop_string_checker)
            new_token_ids = [sampled[0]]
        else:
            new_token_ids = self._append_tokens(request, sampled)
        if request.slot >= 0:
            self._books.num_output[request.slot] = len(request.output_token_ids)
        if was_running:
            self._cache_full_blocks(request, request.confirmed_frontier)
        status = request.status  # a stop condition may have finished it
        finished = status.is_finished
        if finished:
            self._finish(request)
        elif not new_token_ids:
            return None
        return RequestOutput(
            req_id=request.req_id,
            new_token_ids=new_token_ids,
            finished=finished,
            finish_reason=status.finish_reason if finished else None,
            stop_reason=request.stop_reason,
            num_draft_tokens=num_drafts,
            num_accepted=num_accepted,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            new_logprobs=self._own_logprobs(request, logprobs, len(new_token_ids)),
        )

    @staticmethod
    def _own_logprobs(
        request: Request, logprobs: list[list[tuple[int, float]]] | None, num_tokens: int
    ) -> list[list[tuple[int, float]]] | None:
        """The request's share of the step's logprobs: the runner computes the batch's largest
        ``k`` for every row, so a request gets its own ``k + 1`` columns (sampled token, top-k),
        and none when it asked for none."""
        k = request.sampling_params.logprobs
        if k is None or logprobs is None:
            return None
        return [row[: k + 1] for row in logprobs[:num_tokens]]

    def _append_tokens(self, request: Request, sampled: list[int]) -> list[int]:
        """Commit tokens one by one until a stop condition ends the request; returns a new list
        of the tokens committed.

        A verify's tokens (accepted drafts + bonus) none of which can end the request (no EOS or
        stop id among them, no length cap reached by the last, no stop strings or min_tokens)
        are committed at once: no per-token stop check, so the cost does not grow with ``k``."""
        output_token_ids = request.output_token_ids
        params = request.sampling_params
        num_output = len(output_token_ids) + len(sampled)
        if (
            not request.has_extra_stop_conditions
            and num_output < params.max_tokens
            and request.num_prompt_tokens + num_output < self.max_model_len
            and (params.ignore_eos or request.eos_token_id not in sampled)
            and not (params.stop_token_ids and any(t in params.stop_token_ids for t in sampled))
        ):
            output_token_ids.extend(sampled)
            return sampled[:]
        num_committed = 0
        for token_id in sampled:
            output_token_ids.append(token_id)
            num_committed += 1
            if check_stop(request, self.max_model_len, self._stop_string_checker):
                break
        return output_token_ids[len(output_token_ids) - num_committed :]

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Sync mode with a CPU proposer: replace the ``-1`` drafts with real ones (at most
        ``num_spec_tokens`` each). The async path keeps drafts on the device."""
        for req_id, drafts in draft_token_ids.items():
            request = self._queues.get(req_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            request.spec_token_ids = list(drafts[: self.num_spec_tokens])

    # -- finishing and releasing ---------------------------------------------------------------
    def _finish(self, request: Request) -> None:
        self._queues.finish(request)
        self._books.release(request)
        request.spec_token_ids = []
        self._release_if_idle(request)

    def _tracked(self, req_ids: Iterable[str]) -> list[Request]:
        """The requests a step in flight references: tracked until that step settles."""
        requests = self._queues.get_many(req_ids)
        if None in requests:  # one check for the whole step
            released = [req_id for req_id, r in zip(req_ids, requests, strict=True) if r is None]
            raise AssertionError(f"requests {released} released while a step references them")
        return cast("list[Request]", requests)

    def _release_if_idle(self, request: Request) -> None:
        """Give the blocks back once no step in flight references the request."""
        if self._queues.take_release(request):
            self.kv_cache_manager.free(request)

    # -- observability -------------------------------------------------------------------------
    @property
    def next_step(self) -> int:
        """The number the next ``schedule()`` call gives its step."""
        return self._next_step

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            running_requests=len(self._queues.running),
            waiting_requests=len(self._queues.waiting),
            kv_usage=self.kv_cache_manager.usage,
            output_placeholders=self._num_placeholders,
            accepted_tokens=self._last_accepted,
            batch_tokens=self._last_batch_tokens,
            num_preemptions=self._num_preemptions,
            prefix_cache_hit_tokens=self._num_prefix_hit_tokens,
        )

    def counter_values(self) -> tuple[int, int, float, int, int, int]:
        """The trace's per-step counters in ``instrument.schema.Counter`` order (running, waiting,
        kv_usage, output_placeholders, accepted_tokens, batch_tokens): :meth:`get_stats`'s values
        without building a ``SchedulerStats`` each step (the engine's tracing hot path)."""
        queues = self._queues
        return (
            len(queues.running),
            len(queues.waiting),
            self.kv_cache_manager.usage,
            self._num_placeholders,
            self._last_accepted,
            self._last_batch_tokens,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if any book disagrees with another (debug; O(requests + blocks))."""
        self._queues.check(self.max_num_seqs)
        total = sum(r.num_output_placeholders for r in self._queues)
        assert self._num_placeholders == total, (
            f"placeholder total {self._num_placeholders} != {total}"
        )
        for request in self._queues:
            check_request_books(request, self.kv_cache_manager, self._in_flight)
            check_running_books(request, self._books, self.kv_cache_manager)
        self.kv_cache_manager.check_consistency()

    def _check_invariants_if_debug(self) -> None:
        if self.config.debug_invariants:
            self.check_invariants()
