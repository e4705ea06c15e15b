"""Factories that turn an :class:`EngineConfig` into the engine's parts (device, kernels, model,
limits, proposer, runner).

``EngineCore`` and every tensor-parallel worker build their runner through :func:`build_runner`,
with the one kernel backend :func:`build_kernels` chose from the resolved features, and record the
same start-up instants (:func:`record_start`)."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import replace
from typing import Any

import torch

from engine.config import ConfigError, EngineConfig, ResolvedFeatures
from engine.device import CpuDevice, CudaDevice, Device
from engine.kernels.backend import KernelBackend, create_kernel_backend
from engine.model.config import ModelConfig
from engine.model.layer_context import LayerContext
from engine.model.loader import (
    build_random_model,
    load_model,
    qwen3_0_6b_config,
    qwen3_8b_config,
)
from engine.runner.model_runner import ModelRunner
from engine.spec.proposer import Proposer, ProposerContext, create_proposer
from instrument.schema import REQUESTED_AUTO, Arg, Instant
from instrument.tracer import Tracer

__all__ = [
    "DTYPES",
    "build_device",
    "build_kernels",
    "build_model",
    "build_proposer",
    "build_runner",
    "check_state_fits",
    "estimate_state_bytes",
    "load_model_config",
    "record_start",
    "resolve_max_model_len",
]

_log = logging.getLogger("stepscope.engine")
# Host bytes per KV block in the scheduler's block pool (a Python object and its list/dict
# entries; measured ~150 B with CPython 3.12, rounded up).
_HOST_BYTES_PER_BLOCK = 200

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
NAMED_CONFIGS = {"qwen3-0.6b": qwen3_0_6b_config, "qwen3-8b": qwen3_8b_config}


def build_device(config: EngineConfig) -> Device:
    if config.parallel.is_cuda:
        return CudaDevice(config.parallel.cuda_index)
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


def build_kernels(features: ResolvedFeatures) -> KernelBackend:
    """The engine's one kernel backend, from the resolved ``triton_kernels`` feature."""
    return create_kernel_backend("triton" if features.triton_kernels else "torch")


def build_model(
    config: EngineConfig, device: Device, kernels: KernelBackend
) -> tuple[Any, ModelConfig]:
    source = config.source
    dtype = DTYPES[source.dtype]
    if source.model is not None:
        if not os.path.isdir(source.model):
            raise ConfigError(f"model folder not found: {source.model}")
        return load_model(source.model, dtype, device.torch_device, kernels=kernels)
    assert source.model_config is not None
    model_config = load_model_config(source.model_config)
    model = build_random_model(
        model_config, dtype, device.torch_device, source.seed, kernels=kernels
    )
    return model, model_config


def build_proposer(
    config: EngineConfig,
    features: ResolvedFeatures,
    model: Any,
    device: Device,
    kernels: KernelBackend,
) -> Proposer | None:
    """The resolved spec method's proposer (MTP defaults to ``<model>/mtp``), or None.
    ``config``'s scheduler part has ``max_model_len`` resolved."""
    method = features.spec_method
    if method is None:
        return None
    spec = config.spec
    if method == "mtp" and spec.spec_model is None and config.source.model is not None:
        spec = replace(spec, spec_model=os.path.join(config.source.model, "mtp"))
    ctx = ProposerContext(
        target=model,
        spec=spec,
        cache=config.cache,
        limits=config.scheduler,
        layers=LayerContext(DTYPES[config.source.dtype], device.torch_device, kernels),
    )
    return create_proposer(method, ctx)


def build_runner(
    config: EngineConfig,
    features: ResolvedFeatures,
    device: Device,
    model: Any,
    tracer: Tracer,
    kernels: KernelBackend,
) -> ModelRunner:
    """The model runner of ``model`` (with the resolved proposer): the one factory that
    ``EngineCore`` and every tensor-parallel worker use. ``config``'s scheduler part has
    ``max_model_len`` resolved (:meth:`EngineConfig.with_max_model_len`).

    A CUDA-graph capture that failed is reported into ``features`` here, before
    :func:`record_start` writes the decisions: under auto the runner stays eager and the
    decision says why; an explicit ``cuda_graphs=True`` is a :class:`ConfigError`."""
    runner = ModelRunner(
        model,
        device,
        config.scheduler,
        config.cache,
        tracer,
        proposer=build_proposer(config, features, model, device, kernels),
        kernels=kernels,
        seed=config.source.seed,
        cuda_graphs=features.cuda_graphs,
    )
    failure = runner.graphs.failure
    if failure is not None:
        try:
            features.fall_back("cuda_graphs", failure)
        except ConfigError:
            runner.close()
            raise
        _log.warning("cuda_graphs: %s; decode steps run eagerly", failure)
    return runner


def record_start(
    tracer: Tracer, config: EngineConfig, features: ResolvedFeatures, max_model_len: int
) -> None:
    """The ``engine_config`` instant and one ``feature_decision`` instant per feature
    (docs/design.md §4.6), each decision also logged."""
    tracer.instant(
        Instant.ENGINE_CONFIG.value,
        scope="process",
        **config.flat(),
        max_model_len_resolved=max_model_len,
    )
    for d in features.decisions:
        tracer.instant(
            Instant.FEATURE_DECISION.value,
            scope="process",
            **{
                Arg.FEATURE.value: d.feature,
                Arg.REQUESTED.value: REQUESTED_AUTO if d.requested is None else d.requested,
                Arg.RESOLVED.value: d.resolved,
                Arg.REASON.value: d.reason,
                Arg.SHOWN.value: True,
            },
        )
        _log.info(
            "feature %s: requested=%s resolved=%s (%s)",
            d.feature,
            REQUESTED_AUTO if d.requested is None else d.requested,
            d.resolved,
            d.reason,
        )


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """``max_model_len``, defaulting to what the model and the KV pool allow; the engine passes
    ``config.with_max_model_len(this)`` on. Raises :class:`ConfigError` when it cannot fit."""
    cache, asked = config.cache, config.scheduler.max_model_len
    kv_capacity = cache.num_kv_blocks * cache.block_size
    max_model_len = asked or min(model_config.max_position_embeddings, kv_capacity)
    if asked is None and kv_capacity < model_config.max_position_embeddings:
        _log.warning(
            "the KV pool (%d blocks x %d slots = %d tokens) is smaller than the model's "
            "max_position_embeddings=%d: max_model_len is %d; a request whose prompt + max_tokens "
            "exceeds it is refused (raise --num-kv-blocks for longer requests)",
            cache.num_kv_blocks,
            cache.block_size,
            kv_capacity,
            model_config.max_position_embeddings,
            max_model_len,
        )
    if max_model_len > model_config.max_position_embeddings:
        raise ConfigError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
            f"{model_config.max_position_embeddings}"
        )
    if max_model_len > kv_capacity:
        raise ConfigError(
            f"max_model_len={max_model_len} does not fit the KV pool of {cache.num_kv_blocks} "
            f"blocks x {cache.block_size} slots; raise num_kv_blocks"
        )
    return max_model_len


def estimate_state_bytes(
    config: EngineConfig, model_config: ModelConfig, max_model_len: int
) -> dict[str, int]:
    """A lower bound on the bytes the KV pool and the request state table will take.

    ``kv_cache``: layers x 2 (K, V) x blocks x block_size x KV heads (this rank's share) x
    head_dim x dtype size, on the device. ``request_state``: per state-table row (max_num_seqs + 1)
    the token ids (int64 x max_model_len), the block table (int32 x max blocks per request) and
    the penalty books (int32 + bool per vocab entry), on the device. ``host_blocks``: the
    scheduler's block pool on the host. Draft/EAGLE state and activations are not counted.
    """
    dtype_bytes = DTYPES[config.source.dtype].itemsize
    kv_heads = math.ceil(model_config.num_key_value_heads / config.parallel.tensor_parallel_size)
    kv = (
        model_config.num_hidden_layers
        * 2
        * config.cache.num_kv_blocks
        * config.cache.block_size
        * kv_heads
        * model_config.head_dim
        * dtype_bytes
    )
    rows = config.scheduler.max_num_seqs + 1
    blocks_per_req = math.ceil(max_model_len / config.cache.block_size)
    per_row = max_model_len * 8 + blocks_per_req * 4 + model_config.vocab_size * 5
    return {
        "kv_cache": kv,
        "request_state": rows * per_row,
        "host_blocks": config.cache.num_kv_blocks * _HOST_BYTES_PER_BLOCK,
    }


def _host_available_bytes() -> int | None:
    """The kernel's MemAvailable (what can be allocated without swapping), or None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_state_fits(
    config: EngineConfig, model_config: ModelConfig, max_model_len: int, device: Device
) -> None:
    """Refuse at start-up, with the numbers, sizes whose state cannot fit in free memory
    (instead of a MemoryError or an allocator error deep in the runner)."""
    need = estimate_state_bytes(config, model_config, max_model_len)
    on_device = need["kv_cache"] + need["request_state"]
    host = _host_available_bytes()
    if device.is_cuda:
        checks = [
            (
                on_device,
                int(torch.cuda.mem_get_info(device.torch_device)[0]),
                str(device.torch_device),
            ),
            (need["host_blocks"], host, "the host"),
        ]
    else:
        checks = [(on_device + need["host_blocks"], host, "the host (cpu device)")]
    gib = 2**30
    for wanted, available, where in checks:
        if available is None or wanted <= available:
            continue
        raise ConfigError(
            f"the engine's state does not fit: at least {wanted / gib:.2f} GiB needed on {where} "
            f"but {available / gib:.2f} GiB is free (KV cache {need['kv_cache'] / gib:.2f} GiB = "
            f"{config.cache.num_kv_blocks} blocks x {config.cache.block_size} slots x "
            f"{model_config.num_hidden_layers} layers; request state "
            f"{need['request_state'] / gib:.2f} GiB = {config.scheduler.max_num_seqs} seqs x max_model_len "
            f"{max_model_len}; block pool {need['host_blocks'] / gib:.2f} GiB on the host); lower "
            "--num-kv-blocks, --max-num-seqs or --max-model-len"
        )
