"""CUDA graphs over padded batch shapes: uniform decode batches and mixed/prefill token buckets.

A step's eager forward is a few hundred small kernels whose launch cost the CPU pays every step;
a graph replays them with one launch. Two kinds of padded shape are captured
(docs/design.md §2.6):

* **uniform decode** (every request runs one token): requests and tokens padded up to the next
  :func:`capture_sizes` size; attention runs the decode kernel (``max_query_len`` 1);
* **mixed** (anything else: prefill, chunked prefill, decodes next to a prefill chunk): tokens
  padded up to the next :func:`mixed_buckets` bucket ``T`` and requests up to
  ``min(T, max_num_reqs)``; attention runs the varlen kernel, whose grid depends only on those
  two counts (each program finds its request on the device and exits when it owns no query).

Padding tokens have slot -1 (they write no KV), position 0 and belong to no request; padded
requests own no query token and have ``seq_len`` 0. Steps with more tokens than the largest
bucket run eagerly (counted in :attr:`CudaGraphRunner.num_mixed_eager`).

Whether graphs are used is decided once, by :func:`engine.config.resolve_features` (the one
owner of feature decisions, docs/design.md §2.1); the runner is handed the resolved sizes. A
decode capture that fails leaves the runner eager with :attr:`CudaGraphRunner.failure` set; a
mixed capture that fails leaves decode graphs on and sets :attr:`CudaGraphRunner.mixed_failure`.
The engine reports either back (``ResolvedFeatures.fall_back``).

On a device that is not CUDA (tests), "capture" only records the body and :meth:`replay` calls
it: the padded, persistent-buffer path runs eagerly, the same function a graph would capture.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.device import Device

__all__ = ["CAPTURE_ERROR_MODE", "CudaGraphRunner", "GraphShape", "capture_sizes", "mixed_buckets"]

# Captures prohibit unsafe CUDA calls in the capturing thread only. The default ("global") also
# prohibits them in every other thread of the process, so a tracer's poller querying events, or a
# second engine's threads, invalidated captures on the H200 ("operation failed due to a previous
# error during capture"; docs/design.md §9).
CAPTURE_ERROR_MODE = "thread_local"

# Mixed buckets: powers of two from MIN_BUCKET up to BUCKET_STEP, then multiples of BUCKET_STEP.
# Small steps are launch-bound (padding them costs little device time); past BUCKET_STEP tokens a
# step pads by at most BUCKET_STEP - 1 tokens (< 2x only at the boundary, < 1.5x from 512 up).
MIN_BUCKET = 16
BUCKET_STEP = 256


# Decode capture sizes: multiples of 8 up to WIDE_FROM, then of 16 (vLLM's list): a batch pads by
# at most 15 rows past 256 (< 6 %), and a device-sized max_num_seqs of 1024 captures 83 graphs,
# not 131.
WIDE_FROM = 256


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, multiples of 8 up to 256, then multiples of 16 up to ``max_batch`` (always
    included)."""
    if max_batch <= 0:
        raise ValueError(f"max_batch must be > 0, got {max_batch}")
    sizes = {s for s in (1, 2, 4) if s <= max_batch}
    sizes |= set(range(8, min(max_batch, WIDE_FROM) + 1, 8))
    sizes |= set(range(WIDE_FROM + 16, max_batch + 1, 16))
    sizes.add(max_batch)
    return sorted(sizes)


def mixed_buckets(max_tokens: int) -> list[int]:
    """Token buckets of mixed-step graphs: 16, 32, 64, 128, 256, then multiples of 256, up to
    ``max_tokens`` (always included); ``[]`` for 0 (mixed steps run eagerly)."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if max_tokens == 0:
        return []
    buckets = {max_tokens}
    size = MIN_BUCKET
    while size < min(max_tokens, BUCKET_STEP):
        buckets.add(size)
        size *= 2
    buckets |= set(range(BUCKET_STEP, max_tokens, BUCKET_STEP))
    return sorted(buckets)


@dataclass(frozen=True)
class GraphShape:
    """One padded batch shape: the key of a captured graph."""

    num_tokens: int  # padded tokens (the forward's T)
    num_reqs: int  # padded requests (rows of query_start_loc - 1, seq_lens, the block table)
    uniform_decode: bool  # True: max_query_len 1 (decode attention); False: varlen attention

    @property
    def max_query_len(self) -> int:
        """The host bound the captured attention is built with (any real batch fits it)."""
        return 1 if self.uniform_decode else self.num_tokens


class CudaGraphRunner:
    """Captured graphs by padded shape, with the output tensor each one writes.

    Args:
        enabled: decode graphs (the resolved ``cuda_graphs`` feature).
        max_batch: the largest decode batch (``max_num_reqs``).
        mixed_max_tokens: the largest mixed bucket; 0 = mixed steps run eagerly.
        replay_eagerly: record bodies instead of capturing, and run them at replay (no CUDA).
        stamps: graph stamps (``instrument.graph_stamps``): every captured body (and on the CPU
            every recorded one) begins and ends with a stamp; the runner takes one pair per
            replay (``ForwardPass.take_stamps``). None: no stamps.
    """

    def __init__(
        self,
        enabled: bool,
        max_batch: int,
        mixed_max_tokens: int = 0,
        replay_eagerly: bool = False,
        stamps: Any = None,
    ) -> None:
        if mixed_max_tokens and not enabled:
            raise ValueError("mixed-step graphs need decode graphs (cuda_graphs) on")
        self.max_batch = max_batch
        self.sizes = capture_sizes(max_batch) if enabled else []
        self.buckets = mixed_buckets(mixed_max_tokens) if enabled else []
        self.replay_eagerly = replay_eagerly
        self.stamps = stamps
        self.stamps_failure: str | None = None  # why the stamps were dropped at capture
        self.failure: str | None = None  # why decode capture failed (then all runs eagerly)
        self.mixed_failure: str | None = None  # why mixed capture failed (decode graphs stay)
        self._graphs: dict[GraphShape, tuple[torch.cuda.CUDAGraph | None, torch.Tensor]] = {}
        self._has_memo: dict[tuple[int, int, bool], bool] = {}  # has_key; cleared with _graphs
        self._bodies: dict[GraphShape, Callable[[GraphShape], torch.Tensor]] = {}
        self.num_replays = 0  # all replays, decode and mixed
        self.num_mixed_replays = 0
        self.num_mixed_eager = 0  # mixed steps larger than the largest bucket

    @property
    def enabled(self) -> bool:
        return bool(self.sizes)

    @property
    def mixed_enabled(self) -> bool:
        return bool(self.buckets)

    def shapes(self) -> list[GraphShape]:
        """Every shape to capture: mixed buckets, then decode sizes (each largest first, so
        smaller graphs reuse the pool memory of larger ones)."""
        mixed = [self.mixed_shape(t) for t in reversed(self.buckets)]
        return mixed + [GraphShape(s, s, True) for s in reversed(self.sizes)]

    def mixed_shape(self, bucket: int) -> GraphShape:
        """Bucket ``T`` pads requests to ``min(T, max_batch)``: every step of <= T tokens fits."""
        return GraphShape(bucket, min(bucket, self.max_batch), False)

    # stepscope: hot
    def shape_for(self, num_reqs: int, num_tokens: int, uniform_decode: bool) -> GraphShape | None:
        """The captured shape a step pads to; None to run it eagerly (counted when the step is
        mixed and larger than the largest bucket)."""
        if not self.enabled or num_reqs == 0:
            return None
        if uniform_decode:
            i = bisect.bisect_left(self.sizes, num_reqs)
            return GraphShape(self.sizes[i], self.sizes[i], True) if i < len(self.sizes) else None
        if not self.buckets:
            return None
        i = bisect.bisect_left(self.buckets, num_tokens)
        if i == len(self.buckets):
            self.num_mixed_eager += 1
            return None
        shape = self.mixed_shape(self.buckets[i])
        return shape if num_reqs <= shape.num_reqs else None

    def has(self, shape: GraphShape) -> bool:
        return shape in self._graphs

    def has_key(self, num_tokens: int, num_reqs: int, uniform_decode: bool) -> bool:
        """:meth:`has` of that shape, memoised on a plain tuple (no frozen-dataclass build and
        Python ``__hash__`` per call: the traced step's ``graph_replay`` arg asks every step)."""
        key = (num_tokens, num_reqs, uniform_decode)
        hit = self._has_memo.get(key)
        if hit is None:
            hit = self._has_memo[key] = GraphShape(*key) in self._graphs
        return hit

    def describe(self) -> dict[str, str]:
        """The captured shapes for the trace's ``engine_config`` (comma-separated, "" = none)."""
        decode = sorted(s.num_tokens for s in self._graphs if s.uniform_decode)
        mixed = sorted(s.num_tokens for s in self._graphs if not s.uniform_decode)
        return {
            "cuda_graph_sizes": ",".join(map(str, decode)),
            "mixed_graph_buckets": ",".join(map(str, mixed)),
        }

    def capture(
        self,
        device: Device,
        body: Callable[[GraphShape], torch.Tensor],
        prepare: Callable[[GraphShape], None],
    ) -> None:
        """Capture ``body(shape)`` for every shape, sharing one memory pool.

        ``prepare(shape)`` fills the persistent inputs with a harmless batch first (slot -1:
        warm-up and capture write no KV). A failure while capturing a mixed bucket disables
        mixed graphs only (:attr:`mixed_failure`); any other failure propagates."""
        if self.replay_eagerly:
            stamped = body if self.stamps is None else self.stamps.wrap(body)
            self._bodies = {shape: stamped for shape in self.shapes()}
            self._graphs = {shape: (None, torch.empty(0)) for shape in self.shapes()}
            self._has_memo.clear()
            return
        pool = torch.cuda.graph_pool_handle()
        stream = device.compute_stream
        if self.stamps is not None:
            self._probe_stamps(stream)
        with torch.no_grad():
            try:
                self._capture_all(stream, pool, body, prepare, mixed=True)
            except Exception as exc:  # noqa: BLE001 -- any capture failure decides the feature
                stream.synchronize()
                self.disable_mixed(f"capture failed: {_first_line(exc)}")
            self._capture_all(stream, pool, body, prepare, mixed=False)
        stream.synchronize()
        if self.stamps is not None:  # capture ran the stamps: the counts start at 0 from here
            self.stamps.reset_device_counter()

    def _probe_stamps(self, stream: torch.cuda.Stream) -> None:
        """Capture the stamps alone first: if they cannot be captured, the graphs go without
        them (``stamps_failure`` says why) rather than a stamp failure costing the graphs."""
        stamps = self.stamps
        try:
            probe = torch.cuda.CUDAGraph()
            with torch.cuda.graph(probe, stream=stream, capture_error_mode=CAPTURE_ERROR_MODE):
                stamps.begin()
                stamps.end()
            del probe
        except Exception as exc:  # noqa: BLE001 -- the graphs must not depend on the stamps
            stream.synchronize()
            self.stamps_failure = f"capture failed: {_first_line(exc)}"
            self.stamps = None

    def disable(self, reason: str) -> None:
        """Run eagerly after a failed capture; keeps the reason for the engine to report."""
        self.failure = reason
        self.sizes = []
        self.buckets = []
        self._graphs = {}
        self._bodies = {}
        self._has_memo.clear()

    def disable_mixed(self, reason: str) -> None:
        """Run mixed steps eagerly after a failed mixed capture (decode graphs stay)."""
        self.mixed_failure = reason
        self.buckets = []
        self._graphs = {s: g for s, g in self._graphs.items() if s.uniform_decode}
        self._has_memo.clear()
        self._bodies = {s: b for s, b in self._bodies.items() if s.uniform_decode}

    def _capture_all(
        self,
        stream: torch.cuda.Stream,
        pool: Any,
        body: Callable[[GraphShape], torch.Tensor],
        prepare: Callable[[GraphShape], None],
        mixed: bool,
    ) -> None:
        for shape in self.shapes():
            if shape.uniform_decode == mixed:
                continue
            with torch.cuda.stream(stream):
                prepare(shape)
                for _ in range(2):  # warm-up: lazy inits and autotuning happen outside capture
                    body(shape)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            captured = body if self.stamps is None else self.stamps.wrap(body)
            with torch.cuda.graph(
                graph, pool=pool, stream=stream, capture_error_mode=CAPTURE_ERROR_MODE
            ):
                out = captured(shape)
            self._graphs[shape] = (graph, out)
            self._has_memo.clear()

    # stepscope: hot
    def replay(self, shape: GraphShape) -> torch.Tensor:
        """Replay on the current stream; returns the graph's output ``[num_tokens, hidden]``
        (with ``replay_eagerly``: runs the recorded body now)."""
        graph, out = self._graphs[shape]
        self.num_replays += 1
        if not shape.uniform_decode:
            self.num_mixed_replays += 1
        if graph is None:
            return self._bodies[shape](shape)
        graph.replay()
        return out


def _first_line(exc: BaseException) -> str:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"
