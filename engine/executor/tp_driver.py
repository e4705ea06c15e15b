"""Rank 0 of tensor parallelism: spawns ranks 1..N-1, then mirrors every runner call to them.

``EngineCore`` (rank 0, in the caller's process) keeps the scheduler; its runner is wrapped by
:class:`StepBroadcaster`, which sends each call (``execute_model`` / ``execute_forward`` /
``execute_sample``, with the scheduler output and grammar bitmask) to the other ranks over the
gloo control group *before* running it locally, so every rank enqueues the same device work in
the same order. Every rank samples from the all-gathered logits with the same stateless noise,
so every rank's state table holds the same tokens and only rank 0's output is read.

Failure: a worker that raises exits; its peers' next collective fails (gloo: at once; NCCL: at the
group timeout), rank 0's next broadcast names the failed rank with its traceback
(:class:`TensorParallelError`), and :meth:`TPDriver.close` stops (at worst terminates) the rest.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from engine.config import EngineConfig
from engine.distributed.parallel_state import init_tp_group, measure_clock_offset
from engine.engine_parts import load_model_config
from engine.executor.messages import MessageKind, StepMessage
from engine.executor.rank_context import RankContext, check_model_splits, cuda_index_for_rank
from engine.executor.worker import WorkerSpec, worker_main
from engine.runner.async_output import AsyncOutput, PendingSample
from engine.scheduler.outputs import SchedulerOutput
from instrument.schema import ParallelSlice, rank_trace_path
from instrument.tracer import Tracer

__all__ = ["TPDriver", "TPOptions", "StepBroadcaster", "TensorParallelError"]

_log = logging.getLogger("stepscope.engine.tp")


class TensorParallelError(RuntimeError):
    """A rank failed (its traceback is in the message) or did not answer in time."""


@dataclass(frozen=True)
class TPOptions:
    """How rank 0 runs the other ranks.

    Args:
        timeout_s: limit of every collective and of start-up / shutdown joins.
        fail_at: ``(rank, step)``: that rank raises when the message of ``step`` arrives (a test
            hook for shutdown on error; None in normal runs).
    """

    timeout_s: float = 600.0
    fail_at: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.fail_at is not None and self.fail_at[0] < 1:
            raise ValueError("fail_at names a worker rank (>= 1)")


class TPDriver(RankContext):
    """Rank 0: owns the worker processes and the broadcast of each step. Use :meth:`start`."""

    def __init__(self, ctx: RankContext, processes: Any, store_dir: str, options: TPOptions):
        super().__init__(ctx.group, ctx.clock)
        self._processes = processes
        self._store_dir = store_dir
        self.options = options
        self._closed = False
        self.worker_error: str | None = None

    @classmethod
    def start(
        cls, config: EngineConfig, tracer: Tracer, options: TPOptions | None = None
    ) -> TPDriver:
        """Spawn ranks 1..N-1, join the group as rank 0, align clocks. Blocks until every rank
        has joined (each then builds its own shard while rank 0 builds its own)."""
        options = options or TPOptions()
        world_size = config.parallel.tensor_parallel_size
        check_model_splits(
            load_model_config(config.source.model or config.source.model_config or ""), world_size
        )
        store_dir = tempfile.mkdtemp(prefix="stepscope-tp-")
        init_method = f"file://{os.path.join(store_dir, 'store')}"
        trace = tracer.path if tracer.enabled else None
        spec = WorkerSpec(
            config=config,
            init_method=init_method,
            trace_path=trace,
            capture=tracer.capture if trace else None,
            timeout_s=options.timeout_s,
            fail_at=options.fail_at,
        )
        processes = mp.start_processes(
            worker_main, args=(spec,), nprocs=world_size - 1, join=False, daemon=True,
            start_method="spawn",
        )  # fmt: skip
        try:
            group = init_tp_group(
                0, world_size, init_method, cuda_index_for_rank(config, 0), options.timeout_s
            )
            ctx = RankContext(group, measure_clock_offset(group))
        except Exception as exc:
            _stop_processes(processes, 5.0)
            shutil.rmtree(store_dir, ignore_errors=True)
            raise TensorParallelError(f"tensor-parallel start-up failed: {exc}") from exc
        driver = cls(ctx, processes, store_dir, options)
        driver.record_metadata(tracer)
        if trace:
            _log.info("tensor parallel: rank traces %s", rank_trace_path(trace, 1) + ", ...")
        return driver

    def attach(self, runner: Any, tracer: Tracer) -> Any:
        return StepBroadcaster(super().attach(runner, tracer), self, tracer)

    def send(self, message: StepMessage) -> None:
        """Broadcast ``message`` to every rank; a dead rank raises :class:`TensorParallelError`."""
        self.check_workers()
        try:
            self.group.broadcast_object(message)
        except Exception as exc:
            self.check_workers(wait_s=2.0)  # a dying worker: give it time to report why
            raise TensorParallelError(f"broadcast of step {message.step} failed: {exc}") from exc

    def check_workers(self, wait_s: float = 0.0) -> None:
        """Raise :class:`TensorParallelError` if a worker has exited (``wait_s`` 0: one poll)."""
        try:
            self._processes.join(timeout=wait_s)
        except ProcessException as exc:
            self.worker_error = str(exc)
            raise TensorParallelError(f"rank {exc.error_index + 1} failed:\n{exc}") from None

    def close(self) -> None:
        """Tell the workers to stop, wait for them (terminate after ``timeout_s``), leave the
        group. Raises :class:`TensorParallelError` when a worker failed during the run."""
        if self._closed:
            return
        self._closed = True
        try:
            self.check_workers()
            self.group.broadcast_object(StepMessage(MessageKind.STOP, -1))
        except Exception as exc:  # noqa: BLE001 -- a worker is gone; stop the rest below
            _log.warning("tensor parallel: stop message not delivered: %s", exc)
        error = _stop_processes(self._processes, self.options.timeout_s)
        super().close()
        shutil.rmtree(self._store_dir, ignore_errors=True)
        error = error or self.worker_error
        if error:
            raise TensorParallelError(f"a tensor-parallel rank failed:\n{error}")


def _stop_processes(processes: Any, timeout_s: float) -> str | None:
    """Join every process until ``timeout_s``, then terminate the rest; the first failure's
    message (None when all exited cleanly)."""
    deadline = time.monotonic() + timeout_s
    error = None
    while True:
        try:
            if processes.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                break
        except ProcessException as exc:  # join() has terminated the others already
            return str(exc)
        if time.monotonic() >= deadline:
            error = f"workers did not stop within {timeout_s:.0f} s; terminated"
            break
    for process in processes.processes:
        if process.is_alive():
            process.terminate()
            process.join(5.0)
    return error


class StepBroadcaster:
    """Rank 0's runner: sends each call to the other ranks, then runs it on the local runner.

    Every other attribute is the local runner's (``graphs``, ``model``, ...)."""

    def __init__(self, runner: Any, driver: TPDriver, tracer: Tracer) -> None:
        self.runner = runner
        self.driver = driver
        self.tracer = tracer

    def _send(self, message: StepMessage) -> None:
        with self.tracer.span(ParallelSlice.BROADCAST_STEP.value, step=message.step):
            self.driver.send(message)

    # stepscope: hot
    def execute_model(self, out: SchedulerOutput, bitmask: Any = None) -> AsyncOutput:
        self._send(StepMessage(MessageKind.MODEL, out.step, out, bitmask))
        return self.runner.execute_model(out, bitmask)  # type: ignore[no-any-return]

    # stepscope: hot
    def execute_forward(self, out: SchedulerOutput) -> PendingSample:
        self._send(StepMessage(MessageKind.FORWARD, out.step, out))
        return self.runner.execute_forward(out)  # type: ignore[no-any-return]

    # stepscope: hot
    def execute_sample(self, pending: PendingSample, bitmask: Any) -> AsyncOutput:
        self._send(StepMessage(MessageKind.SAMPLE, pending.step, None, bitmask))
        return self.runner.execute_sample(pending, bitmask)  # type: ignore[no-any-return]

    def close(self) -> None:
        self.runner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)
