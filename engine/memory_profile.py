"""Measuring device memory for the KV pool (docs/design.md §2.13); the arithmetic is in
:mod:`engine.kv_sizing`.

On a CUDA device with ``num_kv_blocks`` on auto, after the weights are loaded, a *probe* runner
is built with a KV pool just large enough for the profiling steps, exactly as the real one will
be (state table, step buffers, proposer, CUDA graphs captured at every size). Measured:

* ``runner``: the bytes its tensors hold, less its probe KV pool;
* ``graphs``: the rest of the device memory it took (``mem_get_info``): the CUDA graph pool and
  other non-tensor memory;
* ``peak activation``: the peak of allocated bytes above that during
  :func:`engine.warmup.profile_plan`'s steps (``max_num_batched_tokens`` tokens, the sampler at
  ``max_num_seqs`` rows with the heaviest sampling, verify with a proposer).

The probe is then freed and the real runner built with the blocks the budget allows. With tensor
parallelism every rank measures its own device and the pool is the minimum over the ranks.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch

from engine.config import EngineConfig, ResolvedFeatures
from engine.device import Device
from engine.engine_parts import build_runner, fixed_kv_capacity
from engine.kernels.backend import KernelBackend
from engine.kv_sizing import KvBudget, KvCapacity, kv_budget, max_useful_blocks
from engine.model.config import ModelConfig
from engine.warmup import profile_plan, run_steps
from instrument.tracer import Tracer

__all__ = ["size_kv_cache", "profile_kv_budget", "agree_on_blocks"]

_log = logging.getLogger("stepscope.engine")


def size_kv_cache(
    config: EngineConfig,
    features: ResolvedFeatures,
    device: Device,
    model: Any,
    model_config: ModelConfig,
    kernels: KernelBackend,
    group: Any = None,
) -> KvCapacity:
    """The KV pool: ``--num-kv-blocks``, the CPU default, or measured (CUDA, auto); with a
    tensor-parallel ``group`` (``TPGroup``) every rank calls this and gets the minimum."""
    if config.cache.num_kv_blocks is not None or not device.is_cuda:
        kv = fixed_kv_capacity(config)
        budget = None
    else:
        max_model_len = config.scheduler.max_model_len or model_config.max_position_embeddings
        budget = profile_kv_budget(config, features, device, model, max_model_len, kernels)
        cap = max_useful_blocks(
            config.scheduler.resolved_max_num_seqs, max_model_len, config.cache.block_size
        )
        kv = KvCapacity(
            min(budget.num_blocks, cap),
            config.cache.block_size,
            "gpu_memory_utilization",
            budget,
            capped_from=budget.num_blocks if budget.num_blocks > cap else None,
        )
    if group is None or group.world_size == 1:
        return kv
    ranks = agree_on_blocks(group, kv.num_blocks)
    return KvCapacity(min(ranks), kv.block_size, kv.source, budget, tuple(ranks), kv.capped_from)


def agree_on_blocks(group: Any, num_blocks: int) -> list[int]:
    """Every rank's ``num_blocks``, in rank order (a collective on the host control group)."""
    import torch.distributed as dist

    mine = torch.tensor([num_blocks], dtype=torch.int64)
    everyone = [torch.zeros(1, dtype=torch.int64) for _ in range(group.world_size)]
    dist.all_gather(everyone, mine, group=group.cpu_group)
    return [int(t.item()) for t in everyone]


def profile_kv_budget(
    config: EngineConfig,
    features: ResolvedFeatures,
    device: Device,
    model: Any,
    max_model_len: int,
    kernels: KernelBackend,
) -> KvBudget:
    """Build, profile and free a probe runner (module docstring); the budget of this rank."""
    dev = device.torch_device
    _release(dev)
    free_bytes, total_bytes = torch.cuda.mem_get_info(dev)
    weights_bytes = torch.cuda.memory_allocated(dev)  # the model (and draft heads) only, so far
    probe_blocks = _probe_blocks(config, max_model_len)
    quiet = Tracer(enabled=False)
    probe_config = config.resolved(max_model_len, probe_blocks)
    plan = profile_plan(probe_config.scheduler, probe_config.cache, config.spec.num_spec_tokens)
    probe = build_runner(probe_config, features, device, model, quiet, kernels)
    try:
        _release(dev)
        probe_free = torch.cuda.mem_get_info(dev)[0]
        allocated = torch.cuda.memory_allocated(dev)
        bytes_per_block = probe.kv_bytes_per_block()
        held = allocated - weights_bytes  # the probe's tensors
        runner_bytes = max(0, held - probe_blocks * bytes_per_block)
        graph_bytes = max(0, (free_bytes - probe_free) - held)
        torch.cuda.reset_peak_memory_stats(dev)
        run_steps(probe, plan, quiet)
        torch.cuda.synchronize(dev)
        peak_bytes = max(0, torch.cuda.max_memory_allocated(dev) - allocated)
    finally:
        probe.close()
        del probe
        _release(dev)
    budget = kv_budget(
        total_bytes=total_bytes,
        free_bytes=free_bytes,
        weights_bytes=weights_bytes,
        peak_activation_bytes=peak_bytes,
        graph_bytes=graph_bytes,
        utilization=config.cache.gpu_memory_utilization,
        bytes_per_block=bytes_per_block,
        runner_bytes=runner_bytes,
    )
    _log.info("KV budget: %s", budget.describe())
    return budget


def _probe_blocks(config: EngineConfig, max_model_len: int) -> int:
    """The probe's pool: enough blocks for the longest profiling request."""
    k = config.spec.num_spec_tokens
    longest = min(config.scheduler.max_num_batched_tokens, max_model_len - 2 - k)
    return config.cache.blocks_for(longest + 2 + 2 * k) + 1


def _release(dev: torch.device) -> None:
    """Free what Python and the caching allocator hold but no tensor uses."""
    gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
