"""CUDA graphs for uniform decode batches, padded up to a captured batch size.

Decode steps are many small kernels whose launch cost the CPU pays every step; a graph replays
them with one launch. Batches whose requests all run one token are padded (padding tokens have
slot -1, padded requests own no query token) up to the next capture size and replayed against
the runner's persistent input buffers. Everything else runs eagerly.

Whether graphs are used is decided once, by :func:`engine.config.resolve_features` (the one
owner of feature decisions, docs/design.md §2.1); the runner is handed the resolved bool. A capture
that fails leaves the runner eager with :attr:`CudaGraphRunner.failure` set, which the engine
reports back (``ResolvedFeatures.fall_back``): auto falls back, explicit True is a start-up error.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import torch

from engine.device import Device

__all__ = ["CudaGraphRunner", "capture_sizes"]


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, then multiples of 8 up to ``max_batch`` (always included)."""
    if max_batch <= 0:
        raise ValueError(f"max_batch must be > 0, got {max_batch}")
    sizes = {s for s in (1, 2, 4) if s <= max_batch} | set(range(8, max_batch + 1, 8))
    sizes.add(max_batch)
    return sorted(sizes)


class CudaGraphRunner:
    """Captured graphs by padded batch size, with the output tensor each one writes."""

    def __init__(self, enabled: bool, max_batch: int) -> None:
        self.sizes = capture_sizes(max_batch) if enabled else []
        self.failure: str | None = None  # why capture failed (then the runner runs eagerly)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0

    @property
    def enabled(self) -> bool:
        return bool(self.sizes)

    def padded_size(self, num_reqs: int, is_uniform_decode: bool) -> int | None:
        """The capture size a uniform decode batch pads to; None to run eagerly."""
        if not self.enabled or not is_uniform_decode or num_reqs == 0:
            return None
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def has(self, size: int) -> bool:
        return size in self._graphs

    def capture(
        self,
        device: Device,
        body: Callable[[int], torch.Tensor],
        prepare: Callable[[int], None],
    ) -> None:
        """Capture ``body(size)`` for every size, largest first, sharing one memory pool.

        ``prepare(size)`` fills the persistent inputs with a harmless batch first (slot -1:
        warm-up and capture write no KV)."""
        pool = torch.cuda.graph_pool_handle()
        stream = device.compute_stream
        with torch.no_grad():
            self._capture_all(stream, pool, body, prepare)
        stream.synchronize()

    def disable(self, reason: str) -> None:
        """Run eagerly after a failed capture; keeps the reason for the engine to report."""
        self.failure = reason
        self.sizes = []
        self._graphs = {}

    def _capture_all(
        self,
        stream: torch.cuda.Stream,
        pool: Any,
        body: Callable[[int], torch.Tensor],
        prepare: Callable[[int], None],
    ) -> None:
        for size in reversed(self.sizes):
            with torch.cuda.stream(stream):
                prepare(size)
                for _ in range(2):  # warm-up: lazy inits and autotuning happen outside capture
                    body(size)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = body(size)
            self._graphs[size] = (graph, out)

    # stepscope: hot
    def replay(self, size: int) -> torch.Tensor:
        """Replay on the current stream; returns the graph's output ``[size, hidden]``."""
        graph, out = self._graphs[size]
        graph.replay()
        self.num_replays += 1
        return out
