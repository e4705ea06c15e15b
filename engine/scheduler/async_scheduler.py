"""The async scheduler: schedules step N+1 while step N is still on the device.

For a batch queue of depth 2 (``EngineCore.step_with_batch_queue``): ``schedule()`` of N+1 may
run before ``update_from_output(N)``. A request scheduled while its previous token is still on
the device advances optimistically:

* ``num_computed_tokens`` grows by the scheduled tokens (the token still on the device and the
  drafts included);
* ``num_output_placeholders`` grows by the tokens the step will sample (1 + drafts);
* its next drafts are ``-1`` in ``spec_token_ids``: the device proposes and keeps them.

When output N returns, exactly the placeholders N added are settled, and rejected drafts roll
``num_computed_tokens`` back by the same count. So ``confirmed frontier = num_computed_tokens -
num_output_placeholders`` never counts a position whose token is still unknown, and only
blocks below it enter the prefix cache.

Also for any depth (the base ``Scheduler`` keeps these rules, they are no-ops when steps never
overlap): ``max_tokens`` and ``max_model_len`` count placeholders, so no step is scheduled
whose token would be cut; a request finished or aborted while a step is in flight gets that
step's tokens dropped, and its blocks back only once no step in flight references it; a
request added after ``schedule()`` of N+1 joins at N+2 at the earliest.
"""

from __future__ import annotations

from typing import ClassVar

from engine.config import CacheConfig, SchedulerConfig
from engine.scheduler.outputs import SchedulerOutput
from engine.scheduler.request_output import StopStringChecker
from engine.scheduler.scheduler import Scheduler

__all__ = ["AsyncScheduler"]


class AsyncScheduler(Scheduler):
    """``Scheduler`` whose ``schedule()`` may run while up to ``max_steps_in_flight - 1`` earlier
    steps are still on the device (2 = the depth-2 batch queue)."""

    allows_overlapping_steps: ClassVar[bool] = True

    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheConfig,
        stop_string_checker: StopStringChecker | None = None,
        max_steps_in_flight: int = 2,
        *,
        num_spec_tokens: int = 0,
    ) -> None:
        if max_steps_in_flight < 1:
            raise ValueError(f"max_steps_in_flight must be >= 1, got {max_steps_in_flight}")
        super().__init__(config, cache, stop_string_checker, num_spec_tokens=num_spec_tokens)
        self.max_steps_in_flight = max_steps_in_flight

    def schedule(self) -> SchedulerOutput:
        if self.num_steps_in_flight >= self.max_steps_in_flight:
            raise RuntimeError(
                f"{self.num_steps_in_flight} steps already in flight (max {self.max_steps_in_flight}):"
                " call update_from_output() on the oldest first"
            )
        return super().schedule()

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Not available: with steps overlapping, drafts stay on the device (``-1`` here)."""
        raise RuntimeError(
            "AsyncScheduler keeps drafts on the device; CPU draft ids would be stale"
        )
