"""Factories that turn an :class:`EngineConfig` into the engine's parts (device, model, limits)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from engine.config import ConfigError, EngineConfig, ResolvedFeatures
from engine.device import CpuDevice, CudaDevice, Device
from engine.model.config import ModelConfig
from engine.model.loader import (
    build_random_model,
    load_model,
    qwen3_0_6b_config,
    qwen3_8b_config,
)
from engine.scheduler.scheduler_config import SchedulerConfig

__all__ = ["build_device", "build_model", "load_model_config", "scheduler_config_for", "DTYPES"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
NAMED_CONFIGS = {"qwen3-0.6b": qwen3_0_6b_config, "qwen3-8b": qwen3_8b_config}


def build_device(config: EngineConfig) -> Device:
    if config.is_cuda:
        index = int(config.device.split(":")[1]) if ":" in config.device else 0
        return CudaDevice(index)
    return CpuDevice()


def load_model_config(source: str) -> ModelConfig:
    """A model shape from a named preset (``qwen3-0.6b``), a HF ``config.json``, or a folder."""
    if source in NAMED_CONFIGS:
        return NAMED_CONFIGS[source]()
    from transformers import AutoConfig

    if os.path.isdir(source):
        return ModelConfig.from_hf_config(AutoConfig.from_pretrained(source, local_files_only=True))
    if not os.path.isfile(source):
        raise ConfigError(
            f"model config {source!r}: not a file, a folder, or one of {sorted(NAMED_CONFIGS)}"
        )
    with open(source, encoding="utf-8") as f:
        try:
            data: dict[str, Any] = json.load(f)
        except json.JSONDecodeError as err:
            raise ConfigError(f"model config {source}: not JSON ({err.msg})") from None
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise ConfigError(f"model config {source}: no model_type (e.g. 'qwen3', 'llama')")
    return ModelConfig.from_hf_config(AutoConfig.for_model(model_type, **data))


def build_model(
    config: EngineConfig, features: ResolvedFeatures, device: Device
) -> tuple[Any, ModelConfig]:
    dtype = DTYPES[config.dtype]
    if config.model is not None:
        if not os.path.isdir(config.model):
            raise ConfigError(f"model folder not found: {config.model}")
        return load_model(
            config.model, dtype, device.torch_device, use_triton=features.triton_kernels
        )
    assert config.model_config is not None
    model_config = load_model_config(config.model_config)
    model = build_random_model(
        model_config, dtype, device.torch_device, config.seed, use_triton=features.triton_kernels
    )
    return model, model_config


def scheduler_config_for(config: EngineConfig, model_config: ModelConfig) -> SchedulerConfig:
    """Scheduler limits; ``max_model_len`` defaults to what the model and the KV pool allow."""
    kv_capacity = config.num_kv_blocks * config.block_size
    max_model_len = config.max_model_len or min(model_config.max_position_embeddings, kv_capacity)
    if max_model_len > model_config.max_position_embeddings:
        raise ConfigError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
            f"{model_config.max_position_embeddings}"
        )
    if max_model_len > kv_capacity:
        raise ConfigError(
            f"max_model_len={max_model_len} does not fit the KV pool of {config.num_kv_blocks} "
            f"blocks x {config.block_size} slots; raise num_kv_blocks"
        )
    try:
        return SchedulerConfig(
            max_model_len=max_model_len,
            num_gpu_blocks=config.num_kv_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            enable_prefix_caching=config.enable_prefix_caching,
            num_spec_tokens=config.num_spec_tokens,
            debug=config.debug_invariants,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None
