"""Device-resident tensors updated from compact host diffs (MRV2's staged writes).

The host never uploads a whole table. It stages ``(row, start, values)`` writes, and one flush
packs them into a host staging buffer, copies that asynchronously to the device on the h2d
stream, and one kernel on the compute stream applies them.

**The ring.** Staging buffers come from a ring of ``ring_depth >= 2`` slots; each slot owns a host
buffer (pinned on CUDA), a device buffer and two events:

* ``copied`` (h2d stream) -- the async copy has finished reading the host buffer. The host waits on
  it before it packs into that slot again, so it never rewrites memory a pending copy reads. A
  wait that actually blocks is counted in ``num_ring_stalls``; with the engine's two steps in
  flight and the default depth of 3 it does not happen. Writes are never skipped or dropped.
* ``applied`` (compute stream) -- the apply kernel has finished reading the device buffer. The
  h2d stream waits on it (a device-side wait, the host does not block) before copying into that
  slot's device buffer again.

Each flush must be applied before its slot comes round again (the runner applies every flush in
the step that made it); ``flush`` raises otherwise instead of overwriting unapplied data.

**One write, one copy.** A flush of a single write (the runner's packed batch every step; a table
with one diff) skips the metadata: its values are copied into the slot's device buffer and
applied with one device-to-device copy into ``gpu[row, start : start + n]`` instead of the
scatter kernel (docs/design.md §2.6).

A slot whose buffers are too small for a flush grows once, after the host has waited for both of
its events (rare; start-up sized batches), so no in-flight copy or kernel sees a freed buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.device import Device, DeviceEvent
from engine.kernels.backend import KernelBackend, TorchKernels

__all__ = ["StagedWriteTensor", "StagedFlush"]

_NUMPY_DTYPES = {
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float32: np.float32,
    torch.bool: np.bool_,
}


@dataclass
class _Slot:
    host_meta: torch.Tensor  # [3 * max_writes + 1] int32: rows | starts | offsets
    host_values: torch.Tensor  # [max_values] base dtype
    dev_meta: torch.Tensor
    dev_values: torch.Tensor
    copied: DeviceEvent
    applied: DeviceEvent
    awaiting_apply: bool = False

    @property
    def max_writes(self) -> int:
        return (self.host_meta.shape[0] - 1) // 3

    @property
    def max_values(self) -> int:
        return self.host_values.shape[0]


@dataclass(frozen=True)
class StagedFlush:
    """One packed batch in flight: the slot it used and the host ints the kernel needs."""

    slot_index: int
    num_writes: int
    num_values: int
    max_len: int
    single: tuple[int, int] | None = None  # (row, start) of a flush of one write: a plain copy


class StagedWriteTensor:
    """A ``[num_rows, num_cols]`` device tensor written through staged, batched diffs."""

    def __init__(
        self,
        device: Device,
        shape: tuple[int, int],
        dtype: torch.dtype,
        *,
        fill: float | int = 0,
        ring_depth: int = 3,
        initial_max_writes: int = 64,
        initial_max_values: int = 1024,
        kernels: KernelBackend | None = None,
    ) -> None:
        if ring_depth < 2:
            raise ValueError(
                f"ring_depth must be >= 2 (one slot in flight, one packing), got {ring_depth}"
            )
        if dtype not in _NUMPY_DTYPES:
            raise ValueError(f"unsupported staged-write dtype {dtype}")
        self.device = device
        self.shape = shape
        self.dtype = dtype
        self.kernels = kernels or TorchKernels()  # default: the torch reference
        # gpu: [num_rows, num_cols] -- the one copy of the truth, owned here.
        self.gpu = torch.full(shape, fill, dtype=dtype, device=device.torch_device)
        self._slots = [
            self._new_slot(initial_max_writes, initial_max_values) for _ in range(ring_depth)
        ]
        self._next_slot = 0
        self._pending: list[tuple[int, int, np.ndarray]] = []
        self._pending_spans: dict[int, list[tuple[int, int]]] = {}
        self.num_ring_stalls = 0

    def _new_slot(self, max_writes: int, max_values: int) -> _Slot:
        dev = self.device
        return _Slot(
            host_meta=dev.host_empty((3 * max_writes + 1,), torch.int32),
            host_values=dev.host_empty((max_values,), self.dtype),
            dev_meta=torch.empty(3 * max_writes + 1, dtype=torch.int32, device=dev.torch_device),
            dev_values=torch.empty(max_values, dtype=self.dtype, device=dev.torch_device),
            copied=dev.new_event(),
            applied=dev.new_event(),
        )

    @property
    def num_pending(self) -> int:
        """Writes staged since the last flush."""
        return len(self._pending)

    def stage(self, row: int, start: int, values: Sequence[int | float] | np.ndarray) -> None:
        """Queue ``gpu[row, start : start + len(values)] = values`` for the next flush."""
        vals: np.ndarray = np.asarray(values, dtype=_NUMPY_DTYPES[self.dtype]).reshape(-1)
        end = start + vals.shape[0]
        if not (0 <= row < self.shape[0] and 0 <= start and end <= self.shape[1]):
            raise IndexError(f"staged write row={row} [{start}, {end}) outside {self.shape}")
        if vals.shape[0] == 0:
            return
        spans = self._pending_spans.setdefault(row, [])
        if any(start < e and s < end for s, e in spans):
            raise ValueError(f"overlapping staged writes to row {row} in one flush")
        spans.append((start, end))
        self._pending.append((row, start, vals))

    # stepscope: hot
    def flush(self) -> StagedFlush | None:
        """Pack pending writes into a ring slot and enqueue their copy on the h2d stream."""
        return self.copy(self.pack())

    # stepscope: hot
    def pack(self) -> StagedFlush | None:
        """Host only: pack pending writes into a ring slot (None: nothing staged). Its copy is
        enqueued by :meth:`copy`, which must follow before :meth:`apply`: the runner's h2d
        stage then holds the copies alone, not the packing (docs/design.md §4.3)."""
        if not self._pending:
            return None
        num_writes = len(self._pending)
        lengths = np.fromiter((v.shape[0] for _, _, v in self._pending), np.int32, num_writes)
        num_values = int(lengths.sum())
        index = self._next_slot
        self._next_slot = (index + 1) % len(self._slots)
        slot = self._acquire(index, num_writes, num_values)
        if num_writes == 1:
            row, start, values = self._pending[0]
            self._pack_values(slot, values)
            single: tuple[int, int] | None = (row, start)
        else:
            self._pack(slot, lengths)
            single = None
        self._pending = []
        self._pending_spans = {}
        slot.awaiting_apply = True
        return StagedFlush(index, num_writes, num_values, int(lengths.max()), single)

    # stepscope: hot
    def copy(self, flush: StagedFlush | None) -> StagedFlush | None:
        """Enqueue the h2d copy of a packed flush (:meth:`pack`); returns it for :meth:`apply`."""
        if flush is not None:
            slot = self._slots[flush.slot_index]
            self._enqueue_copy(slot, 0 if flush.single else flush.num_writes, flush.num_values)
        return flush

    def _acquire(self, index: int, num_writes: int, num_values: int) -> _Slot:
        slot = self._slots[index]
        if slot.awaiting_apply:
            raise RuntimeError("staged-write ring slot reused before its flush was applied")
        if not slot.copied.query():
            self.num_ring_stalls += 1
            slot.copied.synchronize()  # the copy still reads this host buffer: wait, never skip
        if num_writes > slot.max_writes or num_values > slot.max_values:
            slot = self._grow(index, num_writes, num_values)
        return slot

    def _grow(self, index: int, num_writes: int, num_values: int) -> _Slot:
        """Replace a too-small slot once nothing in flight reads it (rare, not per step)."""
        old = self._slots[index]
        old.applied.synchronize()
        max_writes = max(old.max_writes, 1 << (num_writes - 1).bit_length())
        max_values = max(old.max_values, 1 << (num_values - 1).bit_length())
        self._slots[index] = self._new_slot(max_writes, max_values)
        return self._slots[index]

    def _pack_values(self, slot: _Slot, values: np.ndarray) -> None:
        """One write's values into the slot's host buffer (a host tensor: no device read)."""
        slot.host_values.numpy()[: values.shape[0]] = values

    def _pack(self, slot: _Slot, lengths: np.ndarray) -> None:
        num_writes = lengths.shape[0]
        meta = slot.host_meta.numpy()
        meta[:num_writes] = [row for row, _, _ in self._pending]
        meta[num_writes : 2 * num_writes] = [start for _, start, _ in self._pending]
        offsets = meta[2 * num_writes : 3 * num_writes + 1]
        offsets[0] = 0
        np.cumsum(lengths, out=offsets[1:])
        slot.host_values.numpy()[: int(offsets[-1])] = np.concatenate(
            [v for _, _, v in self._pending]
        )

    def _enqueue_copy(self, slot: _Slot, num_writes: int, num_values: int) -> None:
        dev = self.device
        meta_len = 3 * num_writes + 1 if num_writes else 0  # 0: a single write, no metadata
        host_meta, host_values = slot.host_meta, slot.host_values
        dev_meta, dev_values = slot.dev_meta, slot.dev_values

        def copy() -> None:
            if meta_len:
                dev_meta[:meta_len].copy_(host_meta[:meta_len], non_blocking=True)
            dev_values[:num_values].copy_(host_values[:num_values], non_blocking=True)

        dev.wait_event(dev.h2d_stream, slot.applied)  # the kernel that read this slot is done
        dev.submit(dev.h2d_stream, copy)
        slot.copied.record(dev.h2d_stream)

    # stepscope: hot
    def apply(self, flush: StagedFlush | None) -> None:
        """Enqueue the apply kernel on the compute stream (after the flush's copy)."""
        if flush is None:
            return
        dev = self.device
        slot = self._slots[flush.slot_index]
        slot.awaiting_apply = False
        w = flush.num_writes
        meta = slot.dev_meta
        rows, starts, offsets = meta[:w], meta[w : 2 * w], meta[2 * w : 3 * w + 1]
        values, base, kernels = slot.dev_values, self.gpu, self.kernels
        single, n = flush.single, flush.num_values

        def kernel() -> None:
            if single is not None:
                row, start = single
                base[row, start : start + n].copy_(values[:n])
                return
            kernels.apply_staged_writes(base, rows, starts, offsets, values, n, flush.max_len)

        dev.wait_event(dev.compute_stream, slot.copied)
        dev.submit(dev.compute_stream, kernel)
        slot.applied.record(dev.compute_stream)
