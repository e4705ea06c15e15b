"""EAGLE-style head: one decoder layer on ``fc([embed(x_{t+1}); h_t])``, sharing the target's
embedding and LM head, chained on its own output hidden state.

Folder format (``samples/models/README.md``): ``config.json`` with ``"architecture":
"StepscopeEagleHead"`` and the layer's dims, ``model.safetensors`` with ``fc.weight`` [hidden,
2*hidden], ``layer.self_attn.{q,k,v,o}_proj.weight``, ``layer.self_attn.{q,k}_norm.weight``,
``layer.{input,post_attention}_layernorm.weight``, ``layer.mlp.{gate,up,down}_proj.weight``,
``norm.weight``.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.config import ModelConfig
from engine.model.layer_context import LayerContext
from engine.spec.hidden_head import HeadProposer, HiddenStateHead, build_head_proposer
from engine.spec.proposer import ProposerContext, register_proposer

__all__ = ["EAGLE_ARCHITECTURE", "EagleHead", "build_eagle_proposer"]

EAGLE_ARCHITECTURE = "StepscopeEagleHead"


class EagleHead(HiddenStateHead):
    """``g = norm(layer(fc([e; h])))``."""

    def __init__(self, config: ModelConfig, ctx: LayerContext) -> None:
        super().__init__(config, ctx)
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False, dtype=ctx.dtype, device=ctx.device)

    # stepscope: hot
    def combine(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat((embeds, hidden), dim=-1))


def build_eagle_proposer(ctx: ProposerContext) -> HeadProposer:
    """Load the eagle head in ``ctx.spec_model``."""
    return build_head_proposer(ctx, EagleHead, EAGLE_ARCHITECTURE, "eagle")


register_proposer("eagle", build_eagle_proposer)
