"""EAGLE-style head: one decoder layer on ``fc([embed(x_{t+1}); h_t])``, sharing the target's
embedding and LM head, chained on its own output hidden state.

Folder format (``samples/models/README.md``): ``config.json`` with ``"architecture":
"StepscopeEagleHead"`` and the layer's dims, ``model.safetensors`` with ``fc.weight`` [hidden,
2*hidden], ``layer.self_attn.{q,k,v,o}_proj.weight``, ``layer.self_attn.{q,k}_norm.weight``,
``layer.{input,post_attention}_layernorm.weight``, ``layer.mlp.{gate,up,down}_proj.weight``,
``norm.weight``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.config import ConfigError
from engine.model.config import ModelConfig
from engine.spec.draft_kv import LookaheadKV
from engine.spec.hidden_head import (
    HeadProposer,
    HiddenStateHead,
    head_model_config,
    load_head_weights,
    read_head_config,
)
from engine.spec.proposer import register_proposer

__all__ = ["EAGLE_ARCHITECTURE", "EagleHead", "build_eagle_proposer"]

EAGLE_ARCHITECTURE = "StepscopeEagleHead"


class EagleHead(HiddenStateHead):
    """``g = norm(layer(fc([e; h])))``."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device, use_triton: bool
    ) -> None:
        super().__init__(config, dtype, device, use_triton)
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False, dtype=dtype, device=device)

    # stepscope: hot
    def combine(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat((embeds, hidden), dim=-1))


def build_eagle_proposer(
    *,
    target: Any,
    spec_model: str | None,
    num_spec_tokens: int,
    num_blocks: int,
    block_size: int,
    max_num_reqs: int,
    dtype: torch.dtype,
    device: torch.device,
    use_triton: bool = False,
) -> HeadProposer:
    """Load the head in ``spec_model`` for ``target`` (a LlamaForCausalLM)."""
    if spec_model is None:
        raise ConfigError("spec_method='eagle' needs spec_model (the head's folder)")
    folder = Path(spec_model)
    config = head_model_config(read_head_config(folder), target.config)
    head = EagleHead(config, dtype, device, use_triton)
    load_head_weights(head, folder, EAGLE_ARCHITECTURE)
    kv = LookaheadKV(num_blocks, block_size, max_num_reqs, num_spec_tokens)
    return HeadProposer(head, target, num_spec_tokens, kv, use_triton)


register_proposer("eagle", build_eagle_proposer)
