"""What EAGLE-style heads and MTP-style modules share: one decoder layer fed with the target's
hidden state, its own small paged KV cache, and the k-step draft chain.

Alignment (the same as ``samples/spec_training.py``): with ``h_t`` the target's post-norm hidden
state at position ``t`` and ``x_{t+1}`` the next token,

* chain step 1 at position ``t``: ``g_1 = head(embed(x_{t+1}), h_t)``; ``lm_head(g_1)`` predicts
  ``x_{t+2}``;
* chain step ``j``: ``g_j = head(embed(x_{t+j}), g_{j-1})`` at position ``t + j - 1``.

``head(e, h) = norm(layer(combine(e, h)))``; ``combine`` is EAGLE's ``fc([e; h])`` or MTP's
``eh_proj([enorm(e); hnorm(h)])``. The embedding and the LM head are the target's.

Per step the head first runs over the target's query tokens (pairs ``(h_t, x_{t+1})`` at the
target's own positions and slots; ``x_{t+1}`` is read from the state table, where verify has just
committed the emitted tokens), which writes its KV for every confirmed position and yields
``g_1`` at the last accepted token; the remaining ``k - 1`` steps are single-token chain steps.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.config import ConfigError
from engine.kernels.attention_metadata import AttentionMetadata
from engine.kernels.backend import KernelBackend
from engine.model.config import ModelConfig
from engine.model.layer_context import LayerContext, torch_reference
from engine.model.layers import RMSNorm
from engine.model.llama import DecoderLayer
from engine.model.rope import RotaryEmbedding
from engine.spec.draft_kv import LookaheadKV
from engine.spec.proposer import (
    DraftOutput,
    ProposeInputs,
    Proposer,
    ProposerContext,
    sample_drafts,
)

__all__ = [
    "HiddenStateHead",
    "HeadProposer",
    "head_model_config",
    "load_head_weights",
    "read_head_config",
]


def head_model_config(head_config: dict[str, Any], target: ModelConfig) -> ModelConfig:
    """The decoder-layer shape of a head ``config.json`` (Qwen3 layer: q/k norm, no biases)."""
    try:
        return ModelConfig(
            architecture="Qwen3ForCausalLM",
            vocab_size=target.vocab_size,
            hidden_size=int(head_config["hidden_size"]),
            intermediate_size=int(head_config["intermediate_size"]),
            num_hidden_layers=1,
            num_attention_heads=int(head_config["num_attention_heads"]),
            num_key_value_heads=int(head_config["num_key_value_heads"]),
            head_dim=int(head_config["head_dim"]),
            rms_norm_eps=float(head_config.get("rms_norm_eps", target.rms_norm_eps)),
            rope_theta=float(head_config.get("rope_theta", target.rope_theta)),
            max_position_embeddings=target.max_position_embeddings,
            qk_norm=True,
        )
    except KeyError as err:
        raise ConfigError(f"head config.json lacks {err.args[0]!r}") from None


class HiddenStateHead(nn.Module):
    """``norm(layer(combine(embeds, hidden)))`` over a paged KV cache of one layer."""

    def __init__(self, config: ModelConfig, ctx: LayerContext) -> None:
        super().__init__()
        self.config = config
        self.layer = DecoderLayer(config, ctx)
        # The head's own norms run the torch reference whatever the backend (as they always have).
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, torch_reference(ctx))
        self.rotary = RotaryEmbedding(config, ctx.device)

    @abstractmethod
    def combine(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``embeds, hidden: [T, hidden]`` -> the layer input ``[T, hidden]``."""

    # stepscope: hot
    def forward(
        self,
        embeds: torch.Tensor,  # [T, hidden]: embed(x_{t+1})
        hidden: torch.Tensor,  # [T, hidden]: h_t (target) or g_{j-1} (chain)
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The post-norm output ``g: [T, hidden]`` (chained as the next step's hidden)."""
        x = self.combine(embeds, hidden)
        cos_sin = self.rotary(positions, x.dtype)
        return self.norm(self.layer(x, cos_sin, kv_cache, attn_metadata))


def load_head_weights(head: nn.Module, folder: Path, architecture: str) -> None:
    """Strictly load ``model.safetensors`` (names = attribute paths) into ``head``."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    if config.get("architecture") != architecture:
        kind = (
            f"a HF model checkpoint (model_type {config['model_type']!r}; a draft model is "
            "--spec-method draft)"
            if "model_type" in config
            else f"architecture {config.get('architecture')!r}"
        )
        raise ConfigError(f"{folder}: {kind}, expected a {architecture!r} head folder")
    tensors = load_file(str(folder / "model.safetensors"))
    params = dict(head.named_parameters())
    missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise ConfigError(f"{folder}: missing tensors {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, param in params.items():
            if tuple(param.shape) != tuple(tensors[name].shape):
                raise ConfigError(f"{folder}: {name} has shape {tuple(tensors[name].shape)}")
            param.copy_(tensors[name].to(param.dtype))
    head.eval()


def read_head_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ConfigError(f"spec model folder {folder} has no config.json")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


class HeadProposer(Proposer):
    """Runs a :class:`HiddenStateHead` for ``k`` chained steps after each verify."""

    def __init__(
        self,
        head: HiddenStateHead,
        target: Any,
        num_spec_tokens: int,
        kv: LookaheadKV,
        kernels: KernelBackend,
    ) -> None:
        if head.config.hidden_size != target.config.hidden_size:
            raise ConfigError(
                f"head hidden_size {head.config.hidden_size} != target's "
                f"{target.config.hidden_size}"
            )
        self.head = head
        self.target = target
        self.num_spec_tokens = num_spec_tokens
        self.kv = kv
        self.kernels = kernels
        c, weight = head.config, target.model.embed_tokens.weight
        shape = (2, kv.num_blocks, kv.block_size, c.num_key_value_heads, c.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=weight.dtype, device=weight.device)

    def kv_caches(self) -> list[torch.Tensor]:
        return [self.kv_cache]

    # stepscope: hot
    def propose(self, inputs: ProposeInputs) -> DraftOutput:
        md = inputs.attn_metadata
        tp = md.num_tokens
        positions = inputs.positions[:tp]
        next_pos = (positions + 1).clamp(max=inputs.max_model_len - 1)
        next_ids = inputs.token_ids[inputs.token_rows[:tp], next_pos]  # [T] x_{t+1}
        g = self.head(  # query pass: [T, hidden]
            self.target.embed(next_ids), inputs.hidden_states[:tp], positions, self.kv_cache, md
        )
        prev = g[inputs.anchor_token_idx]  # [B, hidden]: g_1 at the last accepted token
        table = self.kv.chain_block_table(inputs)
        ids, probs = [], []
        for j in range(self.num_spec_tokens):
            logits = self.target.compute_logits(prev)  # [B, V]
            draft, q = sample_drafts(
                logits,
                inputs.temperature,
                inputs.seeds,
                inputs.bonus_pos + 1 + j,
                inputs.all_greedy,
                self.kernels,
            )
            ids.append(draft)
            probs.append(q)
            if j + 1 == self.num_spec_tokens:
                break
            chain_pos = self.kv.chain_positions(inputs, j)  # step j + 2 sits at P + j
            chain_md = self.kv.chain_metadata(inputs, table, chain_pos)
            prev = self.head(self.target.embed(draft), prev, chain_pos, self.kv_cache, chain_md)
        return _stack(ids, probs)


def _stack(ids: list[torch.Tensor], probs: list[torch.Tensor | None]) -> DraftOutput:
    """``k`` per-step results -> ``[B, k]`` ids and ``[B, k, V]`` probs (None if greedy)."""
    stacked = None if probs[0] is None else torch.stack([p for p in probs if p is not None], 1)
    return DraftOutput(draft_ids=torch.stack(ids, dim=1), draft_probs=stacked)


def build_head_proposer(
    ctx: ProposerContext, head_cls: type[HiddenStateHead], architecture: str, method: str
) -> HeadProposer:
    """Load the head of ``architecture`` from ``ctx.spec_model`` for ``ctx.target``."""
    folder = Path(ctx.require_spec_model(method, "the head's folder"))
    config = head_model_config(read_head_config(folder), ctx.target.config)
    head = head_cls(config, ctx.layers)
    load_head_weights(head, folder, architecture)
    k = ctx.spec.num_spec_tokens
    kv = LookaheadKV(
        ctx.cache.resolved_num_kv_blocks, ctx.cache.block_size, ctx.limits.resolved_max_num_seqs, k
    )
    return HeadProposer(head, ctx.target, k, kv, ctx.layers.kernels)
