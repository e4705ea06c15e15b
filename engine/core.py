"""EngineCore: the step loop, synchronous (``step``) or with a batch queue (``step_with_batch_queue``).

Synchronous: schedule N -> launch N -> wait N -> update N. With the batch queue (depth 2, as
vLLM's ``step_with_batch_queue``): schedule and launch N+1 before waiting on N, so the CPU's
scheduling and input preparation of N+1 run while the device computes N.

Structured output (docs/design.md §2.9, deferred sampling): a grammar's mask for step N+1 exists only once
output N is committed and the grammar has accepted t_N. With the batch queue, a step holding a
structured request behind a step still in flight is split: its forward (and logits) is enqueued at
once, its sampling after ``update_from_output(N)`` and the ``grammar_mask`` of N+1; the wait on
output N is then ``wait_output(kind=grammar)``. Free-only steps keep the single enqueue. Without
deferred sampling (async off, or turned off) a structured step is launched with its mask built
first (async: only after the step before it is updated).

Every CPU phase is a slice of docs/design.md §4.2 on the ``engine-core`` thread; the runner adds
``prepare_inputs``/``launch`` and the device slices; counters are sampled after each update.

A step the trace drops by capture rules 1-3 (warm-up, ``--trace-steps``, ``--trace-every``) is not
traced at all: whether it is kept is decided once, as it is about to be scheduled
(``Tracer.trace_step``), kept with it in the batch queue, and each of its phases (schedule and
launch; wait and update; a deferred sampling) runs with the tracer paused, so it costs the
engine thread what an untraced step costs (docs/design.md §4.9, "Sampled traces on the engine
thread").
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from engine.config import EngineConfig, ResolvedFeatures, resolve_features
from engine.device import Device
from engine.engine_parts import (
    build_device,
    build_kernels,
    build_model,
    build_runner,
    check_state_fits,
    record_start,
    resolve_batch_limits,
    resolve_max_model_len,
)
from engine.executor.rank_context import RankContext
from engine.kernels.compile_counter import CompileCounter
from engine.kv_sizing import KvCapacity
from engine.memory_profile import size_kv_cache
from engine.request import Request, RequestStatus
from engine.request_timeline import RequestTimeline
from engine.runner.async_output import AsyncOutput, PendingSample
from engine.runner.model_runner import ModelRunner
from engine.scheduler.async_scheduler import AsyncScheduler
from engine.scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from engine.scheduler.request_output import (
    FINISH_REASON_ERROR,
    RequestOutput,
    StopStringChecker,
)
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.step_outputs import StepOutputs
from engine.structured.manager import StructuredOutputManager
from engine.warmup import WarmupReport, warm_up
from instrument.kernel_window import KernelWindow
from instrument.schema import ENGINE_THREAD, Arg, Counter, CpuSlice, WaitKind
from instrument.sync_detect import cold_region, hot_region
from instrument.tracer import Tracer, get_tracer

# Trace names as plain strings, looked up once: an Enum member's ``.value`` runs Python frames
# (enum's DynamicClassAttribute), a dozen times per step on the hot path (docs/design.md §4.3).
_ARG_NUM_ACCEPTED = Arg.NUM_ACCEPTED.value
_ARG_NUM_DECODE = Arg.NUM_DECODE.value
_ARG_NUM_FINISHED = Arg.NUM_FINISHED.value
_ARG_NUM_PREFILL = Arg.NUM_PREFILL.value
_ARG_NUM_REJECTED = Arg.NUM_REJECTED.value
_ARG_NUM_REQS = Arg.NUM_REQS.value
_ARG_NUM_SPEC_TOKENS = Arg.NUM_SPEC_TOKENS.value
_ARG_NUM_TOKENS = Arg.NUM_TOKENS.value
_CPU_GRAMMAR_MASK = CpuSlice.GRAMMAR_MASK.value
_CPU_READ_OUTPUT = CpuSlice.READ_OUTPUT.value
_CPU_SCHEDULE = CpuSlice.SCHEDULE.value
_CPU_UPDATE_FROM_OUTPUT = CpuSlice.UPDATE_FROM_OUTPUT.value
_CPU_WAIT_OUTPUT = CpuSlice.WAIT_OUTPUT.value
# The wait and read spans' args by wait kind: constant dicts the tracer may share (span_end).
_KIND_ARGS: dict[WaitKind, dict[str, object]] = {k: {Arg.KIND.value: k.value} for k in WaitKind}

__all__ = ["EngineCore", "BATCH_QUEUE_DEPTH"]

BATCH_QUEUE_DEPTH = 2
_COUNTER_NAMES = tuple(c.value for c in Counter)
_log = logging.getLogger("stepscope.engine")


class EngineCore:
    """Owns the scheduler, the runner and the device; runs one step per call.

    Args:
        config: what the user asked for; features are resolved once here.
        tracer: where slices go (default: the process-global tracer).
        stop_string_checker: finds stop strings in a request's text (needs a tokenizer).
        trace_requests: write one track per request (queued/prefill/decode).
        tokenizer: the model's tokenizer; structured requests need it (grammars are compiled
            against its vocabulary).
        tp: this rank's tensor-parallel context (``engine.executor``); None with
            ``tensor_parallel_size > 1`` starts the other ranks here (this is rank 0).
    """

    def __init__(
        self,
        config: EngineConfig,
        tracer: Tracer | None = None,
        stop_string_checker: StopStringChecker | None = None,
        trace_requests: bool = False,
        tokenizer: Any = None,
        tp: RankContext | None = None,
    ) -> None:
        # The batch limit by device when not given (so every part, the trace included, sees it).
        config, self.max_num_seqs_source = resolve_batch_limits(config)
        self.config = config
        self._tokenizer = tokenizer
        self.tracer = tracer if tracer is not None else get_tracer()
        # The thread that drives the engine is the trace's ``engine-core`` CPU track.
        threading.current_thread().name = ENGINE_THREAD
        self.features: ResolvedFeatures = resolve_features(config)
        self.kernels = build_kernels(
            self.features, config.source.batch_invariant
        )  # chosen once, for every part below
        # Triton specializations compiled: at start-up (graphs, warm-up) and, after, in the run.
        self.compiles = CompileCounter()
        if self.features.triton_kernels:
            self.compiles.install()
        # Tensor parallel: every rank builds its device and model shard through its context.
        if tp is None and config.parallel.tensor_parallel_size > 1:
            from engine.executor.tp_driver import TPDriver

            tp = TPDriver.start(config, self.tracer)
        self.tp = tp
        if tp is None:
            self.device: Device = build_device(config)
            self.model, self.model_config = build_model(config, self.device, self.kernels)
        else:
            self.device = tp.build_device(config)
            self.model, self.model_config = tp.build_model(config, self.device, self.kernels)
        # The KV pool: --num-kv-blocks, the CPU default, or sized from device memory.
        self.kv: KvCapacity = size_kv_cache(
            config, self.features, self.device, self.model, self.model_config, self.kernels,
            None if tp is None else tp.group,
        )  # fmt: skip
        self.max_model_len = resolve_max_model_len(config, self.model_config, self.kv)
        # The parts below get the config with what start-up resolved (max_model_len, the KV
        # pool); ``self.config`` stays as asked (the trace's engine_config records both).
        resolved = config.resolved(self.max_model_len, self.kv.num_blocks)
        check_state_fits(
            config, self.model_config, self.max_model_len, self.device, self.kv.num_blocks
        )
        scheduler_cls = AsyncScheduler if self.features.async_scheduling else Scheduler
        self.scheduler: Scheduler = scheduler_cls(
            resolved.scheduler,
            resolved.cache,
            stop_string_checker,
            num_spec_tokens=resolved.spec.num_spec_tokens,
        )
        # The older way: the CPU waits for step N's accepted counts before preparing N+1.
        self.sync_accepted = (
            self.features.spec_method is not None and config.spec.spec_sync_accepted
        )
        self.runner: ModelRunner = build_runner(
            resolved, self.features, self.device, self.model, self.tracer, self.kernels
        )
        # Before the first request: compile every kernel specialization (engine/warmup.py).
        try:
            self.warmup: WarmupReport = warm_up(self.runner, resolved, self.features, self.tracer)
        except BaseException:
            # Stop the device's worker threads before the error leaves: a CPU stream thread
            # still inside a torch op when the interpreter exits aborts the process (SIGABRT)
            # instead of printing the error.
            self.compiles.uninstall()
            self.device.close()
            raise
        self.compiles_at_start = self.compiles.count
        if tp is not None:  # rank 0: each runner call is first sent to the other ranks
            self.runner = tp.attach(self.runner, self.tracer)
        self.kernel_window = self._build_kernel_window()
        self.requests = RequestTimeline(self.tracer, write_tracks=trace_requests)
        self.structured = StructuredOutputManager(
            tokenizer, self.model_config.vocab_size, self.eos_token_ids
        )
        # A PendingSample is a structured step whose sampling waits for the step before it; the
        # bool: the step is traced (capture rules 1-3, decided once as it was scheduled).
        self._queue: deque[tuple[SchedulerOutput, AsyncOutput | PendingSample, bool]] = deque()
        # Steps the trace drops are skipped here, on the engine thread. Not with tensor
        # parallelism (the other ranks trace every step, and CPU collectives are recorded on the
        # device thread whatever step the engine is in) nor a kernel window (it attributes its
        # kernels to its steps' stages): their traces are gated by the writer as before.
        self._skip_dropped_steps = (
            self.tracer.can_skip_steps and tp is None and self.kernel_window is None
        )
        record_start(
            self.tracer, config, self.features, self.max_model_len, self.kv,
            (self.warmup.seconds, self.warmup.num_steps), self.compiles_at_start,
            self.runner.graphs.describe(), self.max_num_seqs_source,
        )  # fmt: skip
        _log.info("%s", self.kv.describe(self.max_model_len))

    def _build_kernel_window(self) -> KernelWindow | None:
        """The ``--trace-kernels`` window (only with a CUDA device and an enabled tracer)."""
        steps = self.config.tracing.trace_kernel_steps
        if steps is None or not self.features.trace_kernels or not self.tracer.enabled:
            return None
        device, timeline = self.device, self.runner.timeline
        compute = device.compute_stream

        def marker(cycles: int = 2000) -> None:  # a spin kernel on the compute stream (~1 us)
            device.submit(compute, lambda: torch.cuda._sleep(cycles))

        def synchronize() -> None:
            device.synchronize()
            timeline.poll()

        window = KernelWindow(
            self.tracer,
            device.index,
            steps[0],
            steps[1],
            timeline.new_event,
            compute,
            marker,
            synchronize,
        )
        timeline.observer = window.observe_stage
        return window

    # ---- requests -------------------------------------------------------------------------
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The model config's EOS ids; a random-weights shape run with a separate ``tokenizer``
        uses that tokenizer's EOS (the shape's own EOS belongs to a tokenizer it does not have)."""
        tok_eos = getattr(self._tokenizer, "eos_token_id", None)
        if (
            self.config.source.random_weights
            and self.config.source.tokenizer
            and tok_eos is not None
        ):
            return (int(tok_eos),)
        return tuple(self.model_config.eos_token_ids)

    def add_request(self, request: Request, structured: Any = None) -> RequestOutput | None:
        """Queue a request; ``structured`` is a workload's ``{"json_schema"|"regex"|"choice": ...}``.

        A grammar that cannot be compiled (or no xgrammar / tokenizer) fails only this request:
        its final output (``finish_reason="error"``, ``error`` set) is returned at once.
        """
        if structured is not None:
            error = self.structured.add(request.req_id, structured)
            if error is not None:
                _log.warning("request %s: %s", request.req_id, error)
                self.requests.arrived(request.req_id)
                self.requests.finished(request.req_id)
                return RequestOutput(request.req_id, [], True, FINISH_REASON_ERROR, error=error)
        try:
            self.scheduler.add_request(request)
        except ValueError:
            self.structured.remove(request.req_id)
            raise
        self.requests.arrived(request.req_id)
        return None

    def abort_request(self, req_id: str) -> RequestOutput | None:
        self.structured.remove(req_id)
        out = self.scheduler.abort_request(req_id)
        if out is not None:
            self.requests.finished(req_id)
        return out

    def has_work(self) -> bool:
        return bool(self._queue) or self.scheduler.has_unfinished_requests()

    # ---- the two loops --------------------------------------------------------------------
    def step(self) -> Sequence[RequestOutput]:
        """Synchronous: schedule, launch, wait, update one step."""
        if self._queue:
            raise RuntimeError("step() with steps still queued: use step_with_batch_queue()")
        if not self._enqueue_next():
            return []
        return self._retire_oldest()

    def step_with_batch_queue(self) -> Sequence[RequestOutput]:
        """Async: launch step N+1 before waiting on step N (queue depth 2)."""
        if self.sync_accepted or (self.structured.active and not self.features.deferred_sampling):
            return self._step_serial()
        scheduled = False
        if len(self._queue) < BATCH_QUEUE_DEPTH and self.scheduler.has_unfinished_requests():
            scheduled = self._enqueue_next()
        if not self._queue or (scheduled and len(self._queue) < BATCH_QUEUE_DEPTH):
            return []
        return self._retire_oldest()

    def _enqueue_next(self) -> bool:
        """Schedule the next step and launch it into the queue (False: it had nothing to run).

        Whether the step is traced is decided here, once (capture rules 1-3); a dropped step's
        phase runs with the tracer paused."""
        traced = True
        if self._skip_dropped_steps:
            traced = self.tracer.trace_step(self.scheduler.next_step)
            # Past a full trace's warm-up the rules drop no later step: stop asking.
            self._skip_dropped_steps = self.tracer.can_skip_steps
        if not traced:
            self.tracer.pause()
        try:
            so = self._schedule()
            if so is None:
                return False
            self._queue.append((so, self._launch(so), traced))
            return True
        finally:
            if not traced:
                self.tracer.resume()

    def _step_serial(self) -> Sequence[RequestOutput]:
        """Wait for step N and update it before scheduling N+1. ``--spec-sync-accepted``: the CPU
        waits for accepted counts (the device idles meanwhile: the exposed wait to measure); also
        structured output with deferred sampling off (N+1's mask needs t_N)."""
        outputs: Sequence[RequestOutput] = []
        if self._queue:
            outputs = self._retire_oldest()
        if self.scheduler.has_unfinished_requests():
            self._enqueue_next()
        return outputs

    def _launch(self, so: SchedulerOutput) -> AsyncOutput | PendingSample:
        """Enqueue a step whole, or -- a structured step behind one still in flight -- only its
        forward; its sampling follows in :meth:`_sample_deferred`."""
        if self._queue and self.structured.needs_mask(so):
            return self.runner.execute_forward(so)
        return self.runner.execute_model(so, self._grammar_bitmask(so))

    def _retire_oldest(self) -> Sequence[RequestOutput]:
        """Wait for and update the oldest step, then sample the next one if it was deferred."""
        so, handle, traced = self._queue.popleft()
        if not isinstance(handle, AsyncOutput):
            raise RuntimeError(f"step {so.step} was never sampled")
        if not traced:
            self.tracer.pause()
        try:
            outputs = self._update(so, self._wait(so, handle))
        finally:
            if not traced:
                self.tracer.resume()
        self._sample_deferred()
        return outputs

    def _sample_deferred(self) -> None:
        """Output N is committed and the grammar has accepted t_N: build the bitmask of N+1 and
        enqueue its sampling (its forward is already on the device)."""
        if not self._queue:
            return
        so, pending, traced = self._queue[0]
        if not isinstance(pending, PendingSample):
            return
        if not traced:
            self.tracer.pause()
        try:
            handle = self.runner.execute_sample(pending, self._grammar_bitmask(so))
        finally:
            if not traced:
                self.tracer.resume()
        self._queue[0] = (so, handle, traced)

    def _grammar_bitmask(self, so: SchedulerOutput) -> torch.Tensor | None:
        """The step's grammar mask (host), or None when no structured request runs in it."""
        if not self.structured.needs_mask(so):
            return None
        with self.tracer.span(_CPU_GRAMMAR_MASK, step=so.step):
            bitmask = self.structured.build_bitmask(so, self.device.host_empty)
        return bitmask

    def run_step(self) -> Sequence[RequestOutput]:
        """One iteration of whichever loop the resolved features chose.

        The whole iteration is a hot region for the sync detector, except the one intended wait
        for a step's output (``_wait``): any other host<-device sync in it is a defect.
        """
        with hot_region():
            if self.features.async_scheduling:
                return self.step_with_batch_queue()
            return self.step()

    # ---- phases ---------------------------------------------------------------------------
    def _schedule(self) -> SchedulerOutput | None:
        if self.kernel_window is not None:
            self.kernel_window.before_schedule(self.scheduler.next_step)
        tracer = self.tracer
        start, so, args = tracer.span_begin(_CPU_SCHEDULE), None, None
        try:
            so = self.scheduler.schedule()
            if tracer.enabled:  # the span's args, built only when traced
                drafts = so.scheduled_spec_decode_tokens
                args = {
                    _ARG_NUM_REQS: so.num_reqs,
                    _ARG_NUM_TOKENS: so.total_num_scheduled_tokens,
                    _ARG_NUM_PREFILL: so.num_prefill_reqs,
                    _ARG_NUM_DECODE: so.num_decode_reqs,
                    _ARG_NUM_SPEC_TOKENS: sum(map(len, drafts.values())) if drafts else 0,
                }
        finally:
            tracer.span_end(_CPU_SCHEDULE, start, None if so is None else so.step, args)
        if so.total_num_scheduled_tokens == 0:
            return None
        # Only a request the runner sees anew can be scheduled for the first time: the running
        # ones were all first scheduled as new requests.
        self.requests.scheduled([new.req_id for new in so.scheduled_new_reqs])
        return so

    def _wait(self, so: SchedulerOutput, handle: AsyncOutput) -> ModelRunnerOutput:
        if self.sync_accepted:
            kind = WaitKind.ACCEPTED_COUNT
        elif self._queue and isinstance(self._queue[0][1], PendingSample):
            kind = WaitKind.GRAMMAR  # this output gates the sampling of the next step
        else:
            kind = WaitKind.SAMPLED
        # The device timeline's batched poll, on time the host is about to wait anyway.
        self.runner.timeline.poll_while_waiting(handle.is_ready)
        tracer, args = self.tracer, _KIND_ARGS[kind]
        start = tracer.span_begin(_CPU_WAIT_OUTPUT)
        try:
            with cold_region():  # the intended wait: for the device's output event only
                handle.wait()
        finally:
            tracer.span_end(_CPU_WAIT_OUTPUT, start, so.step, args)
        # Host work on output that is already in host memory (docs/design.md §5.5).
        start = tracer.span_begin(_CPU_READ_OUTPUT)
        try:
            out = handle.get()
        finally:
            tracer.span_end(_CPU_READ_OUTPUT, start, so.step, args)
        if self.structured.active:
            self.structured.note_drafts(handle.draft_token_ids())
        return out

    def _update(self, so: SchedulerOutput, out: ModelRunnerOutput) -> Sequence[RequestOutput]:
        tracer = self.tracer
        start, args = tracer.span_begin(_CPU_UPDATE_FROM_OUTPUT), None
        try:
            outputs = self._advance_grammars(self.scheduler.update_from_output(so, out))
            self.requests.committed(outputs)
            if tracer.enabled:  # the span's args: a pass over the outputs only when traced
                num_accepted = num_drafts = num_finished = 0
                # A StepOutputs' columns hold running one-token outputs: no drafts, no finish.
                for o in outputs.explicit if isinstance(outputs, StepOutputs) else outputs:
                    num_accepted += o.num_accepted
                    num_drafts += o.num_draft_tokens
                    num_finished += o.finished
                args = {
                    _ARG_NUM_ACCEPTED: num_accepted,
                    _ARG_NUM_REJECTED: num_drafts - num_accepted,
                    _ARG_NUM_FINISHED: num_finished,
                }
        finally:
            tracer.span_end(_CPU_UPDATE_FROM_OUTPUT, start, so.step, args)
        self._sample_counters()
        if self.kernel_window is not None:
            self.kernel_window.after_update(so.step)
        return outputs

    def _advance_grammars(self, outputs: Sequence[RequestOutput]) -> Sequence[RequestOutput]:
        """Structured requests' grammars accept the committed tokens; finished ones are dropped.
        A token the grammar refuses (a masking bug) fails that request with the reason."""
        if not self.structured.active:
            return outputs
        result = []
        for o in outputs:
            if not self.structured.accept(o.req_id, o.new_token_ids):
                self.scheduler.finish_request(o.req_id, RequestStatus.FINISHED_ABORTED)
                error = f"grammar refused committed tokens {o.new_token_ids}"
                _log.error("request %s: %s", o.req_id, error)
                o = dataclasses.replace(
                    o, finished=True, finish_reason=FINISH_REASON_ERROR, error=error
                )
            if o.finished:
                self.structured.remove(o.req_id)
            result.append(o)
        return result

    def _sample_counters(self) -> None:
        if not self.tracer.enabled:
            return
        # One buffered tuple of the stats' values (the writer expands it): no dict per step.
        self.tracer.counter_values(_COUNTER_NAMES, self.scheduler.counter_values())

    # ---- start and end --------------------------------------------------------------------
    def drain(self) -> list[RequestOutput]:
        """Wait for and apply every queued step (end of a run)."""
        outputs: list[RequestOutput] = []
        while self._queue:
            outputs.extend(self._retire_oldest())
        return outputs

    def check_idle(self) -> None:
        """After a run: nothing queued, no placeholders, no block referenced, no request live.

        Raises ``AssertionError`` naming what is left (blocks in the prefix cache are free).
        """
        stats = self.scheduler.get_stats()
        problems = []
        if self._queue:
            problems.append(f"{len(self._queue)} steps still queued")
        if stats.output_placeholders:
            problems.append(f"{stats.output_placeholders} output placeholders left")
        if stats.running_requests or stats.waiting_requests:
            problems.append(
                f"{stats.running_requests} running / {stats.waiting_requests} waiting requests"
            )
        if stats.kv_usage:
            problems.append(f"KV blocks still referenced (usage {stats.kv_usage:.3f})")
        if problems:
            raise AssertionError("engine not idle: " + "; ".join(problems))

    @property
    def compiles_in_run(self) -> list[str]:
        """Triton kernels specialised after start-up (JIT work inside the run: warm-up missed
        them); empty when Triton kernels are off or under its interpreter."""
        return self.compiles.names[self.compiles_at_start :]

    def close(self) -> None:
        self.compiles.uninstall()
        try:
            self.drain()
            if self.kernel_window is not None:
                self.kernel_window.close()
            self.runner.close()
            self.device.close()
        finally:
            if self.tp is not None:  # stop the other ranks even when draining failed
                self.tp.close()
