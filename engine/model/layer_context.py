"""What every model layer is built with: dtype, device, the kernel backend and the TP group."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.distributed.parallel_state import TPGroup
from engine.kernels.backend import KernelBackend, TorchKernels

__all__ = ["LayerContext", "torch_reference"]


@dataclass(frozen=True)
class LayerContext:
    """Fixed for a model's life and shared by all its layers.

    ``kernels``: the one kernel backend the engine chose at start-up (docs/design.md §2.11);
    ``tp``: this rank's tensor-parallel group, or None on a single rank.
    """

    dtype: torch.dtype
    device: torch.device | str
    kernels: KernelBackend
    tp: TPGroup | None = None


def torch_reference(ctx: LayerContext) -> LayerContext:
    """``ctx`` with the torch reference kernels (for layers that always ran them)."""
    return dataclasses.replace(ctx, kernels=TorchKernels())
