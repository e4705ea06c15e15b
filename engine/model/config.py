"""The model shape and numerics the engine needs, read from a HF config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "RopeScaling"]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_SUPPORTED_ROPE_TYPES = ("linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, HF conventions (``rope_type`` in linear / llama3 / yarn)."""

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: cos/sin multiplier; None = derived from factor
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn

    def __post_init__(self) -> None:
        if self.rope_type not in _SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_type {self.rope_type!r}: supported are none/default, "
                f"{', '.join(_SUPPORTED_ROPE_TYPES)} (dynamic NTK changes frequencies with the "
                "sequence length and is refused)"
            )
        if self.factor <= 0:
            raise ValueError(f"rope factor must be > 0, got {self.factor}")
        needs_original = self.rope_type in ("llama3", "yarn")
        if needs_original and self.original_max_position_embeddings is None:
            raise ValueError(f"rope_type {self.rope_type!r} needs original_max_position_embeddings")
        if self.rope_type == "llama3":
            if self.low_freq_factor is None or self.high_freq_factor is None:
                raise ValueError("rope_type 'llama3' needs low_freq_factor and high_freq_factor")
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError("llama3 rope needs high_freq_factor > low_freq_factor")

    @classmethod
    def from_hf(cls, params: dict[str, Any] | None) -> RopeScaling | None:
        """Parse a HF ``rope_scaling`` / ``rope_parameters`` dict; None for plain RoPE."""
        if not params:
            return None
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            return None
        if rope_type not in _SUPPORTED_ROPE_TYPES:
            cls(rope_type=str(rope_type), factor=1.0)  # raises the clear error
        original = params.get("original_max_position_embeddings")
        return cls(
            rope_type=str(rope_type),
            factor=float(params["factor"]),
            original_max_position_embeddings=None if original is None else int(original),
            low_freq_factor=_opt_float(params.get("low_freq_factor")),
            high_freq_factor=_opt_float(params.get("high_freq_factor")),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=_opt_float(params.get("attention_factor")),
            mscale=_opt_float(params.get("mscale")),
            mscale_all_dim=_opt_float(params.get("mscale_all_dim")),
            truncate=bool(params.get("truncate", True)),
        )


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama, Qwen2, Qwen3).

    Qwen2 differs from Llama by q/k/v biases (``attention_bias``); Qwen3 by a per-head RMSNorm
    on q and k before RoPE (``qk_norm``). Everything else is shared.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be > 0")

    @property
    def num_queries_per_kv(self) -> int:
        """GQA group size: query heads sharing one KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> ModelConfig:
        """Build from a ``transformers.PretrainedConfig`` (v4 or v5 RoPE conventions)."""
        architecture = _architecture(hf_config)
        _refuse_unsupported_features(hf_config)
        rope_params = _rope_params(hf_config)
        head_dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // hf_config.num_attention_heads
        )
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None)
        return cls(
            architecture=architecture,
            vocab_size=int(hf_config.vocab_size),
            hidden_size=int(hf_config.hidden_size),
            intermediate_size=int(hf_config.intermediate_size),
            num_hidden_layers=int(hf_config.num_hidden_layers),
            num_attention_heads=int(hf_config.num_attention_heads),
            num_key_value_heads=int(num_kv_heads or hf_config.num_attention_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=float(rope_params.get("rope_theta", 10000.0)),
            rope_scaling=RopeScaling.from_hf(rope_params),
            max_position_embeddings=int(hf_config.max_position_embeddings),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=_attention_bias(hf_config, architecture),
            qk_norm=architecture == "Qwen3ForCausalLM",
            eos_token_ids=_eos_ids(getattr(hf_config, "eos_token_id", None)),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
        )


def _architecture(hf_config: Any) -> str:
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        by_type = {
            "llama": "LlamaForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
        }
        model_type = getattr(hf_config, "model_type", "")
        if model_type not in by_type:
            raise ValueError(
                f"unsupported model_type {model_type!r} (no 'architectures' in config); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        return by_type[model_type]
    if len(architectures) != 1 or architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {architectures!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return str(architectures[0])


def _refuse_unsupported_features(hf_config: Any) -> None:
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf_config.hidden_act!r}; only 'silu'")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("unsupported: mlp_bias=True")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("unsupported: use_sliding_window=True (sliding-window attention)")
    if getattr(hf_config, "pretraining_tp", 1) not in (None, 1):
        raise ValueError("unsupported: pretraining_tp != 1")


def _rope_params(hf_config: Any) -> dict[str, Any]:
    """Merge v5 ``rope_parameters`` and v4 ``rope_theta`` + ``rope_scaling`` into one dict."""
    params: dict[str, Any] = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    for key, value in dict(scaling).items():
        params.setdefault(key, value)
    theta = getattr(hf_config, "rope_theta", None)
    if theta is not None:
        params.setdefault("rope_theta", theta)
    if "partial_rotary_factor" in params and params["partial_rotary_factor"] != 1.0:
        raise ValueError("unsupported: partial_rotary_factor != 1.0")
    return params


def _attention_bias(hf_config: Any, architecture: str) -> bool:
    if architecture == "Qwen2ForCausalLM":
        return True  # Qwen2 always has q/k/v biases (no o_proj bias)
    if getattr(hf_config, "attention_bias", False):
        raise ValueError(f"unsupported: attention_bias=True for {architecture} (o_proj bias)")
    return False


def _eos_ids(eos: Any) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
