"""The async scheduler: schedules step N+1 while step N is still on the device.

For a batch queue of depth 2 (``EngineCore.step_with_batch_queue``): ``schedule()`` of N+1 may
run before ``update_from_output(N)``. A request scheduled while its previous token is still on
the device advances optimistically:

* ``num_computed_tokens`` grows by the scheduled tokens as usual;
* ``num_output_placeholders`` grows by the tokens the step will sample (1 + drafts);
* its next drafts are ``-1`` in ``spec_token_ids``: the device proposes and keeps them.

When output N returns, exactly the placeholders N added are settled; rejected drafts roll
``num_computed_tokens`` back (the placeholders for them are settled with the rest). So
``confirmed frontier = num_computed_tokens - num_output_placeholders`` never counts a position
whose token value is still unknown, and only blocks below it enter the prefix cache.

What the base ``Scheduler`` already does for any depth: ``max_tokens``/``max_model_len`` count
placeholders, so no step is scheduled whose token would be cut; a request finished or aborted
while a step is in flight gets that step's tokens dropped, and its blocks back only when no
step in flight references it; a request added after ``schedule()`` of N+1 joins at N+2.
"""

from __future__ import annotations

from typing import ClassVar

from engine.request import Request
from engine.scheduler.scheduler import Scheduler

__all__ = ["AsyncScheduler"]


class AsyncScheduler(Scheduler):
    """``Scheduler`` that allows steps to overlap and keeps output placeholders."""

    allows_overlapping_steps: ClassVar[bool] = True

    def _on_scheduled(self, request: Request, num_sampled_slots: int) -> None:
        request.num_output_placeholders += num_sampled_slots

    def _on_settled(self, request: Request, num_sampled_slots: int) -> None:
        request.num_output_placeholders -= num_sampled_slots
        if request.num_output_placeholders < 0:
            raise AssertionError(f"{request.req_id}: placeholders settled twice: {request!r}")
