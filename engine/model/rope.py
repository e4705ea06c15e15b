"""Rotary position embedding with HF's frequency-scaling conventions (NeoX half rotation)."""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.kernels.rope import apply_rotary_torch
from engine.model.config import ModelConfig, RopeScaling

__all__ = ["RotaryEmbedding", "apply_rotary", "rope_inv_freq"]


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim // 2]`` fp32 and the cos/sin multiplier, as HF computes."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    return _yarn_inv_freq(config, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend in between."""
    assert s.original_max_position_embeddings is not None
    assert s.low_freq_factor is not None and s.high_freq_factor is not None
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(config: ModelConfig, s: RopeScaling) -> tuple[torch.Tensor, float]:
    """YaRN: ramp between interpolated and extrapolated frequencies; scale cos/sin."""
    assert s.original_max_position_embeddings is not None
    orig_len = s.original_max_position_embeddings
    dim, base, factor = config.head_dim, config.rope_theta, s.factor

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = get_mscale(factor, s.mscale) / get_mscale(factor, s.mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


# stepscope: hot
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [T, H, D]`` by ``cos, sin: [T, 1, D]`` (x's dtype), HF's rotate_half layout."""
    return apply_rotary_torch(x, cos, sin)


class RotaryEmbedding(nn.Module):
    """Precomputed fp32 ``[cos | sin]`` table for every position up to ``max_position_embeddings``."""

    def __init__(self, config: ModelConfig, device: torch.device | str) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_inv_freq(config)
        self.head_dim = config.head_dim
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_pos, D // 2]
        freqs = torch.cat((freqs, freqs), dim=-1)  # [max_pos, D]
        cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor
        self.cos_sin_cache: torch.Tensor  # [max_pos, 2 * D] fp32
        self.register_buffer("cos_sin_cache", cos_sin.to(device), False)

    # stepscope: hot
    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, D]`` in ``dtype`` at ``positions: [T]`` int64; computed once a step.

        Two kernels (one gather, one cast); cos and sin are strided views of one ``[T, 2 * D]``
        tensor."""
        cos_sin = self.cos_sin_cache[positions].to(dtype)[:, None, :]  # [T, 1, 2 * D]
        return cos_sin[..., : self.head_dim], cos_sin[..., self.head_dim :]
