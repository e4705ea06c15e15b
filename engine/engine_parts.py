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

from engine.config import ConfigError, EngineConfig, ResolvedFeatures, mixed_graph_max_tokens
from engine.device import CpuDevice, CudaDevice, Device
from engine.kernels.backend import KernelBackend, create_kernel_backend
from engine.kv_sizing import CPU_DEFAULT_NUM_BLOCKS, KvCapacity
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
from instrument.schema import REQUESTED_AUTO, Arg, ConfigArg, Instant
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
    "fixed_kv_capacity",
    "load_model_config",
    "record_start",
    "resolve_batch_limits",
    "resolve_max_model_len",
    "startup_args",
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


def resolve_batch_limits(config: EngineConfig) -> tuple[EngineConfig, str]:
    """``config`` with ``max_num_seqs`` resolved for its device (``EngineConfig.with_batch_limits``:
    by the CUDA device's total memory, docs/design.md §2.1), and where the number came from."""
    total = None
    if config.parallel.is_cuda and torch.cuda.is_available():  # else resolve_features refuses it
        total = int(torch.cuda.get_device_properties(config.parallel.cuda_index).total_memory)
    return config.with_batch_limits(total)


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


def build_kernels(features: ResolvedFeatures, invariant: bool = False) -> KernelBackend:
    """The engine's one kernel backend, from the resolved ``triton_kernels`` feature;
    ``invariant``: batch-invariant (``--batch-invariant``, docs/design.md §2.16)."""
    return create_kernel_backend("triton" if features.triton_kernels else "torch", invariant)


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
    ``EngineCore`` and every tensor-parallel worker use. ``config`` has what start-up resolves
    filled in (:meth:`EngineConfig.resolved`: ``max_model_len``, the KV pool's blocks).

    A CUDA-graph capture that failed is reported into ``features`` here, before
    :func:`record_start` writes the decisions: under auto the runner stays eager and the
    decision says why; an explicit ``cuda_graphs=True`` is a :class:`ConfigError`. A failed
    decode capture turns ``mixed_cuda_graphs`` and ``spec_cuda_graphs`` off too; a failed mixed
    (speculative) capture only that one."""
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
        mixed_graph_max_tokens=(
            mixed_graph_max_tokens(config) if features.mixed_cuda_graphs else 0
        ),
        spec_cuda_graphs=features.spec_cuda_graphs and features.cuda_graphs,
        trace_begins=config.tracing.trace_begins,
        graph_stamps=config.tracing.graph_stamps,
        trace_core=config.tracing.trace_core,
    )
    graphs = runner.graphs
    fallen: list[tuple[str, str, str]] = []  # (feature, reason, what runs eagerly)
    if graphs.failure is not None:
        fallen.append(("cuda_graphs", graphs.failure, "decode steps"))
    mixed_failure = graphs.failure if graphs.failure is not None else graphs.mixed_failure
    if mixed_failure is not None and features.mixed_cuda_graphs:
        fallen.append(("mixed_cuda_graphs", mixed_failure, "mixed steps"))
    spec_failure = graphs.failure if graphs.failure is not None else runner.spec_graphs.failure
    if spec_failure is not None and features.spec_cuda_graphs:
        fallen.append(("spec_cuda_graphs", spec_failure, "speculative steps"))
    for feature, failure, what in fallen:
        try:
            features.fall_back(feature, failure)
        except ConfigError:
            runner.close()
            raise
        _log.warning("%s: %s; %s run eagerly", feature, failure, what)
    return runner


def record_start(
    tracer: Tracer,
    config: EngineConfig,
    features: ResolvedFeatures,
    max_model_len: int,
    kv: KvCapacity | None = None,
    warmup: tuple[float, int] = (0.0, 0),
    compiles_at_start: int = 0,
    captured: dict[str, str] | None = None,
    max_num_seqs_source: str | None = None,
) -> None:
    """The ``engine_config`` instant (the config, the resolved KV pool ``kv`` and the
    ``(seconds, steps)`` of warm-up; ``schema.ConfigArg``) and one ``feature_decision`` instant
    per feature (docs/design.md §4.6), each decision also logged. ``captured``: the runner's
    captured CUDA graph shapes (``CudaGraphRunner.describe()``: ``cuda_graph_sizes``,
    ``mixed_graph_buckets``), recorded in ``engine_config``; ``max_num_seqs_source``: where
    ``max_num_seqs`` came from (:func:`resolve_batch_limits`; rank 0 only)."""
    tracer.instant(
        Instant.ENGINE_CONFIG.value,
        scope="process",
        **config.flat(),
        **startup_args(kv or fixed_kv_capacity(config), max_model_len, warmup),
        **{ConfigArg.TRITON_COMPILES_STARTUP.value: compiles_at_start},
        **(captured or {}),
        **(
            {}
            if max_num_seqs_source is None
            else {ConfigArg.MAX_NUM_SEQS_SOURCE.value: max_num_seqs_source}
        ),
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


def fixed_kv_capacity(config: EngineConfig) -> KvCapacity:
    """The KV pool when no device memory is measured: ``--num-kv-blocks`` when given, else the
    CPU default (on CUDA under auto, ``engine.memory_profile.size_kv_cache`` measures instead)."""
    cache = config.cache
    if cache.num_kv_blocks is not None:
        return KvCapacity(cache.num_kv_blocks, cache.block_size, "num_kv_blocks")
    return KvCapacity(CPU_DEFAULT_NUM_BLOCKS, cache.block_size, "cpu default")


def _num_blocks(config: EngineConfig, num_blocks: int | None) -> int:
    return num_blocks if num_blocks is not None else fixed_kv_capacity(config).num_blocks


def startup_args(
    kv: KvCapacity, max_model_len: int, warmup: tuple[float, int]
) -> dict[str, object]:
    """What start-up resolved, as ``engine_config`` args (names from ``schema.ConfigArg``)."""
    c = ConfigArg
    args: dict[str, object] = {
        c.MAX_MODEL_LEN_RESOLVED.value: max_model_len,
        c.KV_NUM_BLOCKS.value: kv.num_blocks,
        c.KV_NUM_TOKENS.value: kv.num_tokens,
        c.KV_SOURCE.value: kv.source,
        c.KV_MAX_CONCURRENCY.value: round(kv.concurrency(max_model_len), 3),
        c.WARMUP_S.value: round(warmup[0], 3),
        c.WARMUP_STEPS.value: warmup[1],
    }
    b = kv.budget
    if b is not None:
        args.update(
            {
                c.KV_BYTES_PER_BLOCK.value: b.bytes_per_block,
                c.KV_TOTAL_BYTES.value: b.total_bytes,
                c.KV_FREE_BYTES.value: b.free_bytes,
                c.KV_WEIGHTS_BYTES.value: b.weights_bytes,
                c.KV_RUNNER_BYTES.value: b.runner_bytes,
                c.KV_GRAPH_BYTES.value: b.graph_bytes,
                c.KV_PEAK_ACTIVATION_BYTES.value: b.peak_activation_bytes,
            }
        )
    return args


def resolve_max_model_len(
    config: EngineConfig, model_config: ModelConfig, kv: KvCapacity | None = None
) -> int:
    """``max_model_len`` for the KV pool ``kv`` (default :func:`fixed_kv_capacity`); the engine
    passes ``config.resolved(this, kv.num_blocks)`` on.

    It defaults to the model's ``max_position_embeddings``; a fixed pool smaller than that lowers
    the default to the pool (with a warning), a pool sized from device memory must hold one such
    request (else a start-up error with the numbers)."""
    kv = kv or fixed_kv_capacity(config)
    asked, block_size = config.scheduler.max_model_len, config.cache.block_size
    kv_capacity = kv.num_tokens
    sized = kv.budget is not None
    limit = model_config.max_position_embeddings
    max_model_len = asked or (limit if sized else min(limit, kv_capacity))
    if asked is None and kv_capacity < limit and not sized:
        _log.warning(
            "the KV pool (%d blocks x %d slots = %d tokens) is smaller than the model's "
            "max_position_embeddings=%d: max_model_len is %d; a request whose prompt + max_tokens "
            "exceeds it is refused (raise --num-kv-blocks for longer requests)",
            kv.num_blocks,
            block_size,
            kv_capacity,
            limit,
            max_model_len,
        )
    if max_model_len > limit:
        raise ConfigError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}"
        )
    if sized:
        kv.check_fits(max_model_len)
    if max_model_len > kv_capacity:
        raise ConfigError(
            f"max_model_len={max_model_len} does not fit the KV pool of {kv.num_blocks} "
            f"blocks x {block_size} slots; raise num_kv_blocks"
        )
    return max_model_len


def estimate_state_bytes(
    config: EngineConfig,
    model_config: ModelConfig,
    max_model_len: int,
    num_blocks: int | None = None,
) -> dict[str, int]:
    """A lower bound on the bytes the KV pool and the request state table will take.

    ``kv_cache``: layers x 2 (K, V) x blocks x block_size x KV heads (this rank's share) x
    head_dim x dtype size, on the device. ``request_state``: per state-table row (max_num_seqs + 1)
    the token ids (int64 x max_model_len), the block table (int32 x max blocks per request) and
    the penalty books (int32 + bool per vocab entry), on the device. ``host_blocks``: the
    scheduler's block pool on the host. Draft/EAGLE state and activations are not counted.
    """
    dtype_bytes = DTYPES[config.source.dtype].itemsize
    num_blocks = _num_blocks(config, num_blocks)
    kv_heads = math.ceil(model_config.num_key_value_heads / config.parallel.tensor_parallel_size)
    kv = (
        model_config.num_hidden_layers
        * 2
        * num_blocks
        * config.cache.block_size
        * kv_heads
        * model_config.head_dim
        * dtype_bytes
    )
    rows = config.scheduler.resolved_max_num_seqs + 1
    blocks_per_req = math.ceil(max_model_len / config.cache.block_size)
    per_row = max_model_len * 8 + blocks_per_req * 4 + model_config.vocab_size * 5
    return {
        "kv_cache": kv,
        "request_state": rows * per_row,
        "host_blocks": num_blocks * _HOST_BYTES_PER_BLOCK,
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
    config: EngineConfig,
    model_config: ModelConfig,
    max_model_len: int,
    device: Device,
    num_blocks: int | None = None,
) -> None:
    """Refuse at start-up, with the numbers, sizes whose state cannot fit in free memory
    (instead of a MemoryError or an allocator error deep in the runner)."""
    num_blocks = _num_blocks(config, num_blocks)
    need = estimate_state_bytes(config, model_config, max_model_len, num_blocks)
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
            f"{num_blocks} blocks x {config.cache.block_size} slots x "
            f"{model_config.num_hidden_layers} layers; request state "
            f"{need['request_state'] / gib:.2f} GiB = {config.scheduler.max_num_seqs} seqs x max_model_len "
            f"{max_model_len}; block pool {need['host_blocks'] / gib:.2f} GiB on the host); lower "
            "--num-kv-blocks, --max-num-seqs or --max-model-len"
        )
