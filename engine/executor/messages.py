"""What rank 0 sends the other ranks: one message per runner call, in call order."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from engine.scheduler.outputs import SchedulerOutput

__all__ = ["MessageKind", "StepMessage"]


class MessageKind(str, Enum):
    """Which runner call to mirror (``ModelRunner.execute_*``), or the end of the run."""

    MODEL = "model"  # execute_model(scheduler_output, bitmask)
    FORWARD = "forward"  # execute_forward(scheduler_output): deferred sampling, first half
    SAMPLE = "sample"  # execute_sample(<the pending forward of step>, bitmask)
    STOP = "stop"


@dataclass(frozen=True)
class StepMessage:
    """One runner call of rank 0. ``bitmask``: the grammar mask (host int32), or None."""

    kind: MessageKind
    step: int
    scheduler_output: SchedulerOutput | None = None
    bitmask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        needs_output = self.kind in (MessageKind.MODEL, MessageKind.FORWARD)
        if needs_output != (self.scheduler_output is not None):
            raise ValueError(
                f"{self.kind.value} message: scheduler_output must be given iff the call takes one"
            )
