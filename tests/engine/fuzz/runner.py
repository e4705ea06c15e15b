"""Run one scenario on a real ``EngineCore`` and check the books inside and after every step.

The loop is ``LLM.run_workload``'s with time replaced by the iteration count, so a seed replays
exactly: requests arrive at their iteration, aborts fire at an iteration or when the request
reaches a state, then one ``run_step()`` (sync ``step()`` or async ``step_with_batch_queue()``).

Right after every ``schedule()`` and every ``update_from_output()`` (inside a step, where the
async races live) and after every iteration: the scheduler's own ``check_invariants()``
(docs/design.md §1), then an independent check of the five books and of what the user saw:

* tokens (after an iteration): what the user received for a live request equals its
  ``output_token_ids`` (no token lost, none duplicated); nothing arrives after a request's final
  output; logprobs only when asked for, ``k + 1`` per token;
* placeholders: never negative, zero with no step in flight, and ``committed + placeholders <=
  max_tokens`` (``max_tokens`` never costs an extra step);
* drafts: ``spec_token_ids`` at most ``num_spec_tokens``, all ``-1`` (they live on the device),
  none unless running;
* frontier: ``0 <= num_computed_tokens - num_output_placeholders <= num_tokens``, and
  ``num_computed_tokens <= num_tokens + placeholders`` and within the request's KV slots;
* KV: every block is free or referenced, each block's reference count is the number of live
  requests holding it, and no request holds a block twice.
At the end: nothing queued, no placeholder, every block free, every request finished once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.llm import _StopStrings
from engine.request import Request, RequestStatus
from engine.scheduler.request_output import RequestOutput
from tests.engine.fuzz.scenario import RequestSpec, Scenario
from tests.engine.fuzz.world import World, cached_models

__all__ = ["RunResult", "run_scenario", "ScenarioFailure"]

MAX_ITERATIONS = 2_000


class ScenarioFailure(AssertionError):
    """A broken invariant or a wrong output, with what the run was doing."""


@dataclass
class RunResult:
    label: str
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, str | None] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)  # aborted by the scenario (not by the engine)
    abort_states: Counter[str] = field(default_factory=Counter)  # where the aborts landed
    num_logprobs: Counter[str] = field(default_factory=Counter)  # logprob entries per request
    events: Counter[str] = field(default_factory=Counter)  # races reached (preempted in flight...)
    num_steps: int = 0
    num_preemptions: int = 0
    num_prefix_hit_tokens: int = 0
    num_drafts: int = 0
    num_accepted: int = 0


def run_scenario(
    scenario: Scenario,
    world: World,
    *,
    async_on: bool,
    speculate: bool = True,
    aborts: bool = True,
    reference: bool = False,
    threaded: bool = False,
) -> RunResult:
    """Run ``scenario``; ``reference``: one roomy synchronous engine without speculation;
    ``threaded``: the real worker-thread CPU device (default: inline, exactly replayable)."""
    engine_fields = dict(scenario.engine)
    if not speculate or reference:
        engine_fields.update(spec_method=None, num_spec_tokens=0, spec_model=None)
    if reference:
        engine_fields.update(
            num_kv_blocks=4 * engine_fields["num_kv_blocks"],
            max_num_batched_tokens=512,
            enable_chunked_prefill=True,
            enable_prefix_caching=False,
            max_num_seqs=8,
        )
    label = "reference" if reference else f"async={async_on} spec={engine_fields['spec_method']}"
    config = EngineConfig.from_flat(
        model_config="fuzz:target",
        random_weights=True,
        async_scheduling=async_on and not reference,
        triton_kernels=False,
        debug_invariants=False,  # the observer checks them at the same points
        **engine_fields,
    )
    with cached_models(threaded):
        engine = EngineCore(config, None, _StopStrings(world.tokenizer), tokenizer=world.tokenizer)
        try:
            return _Drive(engine, scenario, label, aborts and not reference).run()
        finally:
            engine.close()


class _Drive:
    def __init__(self, engine: EngineCore, scenario: Scenario, label: str, aborts: bool) -> None:
        self.engine = engine
        self.scenario = scenario
        self.specs = {r.req_id: r for r in scenario.requests}
        self.aborts = aborts
        self.result = RunResult(label)
        self.added: set[str] = set()
        self.iteration = 0
        self._observe_scheduler()

    def _observe_scheduler(self) -> None:
        """Check the books also between ``schedule()`` and ``update_from_output()`` (inside a
        step, where the async races live), and count the races the run reached."""
        scheduler = self.engine.scheduler
        schedule, update = scheduler.schedule, scheduler.update_from_output
        events = self.result.events

        def observed_schedule() -> Any:
            live = [scheduler.get_request(r) for r in self.added]
            before = {r.req_id: (r.num_preemptions, r.num_output_placeholders) for r in live if r}
            out = schedule()
            for req_id, (num_preemptions, placeholders) in before.items():
                request = scheduler.get_request(req_id)
                if request is not None and request.num_preemptions > num_preemptions:
                    events["preempted"] += 1
                    if placeholders:
                        events["preempted_in_flight"] += 1
                    if placeholders > 1:
                        events["preempted_with_drafts_in_flight"] += 1
            self._check_books()
            return out

        def observed_update(so: Any, runner_out: Any) -> list[RequestOutput]:
            outputs = update(so, runner_out)
            for o in outputs:
                request = scheduler.get_request(o.req_id)
                if o.finished and request is not None and request.num_steps_in_flight:
                    events[f"finished_{o.finish_reason}_with_next_step_in_flight"] += 1
            self._check_books()
            return outputs

        scheduler.schedule = observed_schedule  # type: ignore[method-assign]
        scheduler.update_from_output = observed_update  # type: ignore[method-assign]

    def fail(self, message: str) -> None:
        raise ScenarioFailure(f"[{self.result.label}, iteration {self.iteration}] {message}")

    def run(self) -> RunResult:
        last_arrival = max(r.arrival for r in self.scenario.requests)
        engine = self.engine
        for self.iteration in range(MAX_ITERATIONS):
            for spec in self.scenario.requests:
                if spec.arrival == self.iteration:
                    self._add(spec)
            if self.aborts:
                self._fire_aborts()
            if self.iteration > last_arrival and not engine.has_work():
                break
            self._collect(engine.run_step())
            self._check_delivered()
        else:
            self.fail("the engine did not drain")
        self._collect(engine.drain())
        self._check_end()
        return self.result

    def _add(self, spec: RequestSpec) -> None:
        request = Request(spec.req_id, spec.prompt, spec.params, float(spec.arrival), 0)
        self.added.add(spec.req_id)
        self.result.tokens[spec.req_id] = []
        failed = self.engine.add_request(request, spec.structured)
        if failed is not None:
            if not spec.invalid:
                self.fail(f"{spec.req_id}: refused at add: {failed.error}")
            self._collect([failed])
        elif spec.invalid:
            self.fail(f"{spec.req_id}: invalid structured spec {spec.structured} accepted")

    def _fire_aborts(self) -> None:
        for spec in self.scenario.requests:
            rule = spec.abort
            if rule is None or spec.req_id not in self.added:
                continue
            if spec.req_id in self.result.finish_reasons:
                continue
            state = self._state(spec.req_id)
            due = {
                "iteration": self.iteration >= rule.at,
                "queued": state == "queued",
                "prefilling": state == "prefilling",
                "decoding": len(self.result.tokens[spec.req_id]) >= rule.at,
                "verifying": state == "verifying",
            }[rule.kind]
            if due:
                self.result.abort_states[state] += 1
                self.result.aborted.add(spec.req_id)
                out = self.engine.abort_request(spec.req_id)
                if out is None:
                    self.fail(f"{spec.req_id}: live but abort_request returned nothing")
                self._collect([out])

    def _state(self, req_id: str) -> str:
        request = self.engine.scheduler.get_request(req_id)
        assert request is not None
        if request.status is not RequestStatus.RUNNING:
            return "queued" if request.num_preemptions == 0 else "preempted"
        if request.num_output_placeholders > 1:  # a step with drafts for it is in flight
            return "verifying"
        if request.num_computed_tokens < request.num_prompt_tokens:
            return "prefilling"
        return "decoding"

    def _collect(self, outputs: list[RequestOutput]) -> None:
        result = self.result
        for o in outputs:
            if o.req_id in result.finish_reasons:
                self.fail(f"{o.req_id}: output {o} after its final one")
            result.tokens[o.req_id].extend(o.new_token_ids)
            if o.new_logprobs is not None:
                result.num_logprobs[o.req_id] += len(o.new_logprobs)
                k = self.specs[o.req_id].params.logprobs
                if k is None or any(len(top) != k + 1 for top in o.new_logprobs):
                    self.fail(f"{o.req_id}: logprobs={k} but got {o.new_logprobs}")
            result.num_drafts += o.num_draft_tokens
            result.num_accepted += o.num_accepted
            if o.num_accepted > o.num_draft_tokens:
                self.fail(f"{o.req_id}: {o.num_accepted} accepted of {o.num_draft_tokens} drafts")
            if o.finished:
                result.finish_reasons[o.req_id] = o.finish_reason

    def _check_delivered(self) -> None:
        """After an iteration: a live request's user-side tokens are its committed tokens, and a
        request is released only after its final output."""
        scheduler = self.engine.scheduler
        for req_id in self.added:
            request = scheduler.get_request(req_id)
            if request is None:
                if req_id not in self.result.finish_reasons:
                    self.fail(f"{req_id}: released before its final output")
            elif not request.is_finished and self.result.tokens[req_id] != request.output_token_ids:
                self.fail(
                    f"{req_id}: user got {self.result.tokens[req_id]}, books hold "
                    f"{request.output_token_ids}"
                )

    def _check_books(self) -> None:
        """Right after ``schedule()`` / ``update_from_output()`` (committed tokens may not be
        returned to the user yet: that is :meth:`_check_delivered`)."""
        scheduler = self.engine.scheduler
        scheduler.check_invariants()
        kv = scheduler.kv_cache_manager
        holders: Counter[int] = Counter()
        for req_id in self.added:
            request = scheduler.get_request(req_id)
            if request is None:
                continue
            blocks = kv.block_ids(req_id)
            if len(set(blocks)) != len(blocks):
                self.fail(f"{req_id}: holds a block twice: {blocks}")
            holders.update(blocks)
            self._check_request(request)
        pool = kv.pool
        for block_id in range(pool.num_blocks):
            if pool.ref_cnt(block_id) != holders[block_id]:
                self.fail(
                    f"block {block_id}: ref count {pool.ref_cnt(block_id)} but "
                    f"{holders[block_id]} requests hold it"
                )
        if pool.num_free_blocks + len(holders) != pool.num_blocks:
            self.fail(f"{pool.num_free_blocks} free + {len(holders)} held != {pool.num_blocks}")

    def _check_request(self, request: Request) -> None:
        name = request.req_id
        placeholders = request.num_output_placeholders
        if placeholders < 0:
            self.fail(f"{name}: {placeholders} placeholders")
        if request.num_steps_in_flight == 0 and placeholders:
            self.fail(f"{name}: {placeholders} placeholders with no step in flight")
        if not request.is_finished:
            if len(request.output_token_ids) + placeholders > request.max_tokens:
                self.fail(f"{name}: {placeholders} placeholders past max_tokens: {request!r}")
        drafts = request.spec_token_ids
        if len(drafts) > self.engine.config.spec.num_spec_tokens or any(t != -1 for t in drafts):
            self.fail(f"{name}: spec_token_ids {drafts} (drafts live on the device: -1 here)")
        if request.status is not RequestStatus.RUNNING:
            if drafts:
                self.fail(f"{name}: {request.status.name} with drafts {drafts}")
            return
        frontier = request.confirmed_frontier
        if not 0 <= frontier <= request.num_tokens:
            self.fail(f"{name}: confirmed frontier {frontier} outside [0, {request.num_tokens}]")
        if request.num_computed_tokens > request.num_tokens + placeholders:
            self.fail(f"{name}: computed {request.num_computed_tokens} past known + in flight")
        block_size = self.engine.config.cache.block_size
        num_slots = len(self.engine.scheduler.kv_cache_manager.block_ids(name)) * block_size
        if request.num_computed_tokens > num_slots:
            self.fail(f"{name}: {request.num_computed_tokens} computed tokens, {num_slots} slots")

    def _check_end(self) -> None:
        engine = self.engine
        engine.check_idle()
        scheduler = engine.scheduler
        pool = scheduler.kv_cache_manager.pool
        if scheduler.num_requests or scheduler.num_steps_in_flight:
            self.fail(f"{scheduler.num_requests} requests / steps left after the run")
        if pool.num_free_blocks != pool.num_blocks:
            self.fail(f"{pool.num_blocks - pool.num_free_blocks} blocks not free after the run")
        missing = self.added - set(self.result.finish_reasons)
        if missing or len(self.added) != len(self.scenario.requests):
            self.fail(f"requests without a final output: {sorted(missing)}")
        stats = scheduler.get_stats()
        self.result.num_preemptions = stats.num_preemptions
        self.result.num_prefix_hit_tokens = stats.prefix_cache_hit_tokens
        self.result.num_steps = self.iteration
