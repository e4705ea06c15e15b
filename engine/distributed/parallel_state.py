"""Tensor-parallel process groups: this rank, the world size, and the collectives the model uses.

A rank joins two groups over one rendezvous store:

* ``device_group`` -- the model's collectives (all-reduce after ``o_proj``/``down_proj`` and the
  vocab-parallel embedding, all-gather of the logits), NCCL on CUDA and gloo on the CPU. They are
  issued from the compute stream (the CPU device's compute worker thread), in the same order on
  every rank because every rank enqueues the same runner calls in the same order.
* ``cpu_group`` -- always gloo: control traffic from the engine thread (each step's message from
  rank 0, clock alignment, shutdown). Separate from ``device_group`` because the engine thread and
  the compute thread issue collectives concurrently, and one group's collectives must be issued in
  one order on every rank.

Every collective has the group's timeout, so a rank that died or hangs turns into an error on the
others instead of a hang (gloo raises as soon as the peer's socket closes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from instrument.sync_detect import cold_region

__all__ = [
    "TPGroup",
    "ClockSync",
    "init_tp_group",
    "destroy_tp_group",
    "measure_clock_offset",
    "CollectiveRecorder",
]

# (name, start_ns, end_ns) of one collective as the host saw it; set only where the collective
# is synchronous on the host (the CPU device), so the host interval is the collective's interval.
CollectiveRecorder = Callable[[str, int, int], None]

_CLOCK_ROUNDS = 8
# torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there); the GPU
# machine's torch 2.11 has only all_gather_into_tensor. Same semantics.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class ClockSync:
    """This rank's clock minus rank 0's (``offset_ns``), from the round trip with the least
    ``rtt_ns`` (NTP-style: the error is at most ``rtt_ns / 2``). Zero for rank 0."""

    offset_ns: int
    rtt_ns: int


class TPGroup:
    """One rank's view of a tensor-parallel group (see the module docstring for the groups).

    ``recorder``: called around each device collective when set (CPU device only).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        device_group: Any,
        cpu_group: Any,
        on_cuda: bool,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device_group = device_group
        self.cpu_group = cpu_group
        self.on_cuda = on_cuda
        self.recorder: CollectiveRecorder | None = None

    # stepscope: hot
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        recorder = self.recorder
        if recorder is None:
            dist.all_reduce(x, group=self.device_group)
            return x
        start_ns = time.monotonic_ns()
        dist.all_reduce(x, group=self.device_group)
        recorder("all_reduce", start_ns, time.monotonic_ns())
        return x

    # stepscope: hot
    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [n, s]`` on every rank -> ``[n, world_size * s]``, rank 0's columns first."""
        recorder = self.recorder
        start_ns = time.monotonic_ns() if recorder is not None else 0
        x = x.contiguous()
        n, s = x.shape
        out = x.new_empty(self.world_size * n, s)  # [ws * n, s], rank-major
        _all_gather_single(out, x, group=self.device_group)
        full = out.view(self.world_size, n, s).permute(1, 0, 2).reshape(n, self.world_size * s)
        if recorder is not None:
            recorder("all_gather", start_ns, time.monotonic_ns())
        return full

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled over the gloo control group)."""
        box = [obj if self.rank == 0 else None]
        # Host-only (gloo, CPU tensors): its internal .to(cpu) copies are not device syncs.
        with cold_region():
            dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self.cpu_group)


def init_tp_group(
    rank: int,
    world_size: int,
    init_method: str,
    cuda_index: int | None,
    timeout_s: float,
) -> TPGroup:
    """Join the group as ``rank`` (blocks until all ranks have joined, or ``timeout_s``).

    ``cuda_index``: this rank's GPU (NCCL, initialised eagerly so a first collective inside a
    CUDA graph capture finds the communicator ready); None: the CPU (gloo).
    """
    timeout = timedelta(seconds=timeout_s)
    on_cuda = cuda_index is not None
    kwargs: dict[str, Any] = {}
    if cuda_index is not None:
        torch.cuda.set_device(cuda_index)
        kwargs["device_id"] = torch.device("cuda", cuda_index)
    dist.init_process_group(
        backend="nccl" if on_cuda else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        **kwargs,
    )
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    group = TPGroup(rank, world_size, device_group, cpu_group, on_cuda)
    if cuda_index is not None:  # first NCCL collective outside any graph capture
        group.all_reduce(torch.zeros(1, device=torch.device("cuda", cuda_index)))
        torch.cuda.synchronize(cuda_index)
    return group


def destroy_tp_group() -> None:
    """Leave every group of this process (no-op when none)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def measure_clock_offset(group: TPGroup, rounds: int = _CLOCK_ROUNDS) -> ClockSync:
    """Every rank's clock against rank 0's (collective on ``cpu_group``: all ranks call it).

    A barrier first; then rank 0 answers ``rounds`` pings from each other rank in turn, stamping
    ``time.monotonic_ns()`` on receipt. On one host CLOCK_MONOTONIC is shared and the offset is
    noise within ``rtt/2``; across hosts it is the correction the merged timeline needs.
    """
    group.barrier()
    if group.rank == 0:
        stamp = torch.zeros(1, dtype=torch.int64)
        for peer in range(1, group.world_size):
            for _ in range(rounds):
                dist.recv(stamp, src=peer, group=group.cpu_group)
                stamp[0] = time.monotonic_ns()
                dist.send(stamp, dst=peer, group=group.cpu_group)
        group.barrier()
        return ClockSync(0, 0)
    best = ClockSync(0, -1)
    stamp = torch.zeros(1, dtype=torch.int64)
    for _ in range(rounds):
        sent_ns = time.monotonic_ns()
        stamp[0] = sent_ns
        dist.send(stamp, dst=0, group=group.cpu_group)
        dist.recv(stamp, src=0, group=group.cpu_group)
        back_ns = time.monotonic_ns()
        rtt = back_ns - sent_ns
        if best.rtt_ns < 0 or rtt < best.rtt_ns:
            best = ClockSync((sent_ns + back_ns) // 2 - int(stamp[0]), rtt)
    group.barrier()
    return best
