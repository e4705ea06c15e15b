"""The device results of one enqueued step, handed between its stages (typed, not a dict)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sample.sampler import SamplerOutput

__all__ = ["StepInFlight"]


@dataclass
class StepInFlight:
    """What one step's device stages hand each other.

    Every field is set by a closure running on the compute stream and read by a later closure
    of the same step, on the compute stream or (after an event) on the d2h stream; the host
    never reads them. A field is None until its stage ran.
    """

    hidden: torch.Tensor | None = None  # [T, hidden]: the forward's post-norm hidden states
    logits: torch.Tensor | None = None  # [N, V] f32: sampled rows' logits, right after forward
    sampled: SamplerOutput | None = None  # sample / verify: tokens (and logprobs)
    num_accepted: torch.Tensor | None = None  # [B] int64: accepted drafts (with a proposer)
    draft_ids: torch.Tensor | None = None  # [B, k] int64: the next step's drafts

    def take_hidden(self) -> torch.Tensor:
        """The hidden states, dropped from the record (the last stage that needs them)."""
        hidden = self.require("hidden")
        self.hidden = None
        return hidden

    def take_logits(self) -> torch.Tensor | None:
        """The logits computed after the forward (None: not computed yet), dropped from here."""
        logits, self.logits = self.logits, None
        return logits

    def require(self, name: str) -> torch.Tensor:
        value = getattr(self, name)
        if value is None:
            raise RuntimeError(f"step stage order: {name} is not set yet")
        return value  # type: ignore[no-any-return]

    def require_sampled(self) -> SamplerOutput:
        if self.sampled is None:
            raise RuntimeError("step stage order: nothing was sampled yet")
        return self.sampled
