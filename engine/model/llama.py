"""Llama / Qwen2 / Qwen3 decoder on a paged KV cache, with HF parameter names."""

from __future__ import annotations

import functools
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_linear import ParallelLMHead, lm_head_linear, vocab_embedding
from engine.distributed.parallel_state import TPGroup
from engine.kernels.attention_metadata import AttentionMetadata
from engine.kernels.backend import KernelBackend, TorchKernels
from engine.model.config import ModelConfig
from engine.model.layer_context import LayerContext
from engine.model.layers import MLP, Attention, RMSNorm
from engine.model.rope import RotaryEmbedding

__all__ = ["DecoderLayer", "LlamaForCausalLM", "LlamaModel", "allocate_kv_caches"]


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(norm(h)); h += mlp(norm(h))``."""

    def __init__(self, config: ModelConfig, ctx: LayerContext) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, ctx)
        self.self_attn = Attention(config, ctx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, ctx)
        self.mlp = MLP(config, ctx)

    # stepscope: hot
    def forward(
        self,
        hidden_states: torch.Tensor,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``hidden_states: [T, hidden] -> [T, hidden]`` (the layer output plus its residual)."""
        out, residual = self.forward_residual(
            hidden_states, None, rope_cos_sin, kv_cache, attn_metadata
        )
        return out + residual

    # stepscope: hot
    def forward_residual(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream kept apart, so each add fuses into the next RMSNorm (vLLM-style).

        The layer's input is ``hidden_states + residual`` (just ``hidden_states`` when
        ``residual`` is None); returns ``(mlp_out, residual)`` whose sum is its output.
        All tensors ``[T, hidden]``.
        """
        if residual is None:
            residual = hidden_states
            attn_in = self.input_layernorm(hidden_states)
        else:
            attn_in, residual = self.input_layernorm.forward_add(hidden_states, residual)
        attn_out = self.self_attn(attn_in, rope_cos_sin, kv_cache, attn_metadata)
        mlp_in, residual = self.post_attention_layernorm.forward_add(attn_out, residual)
        return self.mlp(mlp_in), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm (HF's ``model.*``)."""

    def __init__(self, config: ModelConfig, ctx: LayerContext) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(
            config.vocab_size, config.hidden_size, ctx.tp, ctx.dtype, ctx.device
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, ctx) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)
        self.rotary_emb = RotaryEmbedding(config, ctx.device)


class LlamaForCausalLM(nn.Module):
    """Causal LM for Llama, Qwen2 (q/k/v bias) and Qwen3 (q/k norm), chosen by ``config``.

    ``kernels`` is the kernel backend every layer calls (the Triton one: fused add + RMSNorm, q/k
    norm + RoPE + KV write, attention, SiLU-and-mul; default: the torch references); it is fixed
    at construction and shared through the layers' :class:`LayerContext`. A decode
    step on the Triton path launches 9 kernels per layer (4 of them GEMMs) plus 4 per step.

    ``tp``: tensor parallelism (``engine.distributed``): this rank holds its shard of every
    layer (heads, MLP columns, vocab rows); activations between layers are whole on every rank
    (all-reduce after ``o_proj``, ``down_proj`` and the embedding), and logits are all-gathered.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        kernels: KernelBackend | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = tp
        self.ctx = LayerContext(dtype, device, kernels or TorchKernels(), tp)
        self.model = LlamaModel(config, self.ctx)
        self.lm_head = lm_head_linear(config.hidden_size, config.vocab_size, tp, dtype, device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def allocate_kv_caches(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> list[torch.Tensor]:
        """Per-layer KV caches for this model (dtype/device default to the model's)."""
        weight = self.model.embed_tokens.weight
        attn = cast(DecoderLayer, self.model.layers[0]).self_attn
        return allocate_kv_caches(
            self.config,
            num_blocks,
            block_size,
            dtype or weight.dtype,
            device or weight.device,
            num_kv_heads=attn.num_kv_heads,  # this rank's heads under tensor parallelism
        )

    # stepscope: hot
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids: [T]`` int64 -> ``[T, hidden]``."""
        return self.model.embed_tokens(input_ids)

    # stepscope: hot
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """Run all layers; returns hidden states ``[T, hidden]`` after the final norm.

        ``input_ids, positions: [T]`` int64; ``kv_caches[i]: [2, num_blocks, block_size,
        num_kv_heads, head_dim]``, written in place for every token whose slot is not -1.
        """
        hidden_states = self.embed(input_ids)  # [T, hidden]
        rope_cos_sin = self.model.rotary_emb(positions, hidden_states.dtype)  # [T, 1, D] each
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden_states, residual = cast(DecoderLayer, layer).forward_residual(
                hidden_states, residual, rope_cos_sin, kv_cache, attn_metadata
            )
        if residual is None:
            return self.model.norm(hidden_states)
        return self.model.norm.forward_add(hidden_states, residual)[0]

    # stepscope: hot
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states: [n, hidden]`` -> logits ``[n, vocab]`` float32.

        On CUDA a bf16/fp16 model writes fp32 logits straight from the GEMM's fp32 accumulator
        (one kernel, no half-precision logits written, read and widened)."""
        weight = self.lm_head.weight  # [vocab, hidden] ([ceil(vocab / tp), hidden] under tp)
        narrow = hidden_states.dtype != torch.float32 and hidden_states.dim() == 2
        kernels = self.ctx.kernels
        if kernels.batch_invariant:  # docs/design.md §2.16
            logits = kernels.linear(hidden_states, weight).float()
        elif narrow and _mm_fp32_out(hidden_states.device, hidden_states.dtype):
            logits = torch.mm(hidden_states, weight.t(), out_dtype=torch.float32)
        else:
            logits = F.linear(hidden_states, weight).float()
        if self.tp is None:
            return logits
        return cast(ParallelLMHead, self.lm_head).gather_logits(logits)  # [n, vocab]


@functools.cache
def _mm_fp32_out(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(..., out_dtype=torch.float32)`` runs on ``device`` for ``dtype``."""
    if device.type != "cuda":
        return False
    a = torch.ones(2, 2, dtype=dtype, device=device)
    try:
        torch.mm(a, a, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def allocate_kv_caches(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    num_kv_heads: int | None = None,
) -> list[torch.Tensor]:
    """One zeroed ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer
    (``num_kv_heads`` defaults to the config's; a tensor-parallel rank passes its share)."""
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
    heads = config.num_key_value_heads if num_kv_heads is None else num_kv_heads
    shape = (2, num_blocks, block_size, heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
