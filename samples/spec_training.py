"""Losses and held-out agreement for the draft model, EAGLE head and MTP module.

Alignment (``x`` is a window of tokens, ``h_t`` the target's post-norm hidden state at ``t``,
``a_t = argmax lm_head(h_t)`` the target's greedy prediction of ``x_{t+1}``):

* chain step 1 at index ``t``: input ``(embed(x_{t+1}), h_t)`` at position ``t``; output ``g1_t``
  predicts ``x_{t+2}`` and should agree with ``a_{t+1}``;
* chain step k: input ``(embed(x_{t+k}), g(k-1)_t)`` at position ``t+k-1``; output predicts
  ``x_{t+k+1}`` and should agree with ``a_{t+k}``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from samples.spec_heads import EagleHead, MTPModule

__all__ = ["TargetOutputs", "soft_cross_entropy", "chained_head_loss", "chain_head", "Agreement"]

Head = EagleHead | MTPModule
LMHead = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TargetOutputs:
    """What the frozen target gives the students for one batch of windows."""

    embeds: torch.Tensor  # [B, T, hidden]: embed(x_t)
    hidden: torch.Tensor  # [B, T, hidden]: post-norm h_t
    probs: torch.Tensor  # [B, T, vocab] fp32: softmax(lm_head(h_t)), the law of x_{t+1}


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """Mean over positions of ``-sum_v p_target(v) log p_student(v)`` (distillation CE)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(target_probs * logp).sum(-1).mean()


def chain_head(
    head: Head, embeds: torch.Tensor, hidden: torch.Tensor, num_steps: int
) -> list[torch.Tensor]:
    """Outputs of ``num_steps`` chained head steps, each fed the previous step's output.

    ``embeds, hidden: [B, T, hidden]``; step k returns ``[B, T-k, hidden]`` whose index ``t``
    predicts ``x_{t+k+1}`` (teacher tokens ``x_{t+k}`` are the embedded inputs).
    """
    seq_len = embeds.shape[1]
    prev = hidden[:, : seq_len - 1]
    outputs = []
    for k in range(1, num_steps + 1):
        positions = torch.arange(seq_len - k, device=embeds.device) + (k - 1)
        out = head(embeds[:, k:], prev, positions)  # [B, T-k, hidden]
        outputs.append(out)
        prev = out[:, :-1]
    return outputs


def chained_head_loss(
    head: Head,
    lm_head: LMHead,
    target: TargetOutputs,
    step_weights: tuple[float, ...],
    feature_weight: float,
) -> torch.Tensor:
    """Sum over chain steps k of ``w_k * CE(p_target(x_{t+k+1}), head)`` plus, when
    ``feature_weight > 0``, EAGLE's smooth-L1 between ``g_k`` and the target's ``h_{t+k}``."""
    outputs = chain_head(head, target.embeds, target.hidden, len(step_weights))
    loss = torch.zeros((), device=target.hidden.device)
    for k, (out, weight) in enumerate(zip(outputs, step_weights, strict=True), start=1):
        # out: [B, T-k, hidden]; index t predicts x_{t+k+1}, whose target law is probs[:, t+k]
        loss = loss + weight * soft_cross_entropy(lm_head(out), target.probs[:, k:])
        if feature_weight > 0:
            feat = F.smooth_l1_loss(out.float(), target.hidden[:, k:].float())
            loss = loss + weight * feature_weight * feat
    return loss


@dataclass
class Agreement:
    """Running sums for one proposer on held-out windows."""

    ce_sum: float = 0.0  # hard-label CE of its first prediction against the data
    agree1: float = 0.0  # its first prediction == the target's greedy token
    agree2: float = 0.0  # its second prediction == the target's greedy token
    accepted: float = 0.0  # agree1 + agree1 * agree2: tokens accepted of 2 greedy drafts
    count: int = 0

    def add(self, ce: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> None:
        """``ce``: mean CE of the batch; ``first, second: [B, n]`` bool agreement, aligned."""
        n = first.numel()
        self.ce_sum += ce.item() * n
        self.agree1 += first.float().sum().item()
        self.agree2 += second.float().sum().item()
        self.accepted += (first.float() + (first & second).float()).sum().item()
        self.count += n

    def summary(self) -> dict[str, float]:
        """``val_ce``, ``agree1``, ``agree2`` and ``accepted_of_2`` as means per position."""
        n = max(1, self.count)
        return {"val_ce": self.ce_sum / n, "agree1": self.agree1 / n,
                "agree2": self.agree2 / n, "accepted_of_2": self.accepted / n}  # fmt: skip


def head_agreement(
    head: Head, lm_head: LMHead, target: TargetOutputs, tokens: torch.Tensor, result: Agreement
) -> None:
    """Add one batch's agreement of a 2-step chained head with the target's greedy tokens.

    ``tokens: [B, T]`` are the window inputs ``x``; ``target.probs`` gives ``a_t``.
    """
    greedy = target.probs.argmax(-1)  # [B, T]: a_t
    g1, g2 = chain_head(head, target.embeds, target.hidden, 2)
    logits1 = lm_head(g1[:, :-1])  # [B, T-2, V]: predicts x_{t+2}
    pred1, pred2 = logits1.argmax(-1), lm_head(g2).argmax(-1)  # [B, T-2] each
    ce = F.cross_entropy(logits1.float().flatten(0, 1), tokens[:, 2:].flatten())
    result.add(ce, pred1 == greedy[:, 1:-1], pred2 == greedy[:, 2:])


def draft_agreement(
    draft_logits: torch.Tensor, target: TargetOutputs, tokens: torch.Tensor, result: Agreement
) -> None:
    """The draft model's teacher-forced agreement: positions ``t`` and ``t+1`` as steps 1, 2."""
    greedy = target.probs.argmax(-1)  # [B, T]
    same = draft_logits.argmax(-1) == greedy  # [B, T]
    ce = F.cross_entropy(draft_logits[:, :-1].float().flatten(0, 1), tokens[:, 1:].flatten())
    result.add(ce, same[:, :-1], same[:, 1:])
