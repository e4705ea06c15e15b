"""CUDA graphs for speculative steps: target forward, verify and the draft chain.

A speculative step (docs/design.md §2.6, "Speculative graphs") is launch-bound when run eagerly:
the target forward over ``(1+k) * B`` tokens, the logits of every verified position, the
rejection scan, the commit and the proposer's ``k`` draft steps are hundreds of small kernels
each step, and ``k`` of them are a Python loop. Here each token bucket ``T`` (the mixed-step
buckets up to ``2 * max_num_seqs * (1+k)``) gets three graphs, replayed in the runner's three
device stages:

    forward   the target over ``T`` padded tokens (varlen attention), requests padded to
              ``Bp = min(T, max_num_seqs)``
    verify    logits of ``N = min(T, Bp * (1+k))`` rows, rejection (greedy or random), commit
    draft     the proposer's query pass and chain, drafts (and their law) into the state table

A step may be ragged (prefill chunks next to decodes, drafts trimmed near ``max_tokens``): the
layout is rebuilt on the device (:mod:`engine.spec.graph_step`). ``verify`` and ``draft`` are
captured once per sampling variant (greedy; random without filters). The bodies are plain
functions over the forward pass's persistent buffers, so on the CPU (``replay_eagerly``)
"replay" runs them eagerly: the tests' path. Input prep stays eager, in front of the graphs, as
for decode graphs.

``verify`` writes its results into buffers allocated outside the graph pool (``tokens``,
``num_accepted``), which the d2h output copy reads on another stream; the runner makes the next
replay wait for that copy (:attr:`SpecGraphs.copied`), so a replay never overwrites a step's
output before it reached the host.
"""

from __future__ import annotations

import bisect
import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from engine.device import Device, DeviceEvent
from engine.runner.capture_guard import repo_frames
from engine.runner.cuda_graphs import CAPTURE_ERROR_MODE, mixed_buckets
from engine.runner.forward_pass import ForwardPass
from engine.runner.states import RequestStates
from engine.sample.logprobs import compute_topk_logprobs
from engine.sample.sampler import SamplerOutput
from engine.sampling_params import MAX_LOGPROBS
from engine.scheduler.outputs import SchedulerOutput
from engine.spec.decoder import SpecDecoder
from engine.spec.graph_step import GraphFlags, PaddedSpecStep, StepBuffers

__all__ = ["SpecGraphs", "SpecShape", "capture_failure", "spec_buckets"]

# Why a step with drafts ran eagerly (:attr:`SpecGraphs.eager_reasons`).
EAGER_GRAMMAR = "grammar or deferred sampling"
EAGER_TOKENS = "tokens over the largest bucket"
EAGER_SAMPLING = "penalties or top-k/top-p/min-p"

VARIANTS = (GraphFlags(all_greedy=True), GraphFlags(all_greedy=False))


@dataclass(frozen=True)
class SpecShape:
    """One captured speculative step: padded tokens, requests and logits rows."""

    num_tokens: int  # T, a token bucket
    num_reqs: int  # Bp = min(T, max_num_seqs)
    num_rows: int  # N = min(T, Bp * (1 + k))
    all_greedy: bool
    logprobs: bool = False  # verify also computes the top-MAX_LOGPROBS logprobs of every row


def spec_buckets(max_num_seqs: int, query_len: int, max_tokens: int) -> list[int]:
    """Token buckets of speculative graphs: the mixed-step buckets up to ``2 * max_num_seqs *
    query_len`` (a full batch of verifies plus as many prefill tokens), at most ``max_tokens``."""
    return mixed_buckets(min(max_tokens, 2 * max_num_seqs * query_len))


class SpecGraphs:
    """Captured forward / verify / draft graphs of uniform speculative steps, by padded size.

    Args:
        enabled: the resolved ``spec_cuda_graphs`` feature.
        fwd: the runner's forward pass (model, KV caches, persistent buffers).
        spec: the runner's spec decoder (proposer, rejection sampler, draft laws).
        states: the runner's state table.
        device: the runner's device (``replay_eagerly`` when it is not CUDA).
    """

    def __init__(
        self,
        enabled: bool,
        fwd: ForwardPass,
        spec: SpecDecoder | None,
        states: RequestStates,
        device: Device,
    ) -> None:
        self.fwd = fwd
        self.device = device
        self.states = states
        self.replay_eagerly = not device.is_cuda
        self.query_len = 1 + (0 if spec is None else spec.num_spec_tokens)
        max_batch = fwd.limits.resolved_max_num_seqs
        self.max_batch = max_batch
        buckets = spec_buckets(max_batch, self.query_len, fwd.limits.max_num_batched_tokens)
        self.buckets: list[int] = buckets if enabled and spec is not None else []
        self.failure: str | None = None  # why capture failed (then spec steps run eagerly)
        self.num_replays = 0  # steps replayed from graphs
        self.num_eager = 0  # steps with drafts that ran eagerly
        self.eager_reasons: Counter[str] = Counter()  # why, per step (EAGER_* keys)
        self.step = None if spec is None else PaddedSpecStep(spec, fwd.cache.block_size)
        dev = device.torch_device
        # Outside the graph pool: read by the d2h copy on another stream.
        self.tokens = torch.zeros(max_batch * self.query_len, dtype=torch.int64, device=dev)
        self.num_accepted = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        # The logprobs variant's rows: [max rows, 1 + MAX_LOGPROBS] (column 0 = the token).
        rows = (max_batch * self.query_len, 1 + MAX_LOGPROBS)
        self.logprob_ids = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.logprobs = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.kernels = None if spec is None else spec.sampler.kernels
        self.copied: DeviceEvent = device.new_event()  # recorded after each step's output copy
        self._graphs: dict[tuple[str, SpecShape], Any] = {}  # CUDA graphs (none when eager)
        self._hidden: dict[int, torch.Tensor] = {}  # the forward graphs' outputs, by T
        if self.buckets:
            self._capture()

    @property
    def enabled(self) -> bool:
        return bool(self.buckets)

    def describe(self) -> str:
        """The captured token buckets, comma-separated ("" = none)."""
        return ",".join(map(str, self.buckets))

    def shape(self, bucket: int, all_greedy: bool, logprobs: bool = False) -> SpecShape:
        bp = min(bucket, self.max_batch)
        return SpecShape(bucket, bp, min(bucket, bp * self.query_len), all_greedy, logprobs)

    def bucket_shapes(self, bucket: int) -> list[SpecShape]:
        """Every captured shape of ``bucket``: greedy / random, without / with logprobs."""
        return [self.shape(bucket, v.all_greedy, lp) for lp in (False, True) for v in VARIANTS]

    # stepscope: hot
    def shape_for(self, out: SchedulerOutput, graphable: bool) -> SpecShape | None:
        """The captured shape a step with drafts pads to, or None to run it eagerly (counted):
        its tokens fit a bucket, sampling is greedy or plain random (no penalties or filters;
        logprobs pick the variant that computes them) and no grammar mask applies
        (``graphable``). Prefill chunks and trimmed drafts may share the step. O(1) host work."""
        if not out.scheduled_spec_decode_tokens or not self.buckets:
            return None
        i = bisect.bisect_left(self.buckets, out.total_num_scheduled_tokens)
        if not graphable:
            return self._eager(EAGER_GRAMMAR)
        if i == len(self.buckets):
            return self._eager(EAGER_TOKENS)
        flags = self.states.sampling_flags(self.states.rows_of(list(out.num_scheduled_tokens)))
        plain = flags.all_greedy or flags.no_top_k_top_p_min_p
        if flags.any_penalties or not plain:
            return self._eager(EAGER_SAMPLING)
        # b <= total <= T and b <= max_num_seqs, so the step's requests fit Bp.
        return self.shape(self.buckets[i], flags.all_greedy, flags.max_num_logprobs is not None)

    def _eager(self, reason: str) -> SpecShape | None:
        """Count a step that runs eagerly, by reason; None (no captured shape) for the caller."""
        self.num_eager += 1
        self.eager_reasons[reason] += 1
        return None

    # ---- the bodies (plain functions: captured on CUDA, run eagerly on the CPU) ----------------
    def _buffers(self) -> StepBuffers:
        fwd = self.fwd
        return StepBuffers(
            input_ids=fwd.input_ids,
            positions=fwd.positions,
            seq_lens=fwd.seq_lens,
            logits_indices=fwd.logits_indices,
            packed=fwd.step_inputs.gpu[0],
            block_table=fwd.attn_block_table,
        )

    def _metadata(self, shape: SpecShape) -> Any:
        """The target's attention over the padded shape (host bounds any step of it meets)."""
        max_model_len = self.fwd.limits.resolved_max_model_len
        return self.fwd.attn_metadata(
            shape.num_reqs, shape.num_tokens, shape.num_tokens, max_model_len
        )

    def _forward_body(self, shape: SpecShape) -> torch.Tensor:
        """The target over the padded tokens: hidden states ``[T, hidden]``."""
        t, fwd = shape.num_tokens, self.fwd
        return fwd.model(fwd.input_ids[:t], fwd.positions[:t], self._metadata(shape), fwd.kv_caches)

    def _verify_body(self, shape: SpecShape, hidden: torch.Tensor) -> None:
        """Logits of every row, verify, commit; results into :attr:`tokens` / :attr:`num_accepted`."""
        assert self.step is not None
        bufs, n, bp = self._buffers(), shape.num_rows, shape.num_reqs
        lay = self.step.layout(bufs, bp, n)
        logits = self.fwd.model.compute_logits(hidden[lay.token_idx])  # [N, V] f32
        flags = VARIANTS[0] if shape.all_greedy else VARIANTS[1]
        tokens, num_accepted = self.step.verify(bufs, lay, logits, flags)
        self.tokens[:n].copy_(tokens)
        self.num_accepted[:bp].copy_(num_accepted)
        if shape.logprobs:  # every row at the largest k; a step slices its own k (verify)
            k = min(MAX_LOGPROBS, logits.shape[1])
            lp = compute_topk_logprobs(
                logits, k, tokens.clamp(0, logits.shape[1] - 1), self.kernels
            )
            self.logprob_ids[:n, : 1 + k].copy_(lp.token_ids)
            self.logprobs[:n, : 1 + k].copy_(lp.logprobs)

    def _draft_body(self, shape: SpecShape, hidden: torch.Tensor) -> torch.Tensor:
        """The proposer over the verify results: drafts ``[Bp, k]`` into the state table."""
        assert self.step is not None
        bufs, n, bp = self._buffers(), shape.num_rows, shape.num_reqs
        return self.step.propose(
            bufs,
            self.step.layout(bufs, bp, n),
            hidden,
            self._metadata(shape),
            self.tokens[:n],
            self.num_accepted[:bp],
            shape.all_greedy,
        )

    def run_bodies(self, shapes: list[SpecShape]) -> None:
        """The bodies of ``shapes`` (the sampling variants of one bucket) once, eagerly: one
        forward, then verify per variant and draft per variant without logprobs (capture
        warm-up; the CPU check that the bodies move no host data,
        tests/engine/test_spec_graphs.py)."""
        hidden = self._forward_body(shapes[0])
        for shape in shapes:
            self._verify_body(shape, hidden)
            if not shape.logprobs:
                self._draft_body(shape, hidden)

    # ---- replay (compute stream) ---------------------------------------------------------------
    # stepscope: hot
    def forward(self, shape: SpecShape) -> torch.Tensor:
        """Device: the target forward of ``shape``; returns the hidden states."""
        self.num_replays += 1
        if self.replay_eagerly:
            hidden = self._forward_body(shape)
            self._hidden[shape.num_tokens] = hidden
            return hidden
        self._graphs["forward", _forward_key(shape)].replay()
        return self._hidden[shape.num_tokens]

    # stepscope: hot
    def verify(
        self, shape: SpecShape, num_logits: int, num_reqs: int, num_logprobs: int | None
    ) -> tuple[SamplerOutput, torch.Tensor]:
        """Device: verify + commit; returns the step's output (views of ``tokens
        [num_logits]``; the logprobs variant's ``[num_logits, 1 + num_logprobs]`` copied out of
        the static buffers) and ``num_accepted [num_reqs]`` (the live requests' part)."""
        if self.replay_eagerly:
            self._verify_body(shape, self._hidden[shape.num_tokens])
        else:
            self._graphs["verify", shape].replay()
        tokens, num_accepted = self.tokens[:num_logits], self.num_accepted[:num_reqs]
        if num_logprobs is None:
            return SamplerOutput(tokens), num_accepted
        if not shape.logprobs:
            raise RuntimeError(f"a step asking for logprobs replayed {shape} (no logprobs)")
        cols = 1 + num_logprobs
        ids = self.logprob_ids[:num_logits, :cols].contiguous()
        return SamplerOutput(
            tokens, ids, self.logprobs[:num_logits, :cols].contiguous()
        ), num_accepted

    # stepscope: hot
    def draft(self, shape: SpecShape) -> None:
        """Device: the draft chain; the next step's drafts land in the state table."""
        if self.replay_eagerly:
            self._draft_body(shape, self._hidden.pop(shape.num_tokens))
        else:
            self._graphs["draft", _draft_key(shape)].replay()

    # ---- capture --------------------------------------------------------------------------------
    def fill(self, shape: SpecShape) -> None:
        """A harmless batch of ``shape`` for warm-up and capture: every request padded (the
        trash row, no query token, slot -1), so nothing but the trash row is written."""
        fwd, t, bp = self.fwd, shape.num_tokens, shape.num_reqs
        fwd.input_ids[:t].zero_()
        fwd.positions[:t].zero_()
        fwd.slot_mapping[:t].fill_(-1)
        fwd.seq_lens[:bp].zero_()
        fwd.logits_indices[: shape.num_rows].zero_()
        fwd.attn_block_table[:bp].zero_()
        packed = fwd.step_inputs.gpu[0]
        packed[:bp].fill_(self.states.trash_row)  # idx_mapping
        packed[bp : 3 * bp + 2].zero_()  # query_start_loc and cu_num_logits: all empty

    def _capture(self) -> None:
        """Capture every bucket (largest first, one pool); eager bodies on the CPU. A failure
        leaves speculative steps eager with :attr:`failure` set (the engine reports it)."""
        if self.replay_eagerly:
            return
        try:
            with torch.no_grad():
                self._capture_cuda()
        except Exception as exc:  # noqa: BLE001 -- any capture failure decides the feature
            self.device.synchronize()
            self.disable(capture_failure(exc))

    def _capture_cuda(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = self.device.compute_stream
        for bucket in reversed(self.buckets):
            shapes = self.bucket_shapes(bucket)
            with torch.cuda.stream(stream):
                self.fill(shapes[0])
                for _ in range(2):  # lazy inits and Triton compiles happen outside capture
                    self.run_bodies(shapes)
            stream.synchronize()
            forward = torch.cuda.CUDAGraph()
            with torch.cuda.graph(
                forward, pool=pool, stream=stream, capture_error_mode=CAPTURE_ERROR_MODE
            ):
                hidden = self._forward_body(shapes[0])
            self._graphs["forward", _forward_key(shapes[0])] = forward
            self._hidden[bucket] = hidden
            for shape in shapes:
                for kind in ("verify", "draft") if not shape.logprobs else ("verify",):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(
                        graph, pool=pool, stream=stream, capture_error_mode=CAPTURE_ERROR_MODE
                    ):
                        if kind == "verify":
                            self._verify_body(shape, hidden)
                        else:
                            self._draft_body(shape, hidden)
                    self._graphs[kind, shape] = graph
        stream.synchronize()

    def disable(self, reason: str) -> None:
        """Run speculative steps eagerly (after a failed capture); keeps the reason."""
        self.failure = reason
        self.buckets = []
        self._graphs = {}
        self._hidden = {}


def capture_failure(exc: BaseException) -> str:
    """The reason a failed capture reports: the error's first line and the innermost frames of
    this repository that raised it (``path:line (function)``, innermost first), so a device run
    names the line to fix; CUDA's own messages carry no location."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    where = repo_frames(traceback.extract_tb(exc.__traceback__))
    return f"capture failed: {type(exc).__name__}: {first}" + (f" [at {where}]" if where else "")


def _forward_key(shape: SpecShape) -> SpecShape:
    """The forward graph does not depend on the sampling variant: one per padded size."""
    return SpecShape(shape.num_tokens, shape.num_reqs, shape.num_rows, True)


def _draft_key(shape: SpecShape) -> SpecShape:
    """The draft graph does not depend on logprobs: one per padded size and sampling mode."""
    return SpecShape(shape.num_tokens, shape.num_reqs, shape.num_rows, shape.all_greedy)
