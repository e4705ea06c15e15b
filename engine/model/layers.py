"""Llama-family building blocks: RMSNorm, SwiGLU MLP, paged-KV attention.

Attribute names follow the HF checkpoints (``q_proj``, ``q_norm``, ``gate_proj``, ...), so a HF
state dict loads without renaming.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.attention import paged_attention
from engine.kernels.kv_write import write_kv
from engine.model.attention_metadata import AttentionMetadata
from engine.model.config import ModelConfig
from engine.model.rope import apply_rotary

__all__ = ["Attention", "MLP", "RMSNorm"]


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, normalised in fp32 like HF."""

    def __init__(
        self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))

    # stepscope: hot
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of ``x: [..., size]``."""
        # one fused kernel on CUDA (vs ~6 for the pow/mean/rsqrt spelling); same fp32 math
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype, device=device)
        self.up_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype, device=device)
        self.down_proj = nn.Linear(inter, hidden, bias=False, dtype=dtype, device=device)

    # stepscope: hot
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [T, hidden] -> [T, hidden]``."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """GQA self-attention over a paged KV cache.

    Each call writes this step's K/V into the cache through ``slot_mapping`` and then attends,
    for every query token, to its request's cached KV up to its own position.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        use_triton: bool,
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.use_triton = use_triton
        hidden, bias = config.hidden_size, config.attention_bias
        kw = {"dtype": dtype, "device": device}
        self.q_proj = nn.Linear(hidden, config.q_size, bias=bias, **kw)
        self.k_proj = nn.Linear(hidden, config.kv_size, bias=bias, **kw)
        self.v_proj = nn.Linear(hidden, config.kv_size, bias=bias, **kw)
        self.o_proj = nn.Linear(config.q_size, hidden, bias=False, **kw)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)

    # stepscope: hot
    def forward(
        self,
        hidden_states: torch.Tensor,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``hidden_states: [T, hidden]`` -> ``[T, hidden]``; ``rope_cos_sin``: ``[T, 1, D]`` each."""
        num_tokens = hidden_states.shape[0]
        q = self.q_proj(hidden_states).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # Qwen3: per-head norm before RoPE
        cos, sin = rope_cos_sin
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        write_kv(k, v, kv_cache, attn_metadata.slot_mapping, self.use_triton)
        # out: [T, Hq, D]
        out = paged_attention(q, kv_cache, attn_metadata, self.scale, self.use_triton)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
