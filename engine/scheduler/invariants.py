"""Debug checks that the scheduler's books agree (docs/design.md §2.3). Raise AssertionError."""

from __future__ import annotations

from collections.abc import Sequence

from engine.request import Request, RequestStatus
from engine.scheduler.kv_cache_manager import KVCacheManager
from engine.scheduler.running_books import RunningBooks
from engine.scheduler.step_plan import InFlightStep

__all__ = ["check_request_books", "check_running_books"]


def check_request_books(
    request: Request, kv_cache_manager: KVCacheManager, in_flight: Sequence[InFlightStep]
) -> None:
    """One request: placeholders are exactly the sampled slots of its steps in flight (so >= 0),
    confirmed frontier within [0, num_computed_tokens], prefix-cached blocks only below it."""
    name = request.req_id
    assert request.num_output_placeholders >= 0, f"{name}: negative placeholders"
    steps = [step for step in in_flight if name in step.num_sampled_slots]
    assert request.num_steps_in_flight == len(steps), f"{name}: steps in flight miscounted"
    num_slots = sum(step.num_sampled_slots[name] for step in steps)
    assert request.num_output_placeholders == num_slots, f"{name}: placeholders != slots in flight"
    if request.status is not RequestStatus.RUNNING:
        assert request.num_computed_tokens == 0 or request.is_finished, f"{name}: stale frontier"
        return
    frontier = request.confirmed_frontier
    assert 0 <= frontier <= request.num_computed_tokens, f"{name}: frontier {frontier} out of range"
    assert frontier <= request.num_tokens, f"{name}: frontier beyond committed tokens"
    num_cached = kv_cache_manager.num_cached_blocks(name) * kv_cache_manager.block_size
    assert num_cached <= frontier, f"{name}: {num_cached} cached tokens beyond frontier {frontier}"
    num_kv_slots = len(kv_cache_manager.block_ids(name)) * kv_cache_manager.block_size
    assert request.num_computed_tokens <= num_kv_slots, f"{name}: computed tokens without KV slots"


def check_running_books(
    request: Request, books: RunningBooks, kv_cache_manager: KVCacheManager
) -> None:
    """A running request holds a slot whose copies agree with the request (output count, drafts
    flag, prefix-cached blocks); any other request holds none."""
    name, slot = request.req_id, request.slot
    if request.status is not RequestStatus.RUNNING:
        assert slot == -1, f"{name}: {request.status.name} but holds slot {slot}"
        return
    assert slot >= 0, f"{name}: running without a slot"
    assert books.num_output[slot] == len(request.output_token_ids), f"{name}: output count"
    assert books.has_drafts[slot] == bool(request.spec_token_ids), f"{name}: drafts flag"
    num_cached = kv_cache_manager.num_cached_blocks(name)
    assert books.num_cached_blocks[slot] == num_cached, f"{name}: cached blocks copy"
