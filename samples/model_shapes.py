"""Shapes of the sample models: the full ones trained on the H200 and tiny ones for CPU checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from samples.spec_heads import EAGLE_ARCH, MTP_ARCH, HeadConfig

__all__ = ["Shape", "FULL_SHAPES", "TINY_SHAPES", "target_config", "draft_config", "head_config"]

EOS_ID = 0
PAD_ID = 1
ROPE_THETA = 10_000.0
RMS_EPS = 1e-6


@dataclass(frozen=True)
class Shape:
    """A decoder's dimensions."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")


# name -> (target, draft): target ~14.2M params (Qwen3), draft ~1.6M (Llama).
FULL_SHAPES = (Shape(384, 8, 6, 2, 64, 1024), Shape(192, 2, 3, 1, 64, 512))
TINY_SHAPES = (Shape(64, 2, 4, 2, 16, 128), Shape(32, 1, 2, 1, 16, 64))


def _common(shape: Shape, vocab_size: int, max_positions: int) -> dict[str, Any]:
    return dict(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=max_positions,
        rms_norm_eps=RMS_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=True,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attention_bias=False,
        use_cache=True,
    )


def target_config(shape: Shape, vocab_size: int, max_positions: int = 2048) -> Any:
    """A ``transformers.Qwen3Config`` for the target."""
    from transformers import Qwen3Config

    return Qwen3Config(**_common(shape, vocab_size, max_positions))


def draft_config(shape: Shape, vocab_size: int, max_positions: int = 2048) -> Any:
    """A ``transformers.LlamaConfig`` for the draft model (same tokenizer as the target)."""
    from transformers import LlamaConfig

    return LlamaConfig(**_common(shape, vocab_size, max_positions), mlp_bias=False)


def head_config(architecture: str, target: Shape, vocab_size: int, target_name: str) -> HeadConfig:
    """One decoder layer of the target's width for the EAGLE head or the MTP module."""
    if architecture not in (EAGLE_ARCH, MTP_ARCH):
        raise ValueError(f"unknown head architecture {architecture!r}")
    return HeadConfig(
        architecture=architecture,
        hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        head_dim=target.head_dim,
        rms_norm_eps=RMS_EPS,
        rope_theta=ROPE_THETA,
        vocab_size=vocab_size,
        target=target_name,
    )
