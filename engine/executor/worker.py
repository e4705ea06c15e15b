"""Ranks 1..N-1 of tensor parallelism: one spawned process each, running rank 0's steps.

A worker joins the group, aligns its clock with rank 0, opens its own trace
(``<trace>.rank<i>.pftrace``: ``rank``/``world_size``/clock offset in the metadata, device tracks
``gpu:<rank> ...``), and builds this rank's device, model shard and runner through the same
factories as rank 0's ``EngineCore`` (:func:`engine.engine_parts.build_runner`, with the kernel
backend chosen once from the resolved features); it has no scheduler. Then :class:`WorkerLoop`
receives each :class:`~engine.executor.messages.StepMessage` and makes the same runner call.
"""

from __future__ import annotations

import os
import signal
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig, resolve_features
from engine.distributed.parallel_state import TPGroup, init_tp_group, measure_clock_offset
from engine.executor.messages import MessageKind, StepMessage
from engine.executor.rank_context import RankContext, cuda_index_for_rank
from engine.runner.async_output import AsyncOutput, PendingSample
from instrument.capture import CaptureConfig
from instrument.schema import ENGINE_THREAD, ParallelSlice, rank_trace_path
from instrument.tracer import Tracer, set_tracer

__all__ = ["WorkerSpec", "WorkerLoop", "worker_main"]

# Outputs a worker keeps in flight before waiting on the oldest (rank 0's batch queue depth).
_MAX_IN_FLIGHT = 2


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a spawned rank needs (pickled to the child).

    ``trace_path``: rank 0's trace file (each worker writes ``rank_trace_path(it, rank)``), or
    None for no trace; ``fail_at``: ``(rank, step)`` test hook, see ``TPOptions``.
    """

    config: EngineConfig
    init_method: str
    trace_path: str | None
    capture: CaptureConfig | None
    timeout_s: float
    fail_at: tuple[int, int] | None = None


class WorkerLoop:
    """Mirrors rank 0's runner calls on this rank's runner until the stop message."""

    def __init__(self, runner: Any, group: TPGroup, tracer: Tracer, fail_step: int | None) -> None:
        self.runner = runner
        self.group = group
        self.tracer = tracer
        self.fail_step = fail_step
        self._in_flight: deque[AsyncOutput] = deque()
        self._pending: dict[int, PendingSample] = {}

    def run(self) -> None:
        """Receive and execute steps; returns after ``STOP`` with every output retired."""
        while True:
            message = self._receive()
            if message.kind is MessageKind.STOP:
                break
            if message.step == self.fail_step:
                raise RuntimeError(
                    f"injected failure on rank {self.group.rank} at step {message.step}"
                )
            handle = self._execute(message)
            if handle is not None:
                self._in_flight.append(handle)
            self._retire(_MAX_IN_FLIGHT)
        self._retire(0)

    def _receive(self) -> StepMessage:
        with self.tracer.span(ParallelSlice.BROADCAST_STEP.value) as span:
            message: StepMessage = self.group.broadcast_object()
            span.set_args(step=message.step)
        return message

    def _execute(self, message: StepMessage) -> AsyncOutput | None:
        so, kind = message.scheduler_output, message.kind
        if kind is MessageKind.MODEL:
            assert so is not None
            return self.runner.execute_model(so, message.bitmask)  # type: ignore[no-any-return]
        if kind is MessageKind.FORWARD:
            assert so is not None
            self._pending[message.step] = self.runner.execute_forward(so)
            return None
        if kind is MessageKind.SAMPLE:
            pending = self._pending.pop(message.step)
            return self.runner.execute_sample(pending, message.bitmask)  # type: ignore[no-any-return]
        raise ValueError(f"unexpected message {kind}")

    def _retire(self, keep: int) -> None:
        """Wait on outputs (surfacing device errors) until at most ``keep`` are in flight;
        finished ones are retired whatever ``keep`` is."""
        while self._in_flight and (len(self._in_flight) > keep or self._in_flight[0].is_ready()):
            self._in_flight.popleft().get()


def _leave_interrupts_to_rank0() -> None:
    """Ctrl-C reaches every process of the terminal's group: a rank > 0 leaves it to rank 0, which
    stops in order and then closes the ranks (engine/interrupt.py). SIGINT still ends this rank
    when rank 0 is gone (torch's spawn turns the parent's death into a SIGINT)."""
    parent = os.getppid()

    def on_sigint(signum: int, frame: object) -> None:
        if os.getppid() != parent:
            raise KeyboardInterrupt

    if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
        signal.signal(signal.SIGINT, on_sigint)


def worker_main(index: int, spec: WorkerSpec) -> None:
    """Entry point of rank ``index + 1`` (``torch.multiprocessing`` passes ``index``)."""
    _leave_interrupts_to_rank0()
    rank = index + 1
    config = spec.config
    tracer = (
        Tracer(rank_trace_path(spec.trace_path, rank), capture=spec.capture)
        if spec.trace_path
        else Tracer(enabled=False)
    )
    set_tracer(tracer)
    try:
        group = init_tp_group(
            rank,
            config.parallel.tensor_parallel_size,
            spec.init_method,
            cuda_index_for_rank(config, rank),
            spec.timeout_s,
        )
        ctx = RankContext(group, measure_clock_offset(group))
        ctx.record_metadata(tracer)
        fail_step = spec.fail_at[1] if spec.fail_at and spec.fail_at[0] == rank else None
        _run_rank(config, ctx, tracer, fail_step)
    finally:
        tracer.close()


def _run_rank(
    config: EngineConfig, ctx: RankContext, tracer: Tracer, fail_step: int | None
) -> None:
    """Build this rank's parts as ``EngineCore`` builds rank 0's, then mirror its steps."""
    # The child imports the engine's factories here, once it has joined the group (rank 0
    # builds its own parts meanwhile), not when it unpickles ``worker_main``.
    from engine.engine_parts import (
        build_kernels,
        build_runner,
        check_state_fits,
        record_start,
        resolve_max_model_len,
    )
    from engine.memory_profile import size_kv_cache
    from engine.scheduler.scheduler import check_limits
    from engine.warmup import warm_up

    threading.current_thread().name = ENGINE_THREAD  # this rank's CPU slices: its engine track
    features = resolve_features(config)
    kernels = build_kernels(features, config.source.batch_invariant)
    try:
        device = ctx.build_device(config)
        try:
            model, model_config = ctx.build_model(config, device, kernels)
            # The same sizing as rank 0 (a collective: every rank gets the minimum pool).
            kv = size_kv_cache(config, features, device, model, model_config, kernels, ctx.group)
            max_model_len = resolve_max_model_len(config, model_config, kv)
            resolved = config.resolved(max_model_len, kv.num_blocks)
            check_limits(resolved.scheduler, resolved.cache, resolved.spec.num_spec_tokens)
            check_state_fits(config, model_config, max_model_len, device, kv.num_blocks)
            runner = build_runner(resolved, features, device, model, tracer, kernels)
            try:
                warmup = warm_up(runner, resolved, features, tracer)
                runner = ctx.attach(runner, tracer)
                record_start(
                    tracer, config, features, max_model_len, kv,
                    (warmup.seconds, warmup.num_steps), 0, runner.graphs.describe(),
                )  # fmt: skip
                WorkerLoop(runner, ctx.group, tracer, fail_step).run()
            finally:
                runner.close()
        finally:
            device.close()
    finally:
        ctx.close()
