"""MTP-style module (DeepSeek-V3 style), delivered with the target and chained for k steps:
``g = norm(layer(eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)])))``, then the target's LM head.

Folder format (default ``<target>/mtp``): ``config.json`` with ``"architecture":
"StepscopeMTPModule"`` and dims, ``model.safetensors`` with ``enorm.weight``, ``hnorm.weight``,
``eh_proj.weight`` [hidden, 2*hidden], ``layer.*`` as the EAGLE head, ``norm.weight``.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.config import ModelConfig
from engine.model.layer_context import LayerContext, torch_reference
from engine.model.layers import RMSNorm
from engine.spec.hidden_head import HeadProposer, HiddenStateHead, build_head_proposer
from engine.spec.proposer import ProposerContext, register_proposer

__all__ = ["MTP_ARCHITECTURE", "MTPModule", "build_mtp_proposer"]

MTP_ARCHITECTURE = "StepscopeMTPModule"


class MTPModule(HiddenStateHead):
    """``g = norm(layer(eh_proj([enorm(e); hnorm(h)])))``."""

    def __init__(self, config: ModelConfig, ctx: LayerContext) -> None:
        super().__init__(config, ctx)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(h, eps, torch_reference(ctx))
        self.hnorm = RMSNorm(h, eps, torch_reference(ctx))
        self.eh_proj = nn.Linear(2 * h, h, bias=False, dtype=ctx.dtype, device=ctx.device)

    # stepscope: hot
    def combine(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))


def build_mtp_proposer(ctx: ProposerContext) -> HeadProposer:
    """Load the mtp head in ``ctx.spec_model``."""
    return build_head_proposer(ctx, MTPModule, MTP_ARCHITECTURE, "mtp")


register_proposer("mtp", build_mtp_proposer)
