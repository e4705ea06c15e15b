"""Draft-model proposer: a small Llama-family model with the target's tokenizer.

Its paged KV cache mirrors the target's (same block ids, see :mod:`engine.spec.draft_kv`). Each
step it first runs over the target's query tokens at the target's positions and slots (writing
its KV for them; positions past the last accepted one are rewritten later), then ``k``
single-token steps: the bonus token at ``P`` -> ``d_1`` at ``P + 1``, ``d_1`` -> ``d_2``, ...
"""

from __future__ import annotations

from typing import Any

import torch

from engine.config import ConfigError
from engine.kernels.backend import KernelBackend
from engine.model.loader import load_model
from engine.spec.draft_kv import LookaheadKV
from engine.spec.proposer import (
    DraftOutput,
    ProposeInputs,
    Proposer,
    ProposerContext,
    register_proposer,
    sample_drafts,
)

__all__ = ["DraftModelProposer", "build_draft_proposer"]


class DraftModelProposer(Proposer):
    """Autoregressive drafts from a separate small LM (a LlamaForCausalLM)."""

    def __init__(
        self, model: Any, num_spec_tokens: int, kv: LookaheadKV, kernels: KernelBackend
    ) -> None:
        self.model = model
        self.num_spec_tokens = num_spec_tokens
        self.kv = kv
        self.kernels = kernels
        self._kv_caches = model.allocate_kv_caches(kv.num_blocks, kv.block_size)

    def kv_caches(self) -> list[torch.Tensor]:
        return self._kv_caches

    # stepscope: hot
    def propose(self, inputs: ProposeInputs) -> DraftOutput:
        md = inputs.attn_metadata
        tp = md.num_tokens
        # query pass: the draft's KV for this step's tokens (its hidden states are not needed)
        self.model(inputs.input_ids[:tp], inputs.positions[:tp], md, self._kv_caches)
        table = self.kv.chain_block_table(inputs)
        token = inputs.bonus_ids  # [B]
        ids, probs = [], []
        for j in range(self.num_spec_tokens):
            chain_pos = self.kv.chain_positions(inputs, j)  # token at P + j predicts P + j + 1
            chain_md = self.kv.chain_metadata(inputs, table, chain_pos)
            hidden = self.model(token, chain_pos, chain_md, self._kv_caches)  # [B, hidden]
            logits = self.model.compute_logits(hidden)  # [B, V]
            token, q = sample_drafts(
                logits,
                inputs.temperature,
                inputs.seeds,
                inputs.bonus_pos + 1 + j,
                inputs.all_greedy,
                self.kernels,
            )
            ids.append(token)
            probs.append(q)
        stacked = None if probs[0] is None else torch.stack([p for p in probs if p is not None], 1)
        return DraftOutput(draft_ids=torch.stack(ids, dim=1), draft_probs=stacked)


def build_draft_proposer(ctx: ProposerContext) -> DraftModelProposer:
    """Load the draft checkpoint in ``ctx.spec_model``; its vocabulary must be the target's."""
    folder = ctx.require_spec_model("draft", "the draft model's folder")
    model, config = load_model(
        folder, ctx.layers.dtype, ctx.layers.device, kernels=ctx.layers.kernels
    )
    if config.vocab_size != ctx.target.config.vocab_size:
        raise ConfigError(
            f"draft vocab_size {config.vocab_size} != target's {ctx.target.config.vocab_size}:"
            " the draft model must share the target's tokenizer"
        )
    k = ctx.spec.num_spec_tokens
    kv = LookaheadKV(
        ctx.cache.resolved_num_kv_blocks, ctx.cache.block_size, ctx.limits.resolved_max_num_seqs, k
    )
    return DraftModelProposer(model, k, kv, ctx.layers.kernels)


register_proposer("draft", build_draft_proposer)
