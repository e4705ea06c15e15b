"""Build a LlamaForCausalLM from a HF checkpoint folder, or with seeded random weights."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from engine.config import ConfigError
from engine.distributed.parallel_linear import shard_specs
from engine.distributed.parallel_state import TPGroup
from engine.kernels.backend import KernelBackend
from engine.model.config import ModelConfig
from engine.model.layers import merge_weights
from engine.model.llama import LlamaForCausalLM

__all__ = [
    "build_random_model",
    "load_model",
    "load_state_dict",
    "load_tokenizer",
    "qwen3_0_6b_config",
    "qwen3_8b_config",
]

_INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that the engine recomputes itself.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    kernels: KernelBackend | None = None,
    tp: TPGroup | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Load ``config.json`` and the ``*.safetensors`` weights of a HF checkpoint folder
    (``tp``: this tensor-parallel rank's shard of every weight).

    Raises ``ValueError`` for an unsupported architecture and for any missing or unexpected
    tensor (named in the message), and ``FileNotFoundError`` when no weights are found.
    """
    from transformers import AutoConfig

    folder = Path(path)
    check_checkpoint_folder(folder)
    try:
        hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{folder}: cannot read its config.json as a HF model: {err}") from None
    config = ModelConfig.from_hf_config(hf_config)
    model = LlamaForCausalLM(config, dtype, device, kernels=kernels, tp=tp)
    load_state_dict(model, _read_safetensors(folder))
    model.eval()
    return model, config


# Folders of stepscope's own speculative heads: ``config.json`` names them in "architecture"
# (singular), and which --spec-method loads them.
_HEAD_ARCHITECTURES = {"StepscopeEagleHead": "eagle", "StepscopeMTPModule": "mtp"}


def check_checkpoint_folder(folder: Path) -> None:
    """A clear :class:`ConfigError` for a folder that is not a HF causal-LM checkpoint (no
    config.json, not JSON, or an EAGLE / MTP head folder given where a model is expected)."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{folder}: no config.json (not a HF checkpoint folder)")
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{config_path}: not JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{config_path}: expected a JSON object")
    head = data.get("architecture")
    if head in _HEAD_ARCHITECTURES:
        raise ConfigError(
            f"{folder} holds a {head} (a speculative head for --spec-method "
            f"{_HEAD_ARCHITECTURES[head]}), not a causal LM checkpoint; a model or a draft "
            "model folder needs a HF config.json with model_type"
        )


def load_state_dict(model: LlamaForCausalLM, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` (HF names) into ``model``, casting to its dtype; strict by name and shape.

    The merged QKV / gate-up weights alias the HF-named parameters, so they follow the copy.
    A tensor-parallel model takes its rank's slice of each full checkpoint tensor."""
    merge_weights(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    specs = shard_specs(model)  # empty unless tensor parallel
    tied = model.config.tie_word_embeddings
    expected = {name for name in params if not (tied and name == "lm_head.weight")}
    given = {name for name in tensors if not name.endswith(_IGNORED_SUFFIXES)}
    if tied:
        given.discard("lm_head.weight")  # some tied checkpoints still store it
    missing = sorted(expected - given)
    unexpected = sorted(given - expected)
    if missing:
        raise ValueError(f"checkpoint is missing tensor(s): {', '.join(missing)}")
    if unexpected:
        raise ValueError(f"checkpoint has unexpected tensor(s): {', '.join(unexpected)}")
    with torch.no_grad():
        for name in sorted(expected):
            param, tensor = params[name], tensors[name]
            if name in specs:
                tensor = specs[name].shard(tensor)
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"tensor {name}: checkpoint shape {tuple(tensor.shape)}, "
                    f"model expects {tuple(param.shape)}"
                )
            param.copy_(tensor.to(param.dtype))


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded (with index) safetensors checkpoint, on CPU."""
    from safetensors.torch import load_file

    index = folder / _INDEX_FILE
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted({folder / shard for shard in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file), device="cpu"))
    return tensors


def build_random_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int,
    kernels: KernelBackend | None = None,
    tp: TPGroup | None = None,
) -> LlamaForCausalLM:
    """A model of ``config``'s shape with seeded weights (for real-shape benchmarks).

    Matrices ~ N(0, 0.02) (HF's initializer_range), norms = 1, biases ~ N(0, 0.02); with the
    final norm this gives logits of std ~ 0.02 * sqrt(hidden), neither flat nor one-hot.
    With ``tp`` each rank draws every full tensor in the same order and keeps its shard, so the
    weights equal the single-rank model's (one full tensor at a time in memory).
    """
    model = LlamaForCausalLM(config, dtype, device, kernels=kernels, tp=tp)
    generator = torch.Generator(device=torch.device(device)).manual_seed(seed)
    specs = shard_specs(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            spec = specs.get(name)
            if spec is None:
                param.normal_(0.0, 0.02, generator=generator)
                continue
            full = param.new_empty(spec.full_shape(param.shape))
            param.copy_(spec.shard(full.normal_(0.0, 0.02, generator=generator)))
    merge_weights(model)
    model.eval()
    return model


def qwen3_0_6b_config() -> ModelConfig:
    """The Qwen3-0.6B shape, for benchmarks with random weights."""
    return ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        qk_norm=True,
        eos_token_ids=(151645, 151643),
        bos_token_id=151643,
    )


def qwen3_8b_config() -> ModelConfig:
    """The Qwen3-8B shape, for benchmarks with random weights (16 GB in bf16)."""
    return dataclasses.replace(
        qwen3_0_6b_config(),
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        tie_word_embeddings=False,
    )


def load_tokenizer(path: str | Path) -> Any:
    """``transformers.AutoTokenizer`` from local files only."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(path), local_files_only=True)
