"""The forward half of a step: persistent input buffers, input prep, the model, CUDA graphs.

``ForwardPass`` owns the model, its paged KV caches and every device buffer a CUDA graph replays
against (``input_ids``, ``positions``, ``slot_mapping``, ``seq_lens``, ``logits_indices``, the
gathered block table). The runner (``ModelRunner``) owns the request state table and the staged
packed batch and decides what to enqueue; this class computes.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.device import Device
from engine.kernels.attention_metadata import AttentionMetadata
from engine.kernels.backend import KernelBackend
from engine.kernels.input_prep import InputPrepArgs
from engine.runner.cuda_graphs import CudaGraphRunner, GraphShape
from engine.runner.input_batch import InputBatch
from engine.runner.staged_write import StagedWriteTensor
from engine.runner.states import RequestStates
from engine.spec.decoder import StepTensors

__all__ = ["ForwardPass", "max_num_tokens"]


def max_num_tokens(limits: SchedulerConfig) -> int:
    """Token buffers also hold a decode batch padded to a graph size (<= max_num_seqs)."""
    return max(limits.max_num_batched_tokens, limits.resolved_max_num_seqs)


class ForwardPass:
    """Model + KV caches + graph-stable input buffers for one runner.

    Args:
        limits: the engine config's scheduler part (``max_model_len`` resolved): buffer sizes.
        cache: the engine config's KV cache part: the paged KV caches.
        states: the runner's state table (read on the device by input prep).
        step_inputs: the runner's staged packed batch (``[1, capacity]`` int32 on the device).
        graphs: the resolved CUDA-graph runner; captured here at construction.
        kernels: the engine's kernel backend (input prep).
    """

    def __init__(
        self,
        model: Any,
        device: Device,
        limits: SchedulerConfig,
        cache: CacheConfig,
        states: RequestStates,
        step_inputs: StagedWriteTensor,
        graphs: CudaGraphRunner,
        kernels: KernelBackend,
    ) -> None:
        self.model = model
        self.kernels = kernels
        self.device = device
        self.limits = limits  # the engine config's scheduler part, max_model_len resolved
        self.cache = cache
        self.states = states
        self.step_inputs = step_inputs
        self.graphs = graphs
        self.kv_caches = model.allocate_kv_caches(cache.resolved_num_kv_blocks, cache.block_size)
        self._alloc_buffers()
        if self.graphs.enabled:
            self._capture_graphs()

    def _capture_graphs(self) -> None:
        """Capture at start-up; a failure leaves the runner eager with ``graphs.failure`` set,
        which the engine reports to its feature decisions (``ResolvedFeatures.fall_back``)."""
        try:
            self.graphs.capture(self.device, self.forward_padded, self._fill_graph_inputs)
        except Exception as exc:  # noqa: BLE001 -- any capture failure decides the feature
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            self.graphs.disable(f"capture failed: {type(exc).__name__}: {first_line}")

    def _alloc_buffers(self) -> None:
        dev = self.device.torch_device
        t, r = max_num_tokens(self.limits), self.limits.resolved_max_num_seqs
        max_blocks_per_req = self.cache.blocks_for(self.limits.resolved_max_model_len)
        # Persistent: CUDA graphs replay against these addresses.
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=dev)  # [T]
        self.positions = torch.zeros(t, dtype=torch.int64, device=dev)  # [T]
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=dev)  # [T]
        self.seq_lens = torch.zeros(r, dtype=torch.int32, device=dev)  # [R]
        self.logits_indices = torch.zeros(t, dtype=torch.int64, device=dev)  # [T]
        # attn_block_table: [R, max_blocks] int32, rows gathered through idx_mapping
        self.attn_block_table = torch.zeros(r, max_blocks_per_req, dtype=torch.int32, device=dev)

    def step_tensors(self, batch: InputBatch) -> StepTensors:
        return StepTensors(
            input_ids=self.input_ids,
            positions=self.positions,
            logits_indices=self.logits_indices[: batch.num_logits],
            idx_mapping=self.packed(batch, "idx_mapping"),
            query_start_loc=self.packed(batch, "query_start_loc"),
            cu_num_logits=self.packed(batch, "cu_num_logits"),
            logit_rows=self.packed(batch, "logit_rows").long(),
            commit_rows=self.packed(batch, "commit_rows").long(),
            num_blocks=self.packed(batch, "num_blocks"),
            block_table=self.attn_block_table,
        )

    def packed(self, batch: InputBatch, name: str) -> torch.Tensor:
        start, end = batch.offsets[name]
        return self.step_inputs.gpu[0, start:end]

    # stepscope: hot
    def prepare(self, batch: InputBatch) -> None:
        """Device: gather this step's inputs from the state table into the persistent buffers."""
        s = self.states
        idx_mapping = self.packed(batch, "idx_mapping")  # [num_padded_reqs] int32
        args = InputPrepArgs(
            idx_mapping=idx_mapping,
            query_start_loc=self.packed(batch, "query_start_loc"),
            cu_num_logits=self.packed(batch, "cu_num_logits"),
            num_computed=s.num_computed.gpu[:, 0],
            prefill_len=s.prefill_len.gpu[:, 0],
            token_ids=s.token_ids.gpu,
            last_sampled=s.last_sampled,
            block_table=s.block_table.gpu,
            input_ids=self.input_ids,
            positions=self.positions,
            slot_mapping=self.slot_mapping,
            seq_lens=self.seq_lens,
            logits_indices=self.logits_indices,
            block_size=self.cache.block_size,
            num_reqs=batch.num_reqs,
            num_tokens=batch.num_tokens,
            num_logits=batch.num_logits,
            max_query_len=batch.max_query_len,
            num_padded_tokens=batch.num_padded_tokens,
            num_padded_reqs=batch.num_padded_reqs,
            attn_block_table=self.attn_block_table,
        )
        self.kernels.prepare_inputs(args)

    def attn_metadata(self, num_reqs: int, num_tokens: int, max_q: int, max_s: int) -> Any:
        return AttentionMetadata(
            query_start_loc=self.step_inputs.gpu[0, num_reqs : 2 * num_reqs + 1],
            seq_lens=self.seq_lens[:num_reqs],
            block_table=self.attn_block_table[:num_reqs],
            slot_mapping=self.slot_mapping[:num_tokens],
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            max_query_len=max_q,
            max_seq_len=max_s,
        )

    def replays_graph(self, batch: InputBatch) -> bool:
        """Whether :meth:`forward` of ``batch`` is one captured CUDA-graph replay (not a recorded
        body run eagerly): the trace's ``graph_replay`` arg (docs/design.md §4.9)."""
        graphs = self.graphs
        return not graphs.replay_eagerly and graphs.has_key(
            batch.num_padded_tokens, batch.num_padded_reqs, batch.is_uniform_decode
        )

    # stepscope: hot
    def take_stamps(self, batch: InputBatch) -> tuple[Any, Any] | None:
        """The graph stamps (begin, end) :meth:`forward` of ``batch`` will write: one pair per
        replay of a stamped graph, taken on the engine thread in enqueue order, traced or not
        (``instrument.graph_stamps``); None when it replays no stamped graph."""
        graphs = self.graphs
        if graphs.stamps is None or not graphs.has_key(
            batch.num_padded_tokens, batch.num_padded_reqs, batch.is_uniform_decode
        ):
            return None
        return graphs.stamps.take()  # type: ignore[no-any-return]

    # stepscope: hot
    def forward(self, batch: InputBatch) -> torch.Tensor:
        """Device: hidden states ``[num_padded_tokens, hidden]`` (graph replay when captured)."""
        tp, bp = batch.num_padded_tokens, batch.num_padded_reqs
        shape = GraphShape(tp, bp, batch.is_uniform_decode)
        if self.graphs.has(shape):
            return self.graphs.replay(shape)
        md = self.attn_metadata(bp, tp, batch.max_query_len, batch.max_seq_len)
        return self.model(self.input_ids[:tp], self.positions[:tp], md, self.kv_caches)

    def forward_padded(self, shape: GraphShape) -> torch.Tensor:
        """The captured body: a batch padded to ``shape`` against the persistent buffers.

        Everything it reads lives at fixed addresses (``input_ids``, ``positions``,
        ``slot_mapping``, ``seq_lens``, the gathered block table, ``query_start_loc`` inside
        the staged packed batch) and the host ints are bounds any batch of the shape meets
        (``max_query_len`` of the shape, ``max_seq_len = max_model_len``), so one capture
        serves every step padded to it. On the CPU it runs eagerly (the tests' padded path).
        """
        t, r = shape.num_tokens, shape.num_reqs
        md = self.attn_metadata(r, t, shape.max_query_len, self.limits.resolved_max_model_len)
        return self.model(self.input_ids[:t], self.positions[:t], md, self.kv_caches)

    def _fill_graph_inputs(self, shape: GraphShape) -> None:
        """A harmless batch of ``shape`` for warm-up and capture: no request owns a token (all
        are padding), so nothing writes KV and attention reads nothing."""
        t, r = shape.num_tokens, shape.num_reqs
        self.input_ids[:t].zero_()
        self.positions[:t].zero_()
        self.slot_mapping[:t].fill_(-1)
        self.seq_lens[:r].zero_()
        self.attn_block_table[:r].zero_()
        self.step_inputs.gpu[0, r : 2 * r + 1].zero_()  # query_start_loc: every request empty

    # stepscope: hot
    def logits(self, batch: InputBatch, hidden: torch.Tensor) -> torch.Tensor:
        """Device: logits of the sampled rows, ``[N, V]`` f32."""
        n = batch.num_logits
        if n == batch.num_tokens:  # every token sampled (decode): the indices are 0..n-1
            return self.model.compute_logits(hidden[:n])
        return self.model.compute_logits(hidden[self.logits_indices[:n]])
