"""The grammar bitmask on the device: one buffer, filled by an h2d copy per step (docs/design.md §2.9)."""

from __future__ import annotations

from typing import Any

import torch

from engine.device import Device
from engine.kernels.bitmask import num_bitmask_words
from instrument.device_timeline import DeviceTimeline
from instrument.schema import DEVICE_COPY, CopySlice

__all__ = ["DeviceBitmask"]


class DeviceBitmask:
    """Owns the device copy of structured steps' bitmasks ``[rows, ceil(V / 32)]`` int32.

    One buffer suffices: a step's mask is uploaded only once the host has waited on the output of
    the step before it, whose sampling (the buffer's last reader) has then finished. The buffer is
    allocated on the first structured step, so free-only engines never pay for it.
    """

    def __init__(
        self, device: Device, timeline: DeviceTimeline, max_rows: int, vocab_size: int
    ) -> None:
        self.device = device
        self.timeline = timeline
        self.max_rows = max_rows
        self.num_words = num_bitmask_words(vocab_size)
        self._gpu: torch.Tensor | None = None
        # The last upload's device timeline stage (None when not traced): the compute stream
        # waits for it, so the stage that applies the mask names it as its ``after``.
        self.stage: Any = None
        self._site = timeline.site(
            CopySlice.H2D_INPUTS.value, lane=DEVICE_COPY, stream=device.h2d_stream
        )

    # stepscope: hot
    def upload(self, step: int, bitmask: torch.Tensor) -> torch.Tensor:
        """Enqueue the h2d copy of ``bitmask`` ([N, words] int32, host) and make the compute
        stream wait for it; returns the device rows ``[N, words]`` (the copy's timeline stage:
        :attr:`stage`)."""
        dev, n = self.device, bitmask.shape[0]
        if self._gpu is None or self._gpu.shape[0] < n:
            # empty (no kernel): every use overwrites its rows first
            rows = max(n, self.max_rows)
            self._gpu = torch.empty(
                rows, self.num_words, dtype=torch.int32, device=dev.torch_device
            )
        dst = self._gpu[:n]

        def copy() -> None:
            dst.copy_(bitmask, non_blocking=True)

        with self._site.stage(step) as stage:
            dev.submit(dev.h2d_stream, copy)
        self.stage = stage
        ready = self.timeline.event_after_stage(dev.h2d_stream, dev.new_event, wait_only=True)
        dev.wait_event(dev.compute_stream, ready)
        return dst
