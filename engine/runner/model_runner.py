"""The MRV2-style model runner: enqueue a whole step on the device, return a handle at once.

``execute_model(scheduler_output)`` does host work only under ``prepare_inputs`` (state-table
diffs, the packed batch) and then, under ``launch``, enqueues in stream order:

    h2d stream      h2d_inputs   staged diffs + packed batch, host -> device
    compute stream  input_prep   apply diffs; gather ids/positions/slots/seq_lens/logits rows
                    forward      the model (a CUDA graph replay for padded decode batches)
                    sample       logits of the sampled rows, sampler, commit to the state table
    d2h stream      d2h_output   sampled tokens (and logprobs) -> host buffers, then an event

The sampled token is committed to ``last_sampled`` on the device, where step N+1's input prep
reads it; the host only learns it from the d2h copy, in :meth:`AsyncOutput.get`.

With a proposer (speculative decoding) the compute stream runs ``verify`` instead of ``sample``
when the step has drafts, then ``draft``: see :mod:`engine.spec.decoder`.

Structured output (docs/design.md §2.9): a grammar bitmask ``[num_logits, ceil(V / 32)]`` int32 is
uploaded on the h2d stream and applied to the logits before ``sample``/``verify``. When the mask is
known at launch, ``execute_model(out, bitmask)`` enqueues the step at once as above. Under async
scheduling it is not (it needs output N), so the step is split: ``execute_forward`` enqueues input
prep, forward and logits at once, and ``execute_sample`` enqueues upload, sample (verify, draft)
and the output copy later. With a proposer, a masked step also copies its drafts back (after
``draft``), since the grammar must walk them to mask the next step's draft positions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.device import Device
from engine.kernels.backend import KernelBackend, TorchKernels
from engine.runner.async_output import (
    AsyncOutput,
    HostOutputBuffers,
    PendingSample,
    SampledBufferPool,
)
from engine.runner.cuda_graphs import CudaGraphRunner
from engine.runner.forward_pass import ForwardPass, max_num_tokens
from engine.runner.input_batch import InputBatch, build_input_batch, packed_capacity
from engine.runner.spec_graphs import SpecGraphs, SpecShape
from engine.runner.staged_write import StagedWriteTensor
from engine.runner.states import RequestStates
from engine.runner.step_in_flight import StepInFlight
from engine.sample.sampler import Sampler, SamplerOutput, filter_thresholds
from engine.sample.sampling_inputs import gather_sampling_metadata
from engine.sampling_params import MAX_LOGPROBS
from engine.scheduler.outputs import SchedulerOutput
from engine.spec.decoder import SpecDecoder
from engine.spec.proposer import Proposer
from engine.structured.device_bitmask import DeviceBitmask
from instrument.device_timeline import DeviceTimeline
from instrument.events import FLOW_IN, FLOW_OUT
from instrument.graph_stamps import GraphStamps, HostStamps
from instrument.schema import DEVICE_COPY, FLOW_ID_BASE, Arg, CopySlice, CpuSlice, DeviceSlice
from instrument.tracer import Tracer, get_tracer

# Trace names as plain strings, looked up once: an Enum member's ``.value`` runs Python frames
# (enum's DynamicClassAttribute), a dozen times per step on the hot path (docs/design.md §4.3).
_CPU_LAUNCH = CpuSlice.LAUNCH.value
_CPU_PREPARE_INPUTS = CpuSlice.PREPARE_INPUTS.value
_DEV_DRAFT = DeviceSlice.DRAFT.value
_DEV_FORWARD = DeviceSlice.FORWARD.value
_DEV_INPUT_PREP = DeviceSlice.INPUT_PREP.value
_DEV_SAMPLE = DeviceSlice.SAMPLE.value
_DEV_VERIFY = DeviceSlice.VERIFY.value

__all__ = ["ModelRunner"]

_log = logging.getLogger(__name__)

_ARG_GRAPH = Arg.GRAPH_REPLAY.value
_ARG_STAMPED = Arg.GRAPH_STAMPED.value


def _flow_out(step: int) -> dict[str, object]:
    """The launch span's args: the flow from step ``step``'s launch to its forward."""
    return {FLOW_OUT: FLOW_ID_BASE + step}


class _StageSites:
    """The device timeline's stage sites of the runner's stage calls (one per call: name, lane,
    stream and constant args decided once, docs/design.md §4.3). Made in stream order (h2d,
    compute, d2h): the timeline's polls go through its streams in the order it first saw them."""

    def __init__(self, timeline: DeviceTimeline, device: Device) -> None:
        site = timeline.site
        compute = device.compute_stream
        self.h2d_inputs = site(
            CopySlice.H2D_INPUTS.value, lane=DEVICE_COPY, stream=device.h2d_stream
        )
        self.input_prep = site(_DEV_INPUT_PREP, stream=compute)
        self.forward = site(_DEV_FORWARD, stream=compute)  # its args vary: given per stage
        self.sample = site(_DEV_SAMPLE, stream=compute)
        self.verify = site(_DEV_VERIFY, stream=compute)
        self.draft = site(_DEV_DRAFT, stream=compute)
        # The speculative graphs' stages: one replay each on CUDA (eager on the CPU).
        self.verify_graph = site(_DEV_VERIFY, stream=compute, graph_replay=device.is_cuda)
        self.draft_graph = site(_DEV_DRAFT, stream=compute, graph_replay=device.is_cuda)
        self.d2h_output = site(
            CopySlice.D2H_OUTPUT.value, lane=DEVICE_COPY, stream=device.d2h_stream
        )


class ModelRunner:
    """Owns the device state of one model: KV caches, state table, step buffers, graphs."""

    def __init__(
        self,
        model: Any,
        device: Device,
        limits: SchedulerConfig,
        cache: CacheConfig,
        tracer: Tracer | None = None,
        proposer: Proposer | None = None,
        kernels: KernelBackend | None = None,
        *,
        seed: int = 0,
        cuda_graphs: bool = False,
        mixed_graph_max_tokens: int = 0,
        spec_cuda_graphs: bool = False,
        trace_begins: str = "recorded",
        graph_stamps: bool = True,
        trace_core: str | None = None,
    ) -> None:
        """``limits`` / ``cache``: the engine config's scheduler part (``max_model_len``
        resolved) and KV cache part, as they are; ``seed``: the engine seed (unseeded requests'
        sampling); ``cuda_graphs``: the resolved decision (``ResolvedFeatures``, decided once);
        ``mixed_graph_max_tokens``: under the resolved ``mixed_cuda_graphs``, the largest token
        bucket of mixed-step graphs (0: mixed steps run eagerly; needs ``cuda_graphs``);
        ``spec_cuda_graphs``: the resolved ``spec_cuda_graphs`` (speculative steps replay
        forward / verify / draft graphs, :mod:`engine.runner.spec_graphs`; needs both);
        ``trace_begins``: the device timeline's ``begins`` (``--trace-begins``: how device
        slices get their begins, docs/design.md §4.3); ``graph_stamps``
        (``--trace-graph-stamps``): when tracing, the forward graphs write their own begin and
        end times (``instrument.graph_stamps``; ``graph_stamps_off`` says why not);
        ``trace_core`` (``--trace-core``): the device timeline's ``core`` (the compiled stage
        core or the Python classes, ``instrument.native``)."""
        if not 0 <= mixed_graph_max_tokens <= max_num_tokens(limits):
            raise ValueError(
                f"mixed_graph_max_tokens must be in [0, {max_num_tokens(limits)}], "
                f"got {mixed_graph_max_tokens}"
            )
        if mixed_graph_max_tokens and not cuda_graphs:
            raise ValueError("mixed_graph_max_tokens > 0 needs cuda_graphs=True")
        if mixed_graph_max_tokens and proposer is not None:
            raise ValueError("mixed-step CUDA graphs do not cover speculative decoding")
        if spec_cuda_graphs and (proposer is None or not cuda_graphs):
            raise ValueError("spec_cuda_graphs needs a proposer and cuda_graphs=True")
        kernels = kernels or TorchKernels()  # the engine passes the one backend it chose
        self.model = model
        self.device = device
        self.limits = limits
        self.cache = cache
        max_num_reqs = limits.resolved_max_num_seqs
        max_model_len = limits.resolved_max_model_len
        self.tracer = tracer if tracer is not None else get_tracer()
        # ``background``: the batched poll at the engine's wait runs on the timeline's poller
        # thread, off the engine thread (docs/design.md §4.3). Each stage that is not contiguous
        # names the stage its stream last waited for (``after``): derived begins need it.
        self.timeline = DeviceTimeline(
            self.tracer,
            device.index,
            device.timed_event_factory(),
            background=True,
            begins=trace_begins,
            core=trace_core,
        )
        self._sites = _StageSites(self.timeline, device)
        self.vocab_size = int(model.config.vocab_size)
        self.states = RequestStates(
            device,
            max_num_reqs=max_num_reqs,
            max_model_len=max_model_len,
            max_blocks_per_req=cache.blocks_for(max_model_len),
            vocab_size=self.vocab_size,
            seed=seed,
            kernels=kernels,
            device_owns_frontier=proposer is not None,
        )
        cap = packed_capacity(max_num_reqs, max_num_tokens(limits))
        self.step_inputs = StagedWriteTensor(
            device, (1, cap), torch.int32, initial_max_values=cap, kernels=kernels
        )
        self.sampler = Sampler(kernels)
        self.spec = None if proposer is None else SpecDecoder(proposer, self.states, self.sampler)
        num_rows = max_num_reqs * (1 + (0 if self.spec is None else self.spec.num_spec_tokens))
        self.bitmask = DeviceBitmask(device, self.timeline, num_rows, self.vocab_size)
        # With a proposer each buffer also holds the step's accepted counts (one pinned buffer
        # per step, reused: no per-step host allocation).
        self.sampled_buffers = SampledBufferPool(
            device.host_empty,
            num_rows,
            0 if self.spec is None else max_num_reqs,
            logprob_cols=1 + MAX_LOGPROBS,
        )
        self.graph_stamps_off: str | None = None  # why the forwards carry no stamps
        stamps = self._make_stamps(device, graph_stamps and cuda_graphs)
        graphs = CudaGraphRunner(
            cuda_graphs,
            max_batch=max_num_reqs,
            mixed_max_tokens=mixed_graph_max_tokens,
            replay_eagerly=not device.is_cuda,  # the CPU runs the padded path as a function
            stamps=stamps,
        )
        self.fwd = ForwardPass(
            model, device, limits, cache, self.states, self.step_inputs, graphs, kernels
        )
        if graphs.stamps is not None and graphs.enabled:
            self.timeline.use_stamps(graphs.stamps)
        elif graphs.stamps_failure is not None:
            self._stamps_failed(graphs.stamps_failure)
        # Not after a failed decode capture (the engine turns both features off then).
        spec_graphs = spec_cuda_graphs and self.fwd.graphs.failure is None
        self.spec_graphs = SpecGraphs(spec_graphs, self.fwd, self.spec, self.states, device)
        # The output copy stage of the last speculative graph step (None: untraced), after which
        # ``spec_graphs.copied`` is recorded: the next step's ``verify`` waits for it.
        self._copied_stage: Any = None

    @property
    def graphs(self) -> CudaGraphRunner:
        return self.fwd.graphs

    def free_requests(self, req_ids: set[str]) -> None:
        """Free the state rows of requests that will not run again, outside any step (the
        engine's warm-up ends with this; the scheduler's finished ids travel with a step)."""
        self.states.remove(req_ids)

    def kv_bytes_per_block(self) -> int:
        """Device bytes one KV block costs: the target's caches plus a proposer's own, which
        mirror the target's blocks (its per-row lookahead blocks are a fixed extra)."""
        caches = list(self.fwd.kv_caches)
        if self.spec is not None:
            caches += self.spec.proposer.kv_caches()
        # each cache: [2, num_blocks, block_size, heads, head_dim]
        return sum(c.nbytes // c.shape[1] for c in caches)

    # stepscope: hot
    def execute_model(
        self, out: SchedulerOutput, bitmask: torch.Tensor | None = None
    ) -> AsyncOutput:
        """Enqueue step ``out.step`` and return at once; ``.get()`` on the result waits for it.

        ``bitmask`` (``[num_logits, ceil(V / 32)]`` int32, host): the grammar mask, applied to the
        logits on the device before sampling (structured requests whose mask is already known).
        """
        batch, spec_shape = self._prepare_step(out, graphable=bitmask is None)
        if batch is None:
            return AsyncOutput.empty(out.step)
        start = self.tracer.span_begin(_CPU_LAUNCH)
        try:
            if spec_shape is not None:
                return self._launch_spec_graphs(batch, spec_shape)
            step = self._launch_forward(batch, with_logits=bitmask is not None)
            return self._launch_sample(batch, step, bitmask, contiguous=True)
        finally:
            self.tracer.span_end(_CPU_LAUNCH, start, out.step, _flow_out(out.step))

    # stepscope: hot
    def execute_forward(self, out: SchedulerOutput) -> PendingSample:
        """Deferred sampling: enqueue input prep, forward and logits of step ``out.step`` only.

        :meth:`execute_sample` enqueues the rest once the host has built the grammar bitmask.
        """
        batch, _ = self._prepare_step(out, graphable=False)
        if batch is None:
            return PendingSample(out.step, None)
        start = self.tracer.span_begin(_CPU_LAUNCH)
        try:
            step = self._launch_forward(batch, with_logits=True)
        finally:
            self.tracer.span_end(_CPU_LAUNCH, start, out.step, _flow_out(out.step))
        return PendingSample(out.step, batch, step)

    # stepscope: hot
    def execute_sample(self, pending: PendingSample, bitmask: torch.Tensor | None) -> AsyncOutput:
        """Enqueue a deferred step's bitmask upload, sample (or verify + draft) and output copy.

        ``bitmask`` None: its structured requests finished meanwhile; sample unmasked."""
        if pending.batch is None:
            return AsyncOutput.empty(pending.step)
        start = self.tracer.span_begin(_CPU_LAUNCH)
        try:
            return self._launch_sample(pending.batch, pending.in_flight, bitmask)
        finally:
            self.tracer.span_end(_CPU_LAUNCH, start, pending.step)

    # stepscope: hot
    def _prepare_step(
        self, out: SchedulerOutput, graphable: bool
    ) -> tuple[InputBatch | None, SpecShape | None]:
        """Host side of a step: state-table diffs and the packed batch (None: nothing to run),
        and the speculative graph shape it replays (None: not a captured speculative step;
        ``graphable`` False: a grammar mask or deferred sampling, never replayed)."""
        self.timeline.poll_if_due()
        start = self.tracer.span_begin(_CPU_PREPARE_INPUTS)
        try:
            if out.scheduled_spec_decode_tokens and self.spec is None:
                raise ValueError("the scheduler sent drafts but this runner has no proposer")
            self.states.remove(out.finished_req_ids)
            for new in out.scheduled_new_reqs:
                self.states.add(new)
            self.states.update_cached(out.scheduled_cached_reqs)
            num_tokens = out.num_scheduled_tokens
            # Every scheduled request runs >= 1 token: one each iff the total is the count.
            uniform = out.total_num_scheduled_tokens == len(num_tokens)
            spec_shape = self.spec_graphs.shape_for(out, graphable) if self.spec else None
            shape = self.fwd.graphs.shape_for(
                len(num_tokens), out.total_num_scheduled_tokens, uniform
            )
            if spec_shape is not None:
                batch, packed = build_input_batch(
                    out, self.states, spec_shape.num_reqs, spec_shape.num_tokens
                )
            elif shape is None:
                batch, packed = build_input_batch(out, self.states)
            else:
                batch, packed = build_input_batch(
                    out, self.states, shape.num_reqs, shape.num_tokens
                )
            if batch.num_reqs == 0:
                return None, None
            self.step_inputs.stage(0, 0, packed)
        finally:
            self.tracer.span_end(_CPU_PREPARE_INPUTS, start, out.step)
        return batch, spec_shape

    def _make_stamps(self, device: Device, wanted: bool) -> Any:
        """Graph stamps for a traced run with forward graphs (``instrument.graph_stamps``);
        None, with ``graph_stamps_off`` set, where they are off or failed their start-up check
        (the forward stages then end at recorded events, as without them)."""
        tracer = self.tracer
        if not wanted:
            self.graph_stamps_off = "off (--trace-graph-stamps off, or no forward graphs)"
            return None
        if not (tracer.enabled or tracer.paused):
            self.graph_stamps_off = "off (not tracing)"
            return None
        if not device.is_cuda:
            return HostStamps()
        try:
            stamps = GraphStamps(device.torch_device)
            stamps.calibrate(self.timeline.ops, device.compute_stream)  # its own ring: no reset
        except Exception as exc:  # noqa: BLE001 -- the trace falls back to events, and says why
            self._stamps_failed(f"{type(exc).__name__}: {str(exc)[:200]}")
            return None
        return stamps

    def _stamps_failed(self, why: str) -> None:
        """Graph stamps failed (start-up check or capture): logged, and said in the trace."""
        self.graph_stamps_off = f"failed: {why}"
        _log.warning("graph stamps off, the forward stages record events: %s", why)
        self.tracer.metadata(**{Arg.GRAPH_STAMPS.value: f"off: {self.graph_stamps_off}"})

    # stepscope: hot
    def _launch_forward(
        self,
        batch: InputBatch,
        with_logits: bool,
        run_forward: Callable[[], torch.Tensor] | None = None,
    ) -> StepInFlight:
        """h2d inputs, input prep and forward (plus the sampled rows' logits when asked);
        ``run_forward``: what computes the hidden states (default ``ForwardPass.forward``)."""
        dev, tl, step = self.device, self.timeline, batch.step
        compute, h2d = dev.compute_stream, dev.h2d_stream
        sites = self._sites
        # Taken for every replay of a stamped graph, traced or not (the device counts them all);
        # the stages end at them when the forward stage is that replay alone.
        stamps = self.fwd.take_stamps(batch) if run_forward is None else None
        if stamps is not None and with_logits:
            stamps = None
        # Packed on the host first: the h2d stage holds the copies alone, so that a derived
        # begin (its host time) is not early by the packing (docs/design.md §4.3).
        flushes = self.states.pack()
        step_flush = self.step_inputs.pack()
        with sites.h2d_inputs.stage(step) as copied_in:
            self.states.copy(flushes)
            self.step_inputs.copy(step_flush)
        inputs_ready = tl.event_after_stage(h2d, dev.new_event, wait_only=True)
        dev.wait_event(compute, inputs_ready)
        in_flight = StepInFlight()

        def forward() -> None:
            in_flight.hidden = self.fwd.forward(batch) if run_forward is None else run_forward()

        def logits() -> None:
            in_flight.logits = self.fwd.logits(batch, in_flight.require("hidden"))

        with sites.input_prep.stage(
            step, after=copied_in, end=None if stamps is None else stamps[0]
        ):
            self.states.apply(flushes)
            self.step_inputs.apply(step_flush)
            dev.submit(compute, lambda: self.fwd.prepare(batch))
        # One CUDA-graph replay, submitted at once (the analysis starts its work at host_end_ns,
        # docs/design.md §5.14.2); eager logits after it make the stage eager.
        if run_forward is None:  # a stamped replay is a graph replay: no second lookup
            graph = stamps is not None or (
                not with_logits and tl.enabled and self.fwd.replays_graph(batch)
            )
        else:
            graph = not with_logits and dev.is_cuda  # the speculative forward graph
        args: dict[str, object] = {FLOW_IN: FLOW_ID_BASE + step, _ARG_GRAPH: graph}
        if stamps is not None:
            args[_ARG_STAMPED] = True
        with sites.forward.stage(
            step, contiguous=True, args=args, end=None if stamps is None else stamps[1]
        ):
            dev.submit(compute, forward)
            if with_logits:
                dev.submit(compute, logits)
        return in_flight

    # stepscope: hot
    def _launch_sample(
        self,
        batch: InputBatch,
        in_flight: StepInFlight,
        bitmask: torch.Tensor | None,
        contiguous: bool = False,
    ) -> AsyncOutput:
        """(bitmask upload), sample or verify, draft, and the d2h output copy. ``contiguous``:
        enqueued right after the step's forward (the sample stage begins at its end event)."""
        dev, tl, step = self.device, self.timeline, batch.step
        compute, d2h = dev.compute_stream, dev.d2h_stream
        mask = upload = None
        if bitmask is not None:
            mask, upload = self.bitmask.upload(step, bitmask), self.bitmask.stage
        if self.spec is None:

            def sample() -> None:
                in_flight.sampled = self._sample(batch, in_flight, mask)

            with self._sites.sample.stage(step, after=upload, contiguous=contiguous) as sampled:
                dev.submit(compute, sample)
        else:
            sampled = self._enqueue_verify(batch, in_flight, mask, upload)
        # A grammar needs the drafts of the next step on the host: copy them with the output.
        copy_drafts = self.spec is not None and mask is not None
        if copy_drafts:
            sampled = self._enqueue_draft(batch, in_flight)
        # Waited on at once (``wait_only``: the timeline may record the event again later).
        sampled_ready = tl.event_after_stage(compute, dev.new_event, wait_only=True)
        dev.wait_event(d2h, sampled_ready)
        if self.spec is not None and not copy_drafts:  # the output copy overlaps the draft chain
            self._enqueue_draft(batch, in_flight)
        host = self._host_buffers(batch, copy_drafts)
        with self._sites.d2h_output.stage(step, after=sampled):
            dev.submit(d2h, lambda: self._copy_out(in_flight, host))
        ready = tl.event_after_stage(d2h, dev.new_event)
        return AsyncOutput(
            batch, step, host, ready, release=tl.give_back, pool=self.sampled_buffers
        )

    # stepscope: hot
    def _launch_spec_graphs(self, batch: InputBatch, shape: SpecShape) -> AsyncOutput:
        """A speculative step from graphs (docs/design.md §2.6): h2d inputs and input prep
        as any step, then the forward, verify and draft replays, the output copy overlapping the
        draft. One replay per stage whatever ``k``; the host reads nothing of the step."""
        dev, tl, step, graphs = self.device, self.timeline, batch.step, self.spec_graphs
        compute, d2h = dev.compute_stream, dev.d2h_stream
        in_flight = self._launch_forward(batch, False, lambda: graphs.forward(shape))
        # verify rewrites the static outputs the previous step's copy reads: wait for that copy
        dev.wait_event(compute, graphs.copied)

        def verify() -> None:
            in_flight.sampled, in_flight.num_accepted = graphs.verify(
                shape, batch.num_logits, batch.num_reqs, batch.max_num_logprobs
            )

        sites = self._sites
        with sites.verify_graph.stage(step, after=self._copied_stage) as verified:
            dev.submit(compute, verify)
        sampled_ready = tl.event_after_stage(compute, dev.new_event, wait_only=True)
        dev.wait_event(d2h, sampled_ready)
        with sites.draft_graph.stage(step):
            dev.submit(compute, lambda: graphs.draft(shape))
        host = self._host_buffers(batch, with_drafts=False)
        with sites.d2h_output.stage(step, after=verified) as copied_out:
            dev.submit(d2h, lambda: self._copy_out(in_flight, host))
        ready = tl.event_after_stage(d2h, dev.new_event)
        graphs.copied.record(d2h)
        self._copied_stage = copied_out
        return AsyncOutput(
            batch, step, host, ready, release=tl.give_back, pool=self.sampled_buffers
        )

    # stepscope: hot
    def _enqueue_verify(
        self,
        batch: InputBatch,
        in_flight: StepInFlight,
        mask: torch.Tensor | None,
        upload: Any = None,
    ) -> Any:
        """``verify`` (``sample`` when no request has drafts): tokens + accepted counts.
        ``upload``: the grammar mask's upload stage (the compute stream waits for it). Returns
        the stage (None when not traced)."""
        assert self.spec is not None
        spec = self.spec
        site = self._sites.verify if batch.num_drafts else self._sites.sample

        def verify() -> None:
            logits = self._masked_logits(batch, in_flight, mask)  # [N, V] f32
            in_flight.sampled, in_flight.num_accepted = spec.verify(
                batch, self.fwd.step_tensors(batch), logits
            )

        with site.stage(batch.step, after=upload) as stage:
            self.device.submit(self.device.compute_stream, verify)
        return stage

    # stepscope: hot
    def _enqueue_draft(self, batch: InputBatch, in_flight: StepInFlight) -> Any:
        """``draft``: the proposer writes step N+1's drafts into the state table. Returns the
        stage (None when not traced)."""
        assert self.spec is not None
        spec = self.spec
        md = self.fwd.attn_metadata(
            batch.num_padded_reqs, batch.num_padded_tokens, batch.max_query_len, batch.max_seq_len
        )

        def draft() -> None:
            tokens = in_flight.require_sampled().sampled_token_ids
            tensors = self.fwd.step_tensors(batch)
            in_flight.draft_ids = spec.propose(
                batch, tensors, in_flight.take_hidden(), md, tokens,
                in_flight.require("num_accepted"),
            )  # fmt: skip

        with self._sites.draft.stage(batch.step) as stage:
            self.device.submit(self.device.compute_stream, draft)
        return stage

    # stepscope: hot
    def _masked_logits(
        self, batch: InputBatch, in_flight: StepInFlight, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Device: the step's logits (computed after the forward, or now) with the grammar
        bitmask applied: disallowed tokens at -inf. [N, V] f32."""
        logits = in_flight.take_logits()
        if logits is None:
            logits = self.fwd.logits(batch, in_flight.require("hidden"))
        if mask is not None:
            self.sampler.kernels.apply_token_bitmask(logits, mask)
        return logits

    # stepscope: hot
    def _sample(
        self, batch: InputBatch, in_flight: StepInFlight, mask: torch.Tensor | None
    ) -> SamplerOutput:
        """Device: (masked) logits of the sampled rows, sample, commit to the state table."""
        logits_indices = self.fwd.logits_indices[: batch.num_logits]  # [N]
        logits = self._masked_logits(batch, in_flight, mask)  # [N, V] f32
        in_flight.hidden = None  # no draft reads it: free it
        if not batch.any_penalties:  # one fused kernel: sample + commit (docs/design.md §2.7)
            return self._sample_plain(batch, logits, logits_indices)
        logit_rows = self.fwd.packed(batch, "logit_rows").long()  # [N]
        commit_rows = self.fwd.packed(batch, "commit_rows").long()  # [N]
        # The noise key is the position the sampled token will occupy.
        sample_positions = self.fwd.positions[logits_indices] + 1  # [N]
        meta = gather_sampling_metadata(self.states, batch, logit_rows, sample_positions)
        out = self.sampler.sample(logits, meta)
        self.states.commit_sampled(commit_rows, sample_positions, out.sampled_token_ids, True)
        return out

    # stepscope: hot
    def _sample_plain(
        self, batch: InputBatch, logits: torch.Tensor, logits_indices: torch.Tensor
    ) -> SamplerOutput:
        """No row penalises: (filter thresholds,) sample + commit in one kernel, (logprobs)."""
        logit_rows = self.fwd.packed(batch, "logit_rows")  # [N] int32
        threshold = None
        if not batch.all_greedy and not batch.no_top_k_top_p_min_p:
            threshold = filter_thresholds(logits, self.states, logit_rows.long())  # [N]
        sampled = self.states.sample_and_commit(
            logits, logit_rows, self.fwd.packed(batch, "commit_rows"), logits_indices,
            self.fwd.positions, threshold, batch.all_greedy,
        )  # fmt: skip
        return self.sampler.output(logits, sampled, batch.max_num_logprobs)

    def _host_buffers(self, batch: InputBatch, with_drafts: bool) -> HostOutputBuffers:
        n, k = batch.num_logits, batch.max_num_logprobs
        he = self.device.host_empty
        spec = self.spec
        pool = self.sampled_buffers
        # [max rows (+ max requests)] int64, given back by AsyncOutput.get
        pooled = n <= pool.capacity
        base = pool.take() if pooled else he((n,), torch.int64)
        num_accepted = lp_ids = lp_values = None
        if spec is not None:
            b = batch.num_reqs
            num_accepted = pool.counts(base, b) if pooled else he((b,), torch.int64)
        if k is not None:  # [n, k + 1] token ids and logprobs
            if pooled and pool.fits_logprobs(n, k + 1):
                lp_ids, lp_values = pool.logprob_views(base, n, k + 1)
            else:
                lp_ids, lp_values = he((n, k + 1), torch.int64), he((n, k + 1), torch.float32)
        return HostOutputBuffers(
            sampled=base[:n],
            sampled_base=base if pooled else None,
            num_accepted=num_accepted,
            logprob_token_ids=lp_ids,
            logprobs=lp_values,
            logprobs_asked=None if k is None else self.states.logprobs_asked(batch.rows),
            draft_ids=(
                he((batch.num_reqs, spec.num_spec_tokens), torch.int64)
                if with_drafts and spec is not None
                else None
            ),
        )

    # stepscope: hot
    def _copy_out(self, in_flight: StepInFlight, host: HostOutputBuffers) -> None:
        """d2h stream: device results -> host buffers."""
        out = in_flight.require_sampled()
        pairs: list[tuple[Any, Any]] = [(host.sampled, out.sampled_token_ids)]
        if host.num_accepted is not None:
            pairs.append((host.num_accepted, in_flight.require("num_accepted")))
        if host.logprobs is not None:
            pairs += [
                (host.logprob_token_ids, out.logprob_token_ids),
                (host.logprobs, out.logprobs),
            ]
        if host.draft_ids is not None:
            pairs.append((host.draft_ids, in_flight.require("draft_ids")))
        for dst, src in pairs:
            self.device.keep_alive(src, self.device.d2h_stream)
            dst.copy_(src, non_blocking=True)

    def close(self) -> None:
        """Wait for the device, then emit every pending device slice (off the hot path: a
        draft enqueued after the last output's copy is still emitted, not counted as dropped)."""
        if self.timeline.num_pending:
            self.device.synchronize()
        self.timeline.drain()
