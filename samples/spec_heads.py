"""Reference modules of the sample EAGLE head and MTP module (plain torch, training and tests).

Both are one Qwen3 decoder layer plus a final RMSNorm, fed with the target's post-norm hidden
state ``h_t`` and the target's embedding of the next token ``x_{t+1}``; the target's tied LM head
turns their output into logits for ``x_{t+2}``. ``samples/models/README.md`` is the contract; the
attribute names below are the tensor names in ``model.safetensors``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "EAGLE_ARCH",
    "MTP_ARCH",
    "HeadConfig",
    "RMSNorm",
    "DecoderLayer",
    "EagleHead",
    "MTPModule",
    "create_head",
    "save_head",
    "load_head",
]

EAGLE_ARCH = "StepscopeEagleHead"
MTP_ARCH = "StepscopeMTPModule"


@dataclass(frozen=True)
class HeadConfig:
    """Shape of an EAGLE head or MTP module; written as ``config.json`` beside the weights."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    target: str  # folder name of the target model whose embedding and LM head are shared
    torch_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.architecture not in (EAGLE_ARCH, MTP_ARCH):
            raise ValueError(f"unknown head architecture {self.architecture!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")


class RMSNorm(nn.Module):
    """``w * x / sqrt(mean(x^2) + eps)``, computed in fp32 like HF's Qwen3RMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE (HF convention). ``x: [B, heads, T, D]``, ``positions: [T]``."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=x.device).float() / dim)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Causal GQA self-attention with per-head q/k RMSNorm before RoPE (Qwen3), no biases."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        q_dim, kv_dim = (
            cfg.num_attention_heads * cfg.head_dim,
            cfg.num_key_value_heads * cfg.head_dim,
        )
        self.q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=False)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x: [B, T, hidden]``, ``positions: [T]`` -> ``[B, T, hidden]``."""
        cfg, (batch, seq, _) = self.cfg, x.shape
        q = self.q_norm(self.q_proj(x).view(batch, seq, -1, cfg.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(batch, seq, -1, cfg.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, cfg.head_dim).transpose(1, 2)
        q, k = _rope(q, positions, cfg.rope_theta), _rope(k, positions, cfg.rope_theta)
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, heads, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A pre-norm Qwen3 decoder layer (the same math as ``Qwen3DecoderLayer``)."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    """``g_t = norm(layer(fc([embed(x_{t+1}); h_t])))``; ``lm_head(g_t)`` predicts ``x_{t+2}``."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, next_embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """``next_embeds, hidden: [B, T, hidden]``, ``positions: [T]`` -> ``[B, T, hidden]``."""
        x = self.fc(torch.cat((next_embeds, hidden), dim=-1))
        return self.norm(self.layer(x, positions))


class MTPModule(nn.Module):
    """DeepSeek-V3 MTP: ``g_t = norm(layer(eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)])))``."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, next_embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """``next_embeds, hidden: [B, T, hidden]``, ``positions: [T]`` -> ``[B, T, hidden]``."""
        x = self.eh_proj(torch.cat((self.enorm(next_embeds), self.hnorm(hidden)), dim=-1))
        return self.norm(self.layer(x, positions))


def create_head(cfg: HeadConfig) -> EagleHead | MTPModule:
    """The module named by ``cfg.architecture``."""
    return EagleHead(cfg) if cfg.architecture == EAGLE_ARCH else MTPModule(cfg)


def save_head(head: EagleHead | MTPModule, out_dir: Path) -> None:
    """``config.json`` + ``model.safetensors`` (bf16, tensor names = attribute paths)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(asdict(head.cfg), indent=2) + "\n")
    tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous()
               for k, v in head.state_dict().items()}  # fmt: skip
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def load_head(
    folder: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16
) -> EagleHead | MTPModule:
    """Inverse of :func:`save_head`, cast to ``dtype``."""
    from safetensors.torch import load_file

    cfg = HeadConfig(**json.loads((folder / "config.json").read_text()))
    head = create_head(cfg)
    head.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    return head.to(device=device, dtype=dtype)
