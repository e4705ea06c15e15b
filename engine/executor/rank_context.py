"""What one tensor-parallel rank builds: its device (``cuda:<base + rank>`` or a CPU stand-in
named ``gpu:<rank>`` in the trace), its shard of the model, and its trace metadata.

:class:`RankContext` is what ``EngineCore`` receives as ``tp``; rank 0's is the
:class:`~engine.executor.tp_driver.TPDriver` (which also owns the other ranks' processes),
the others' is a plain :class:`RankContext` made by :mod:`engine.executor.worker`.
"""

from __future__ import annotations

import os
from typing import Any

from engine.config import ConfigError, EngineConfig
from engine.device import CpuDevice, CudaDevice, Device
from engine.distributed.parallel_state import ClockSync, TPGroup, destroy_tp_group
from engine.kernels.backend import KernelBackend
from engine.model.config import ModelConfig
from engine.model.loader import build_random_model, load_model
from instrument.schema import DEVICE_COMPUTE, Arg, device_track_name
from instrument.tracer import Tracer

__all__ = ["RankContext", "RankCpuDevice", "cuda_index_for_rank", "check_model_splits"]


class RankCpuDevice(CpuDevice):
    """The CPU device of rank ``rank``: its device tracks are ``gpu:<rank> ...``."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.index = rank


def cuda_index_for_rank(config: EngineConfig, rank: int) -> int | None:
    """GPU of ``rank``: the configured device's index plus the rank; None on the CPU."""
    if not config.parallel.is_cuda:
        return None
    return config.parallel.cuda_index + rank


def check_model_splits(model_config: ModelConfig, world_size: int) -> None:
    """Raise :class:`ConfigError` unless heads, KV heads and the MLP split over the ranks."""
    sizes = {
        "num_attention_heads": model_config.num_attention_heads,
        "num_key_value_heads": model_config.num_key_value_heads,
        "intermediate_size": model_config.intermediate_size,
    }
    bad = [f"{k}={v}" for k, v in sizes.items() if v % world_size]
    if bad:
        raise ConfigError(
            f"tensor_parallel_size={world_size} does not divide {', '.join(bad)} "
            "(every rank needs whole query and KV heads)"
        )


class RankContext:
    """One rank's tensor-parallel state, handed to ``EngineCore(tp=...)``.

    Args:
        group: the joined process group.
        clock: this rank's clock offset to rank 0, measured at start-up.
    """

    def __init__(self, group: TPGroup, clock: ClockSync) -> None:
        self.group = group
        self.clock = clock

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def build_device(self, config: EngineConfig) -> Device:
        index = cuda_index_for_rank(config, self.rank)
        return RankCpuDevice(self.rank) if index is None else CudaDevice(index)

    def build_model(
        self, config: EngineConfig, device: Device, kernels: KernelBackend
    ) -> tuple[Any, ModelConfig]:
        """This rank's shard: of a checkpoint folder, or of the seeded random model (the same
        weights as the single-rank model of that seed)."""
        from engine.engine_parts import DTYPES, load_model_config  # in the child: after joining

        source = config.source
        dtype = DTYPES[source.dtype]
        if source.model is not None:
            if not os.path.isdir(source.model):
                raise ConfigError(f"model folder not found: {source.model}")
            return load_model(source.model, dtype, device.torch_device, kernels, tp=self.group)
        assert source.model_config is not None
        model_config = load_model_config(source.model_config)
        model = build_random_model(
            model_config, dtype, device.torch_device, source.seed, kernels, tp=self.group
        )
        return model, model_config

    def attach(self, runner: Any, tracer: Tracer) -> Any:
        """The runner ``EngineCore`` should call (rank 0 wraps it to broadcast each call), once
        every rank has built its own (a barrier).

        On the CPU device collectives are synchronous on the compute worker thread, so each
        is recorded as an ``all_reduce``/``all_gather`` slice on this rank's compute track."""
        if not self.group.on_cuda and tracer.enabled:
            track = device_track_name(self.rank, DEVICE_COMPUTE)

            def record(name: str, start_ns: int, end_ns: int) -> None:
                tracer.slice_at(track, name, start_ns, end_ns)

            self.group.recorder = record
        self.group.barrier()  # every rank built: the first step does not wait for a slow build
        return runner

    def record_metadata(self, tracer: Tracer) -> None:
        """``rank``, ``world_size`` and the clock offset into this rank's trace metadata."""
        tracer.metadata(
            **{
                Arg.RANK.value: self.rank,
                Arg.WORLD_SIZE.value: self.world_size,
                Arg.CLOCK_OFFSET_NS.value: self.clock.offset_ns,
                Arg.CLOCK_RTT_NS.value: self.clock.rtt_ns,
            }
        )

    def close(self) -> None:
        """Leave the process groups (idempotent)."""
        self.group.recorder = None
        destroy_tp_group()
