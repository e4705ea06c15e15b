"""The kernel backend: every kernel operation the model, sampler, spec decoder and runner call.

Kernels are chosen once: ``create_kernel_backend(name)`` builds the backend the resolved
``triton_kernels`` feature names (docs/design.md §2.1), and the one object is handed to the model
(through its frozen ``LayerContext``), the sampler, the spec decoder and the runner. Nobody above
this floor takes a flag to pick an implementation itself.

* :class:`TorchKernels` -- the torch references (any device; what the tests compare against);
* :class:`TritonKernels` -- the Triton kernels (CUDA, or the CPU under ``TRITON_INTERPRET=1``).

Both implement every operation of :class:`KernelBackend`, with the same shapes and in-place
contracts as the ``*_torch`` / ``*_triton`` functions of each kernel family file. This package is
the engine's ground floor: it imports nothing of the engine above it (docs/design.md §1.2).
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.kernels import (
    activation,
    attention,
    batch_invariant,
    bitmask,
    input_prep,
    kv_write,
    norm,
    rejection,
    rope,
    sampling,
    sampling_split,
    staged_write,
)
from engine.kernels.attention_metadata import AttentionMetadata
from engine.kernels.input_prep import InputPrepArgs
from engine.kernels.noise import NoiseStream

__all__ = [
    "KERNEL_BACKENDS",
    "KernelBackend",
    "TorchKernels",
    "TritonKernels",
    "create_kernel_backend",
]


class KernelBackend(abc.ABC):
    """The kernel operations of one implementation. Stateless; one instance per engine.

    ``invariant`` (``batch_invariant``, ``--batch-invariant``, docs/design.md §2.16): every
    operation gives a row the same bits whatever batch it runs in. ``linear`` then runs
    :func:`engine.kernels.batch_invariant.linear`, and the Triton backend's attention runs each
    token alone (``attention.paged_attention_per_token_triton``). Off, ``linear`` is
    ``F.linear``."""

    name: str
    # ``x @ weight.T + bias`` (``F.linear``'s signature): bound once, no branch per call.
    linear: Callable[..., torch.Tensor]

    def __init__(self, invariant: bool = False) -> None:
        self.batch_invariant = invariant
        self.linear = batch_invariant.linear if invariant else F.linear

    # ---- model layers ---------------------------------------------------------------------
    @abc.abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim of ``x: [..., H]``."""

    @abc.abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)`` for ``x, residual: [T, H]``."""

    @abc.abstractmethod
    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gate_up: [T, 2I] -> silu(gate) * up: [T, I]``."""

    @abc.abstractmethod
    def qk_norm_rope_write_kv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_norm_weight: torch.Tensor | None,
        k_norm_weight: torch.Tensor | None,
        eps: float,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
    ) -> torch.Tensor:
        """q/k norm + RoPE, K/V written into ``kv_cache``; returns q ``[T, Hq, D]``."""

    @abc.abstractmethod
    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """K/V ``[T, Hkv, D]`` into their slots of ``kv_cache`` (slot -1: nothing)."""

    @abc.abstractmethod
    def paged_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of ``q: [T, Hq, D]`` over each request's paged KV -> ``[T, Hq, D]``."""

    # ---- runner ---------------------------------------------------------------------------
    def prepare_inputs(self, a: InputPrepArgs) -> None:
        """Fill the step's inputs on the device, the padding past them and, when asked, the
        gathered block table (:mod:`engine.kernels.input_prep`)."""
        self._prepare_inputs(a)

    @abc.abstractmethod
    def _prepare_inputs(self, a: InputPrepArgs) -> None: ...

    @abc.abstractmethod
    def apply_staged_writes(
        self,
        base: torch.Tensor,
        rows: torch.Tensor,
        starts: torch.Tensor,
        offsets: torch.Tensor,
        values: torch.Tensor,
        num_values: int,
        max_len: int,
    ) -> None:
        """Apply packed ``(row, start, values)`` writes to ``base`` (host ints from the packer)."""

    # ---- sampling, verification, grammar --------------------------------------------------
    @abc.abstractmethod
    def gumbel_sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        keep_threshold: torch.Tensor,
        seeds: torch.Tensor,
        positions: torch.Tensor,
        stream: int = NoiseStream.SAMPLE,
    ) -> torch.Tensor:
        """Gumbel-max sampling; shapes as :func:`engine.kernels.sampling.gumbel_sample_torch`."""

    @abc.abstractmethod
    def sample_commit(self, a: sampling.SampleCommitArgs) -> torch.Tensor:
        """Plain sampling (no penalties) read from and committed to the state table in place;
        ``[N]`` int64. See :class:`engine.kernels.sampling.SampleCommitArgs`."""

    @abc.abstractmethod
    def row_logsumexp(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits: [N, V]`` f32 -> ``[N]`` f32."""

    @abc.abstractmethod
    def rejection_scan(
        self,
        cu_num_logits: torch.Tensor,
        draft_ids: torch.Tensor,
        accepted: torch.Tensor,
        fallback_ids: torch.Tensor,
        max_rows_per_req: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [N] int64, num_accepted [B] int64)``; see :mod:`engine.kernels.rejection`."""

    def apply_token_bitmask(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mask disallowed tokens to ``-inf`` in place; returns ``logits``.

        logits: [N, V] float; mask: [>= N, ceil(V / 32)] int32 (xgrammar's packed layout).
        """
        bitmask.check_bitmask(logits, mask)
        return self._apply_token_bitmask(logits, mask[: logits.shape[0]])

    @abc.abstractmethod
    def _apply_token_bitmask(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor: ...


class TorchKernels(KernelBackend):
    """The torch references: every operation, on any device."""

    name = "torch"

    # stepscope: hot
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return norm.rms_norm_torch(x, weight, eps)

    # stepscope: hot
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return norm.add_rms_norm_torch(x, residual, weight, eps)

    # stepscope: hot
    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return activation.silu_and_mul_torch(gate_up)

    # stepscope: hot
    def qk_norm_rope_write_kv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_norm_weight: torch.Tensor | None,
        k_norm_weight: torch.Tensor | None,
        eps: float,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
    ) -> torch.Tensor:
        return rope.qk_norm_rope_write_kv_torch(
            qkv, cos, sin, q_norm_weight, k_norm_weight, eps, kv_cache, slot_mapping, num_heads
        )

    # stepscope: hot
    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        kv_write.write_kv_torch(k, v, kv_cache, slot_mapping)

    # stepscope: hot
    def paged_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return attention.paged_attention_torch(q, kv_cache, attn_metadata, scale)

    # stepscope: hot
    def _prepare_inputs(self, a: InputPrepArgs) -> None:
        input_prep.prepare_inputs_torch(a)
        input_prep.fill_padding(a)
        input_prep.gather_block_table(a)

    # stepscope: hot
    def apply_staged_writes(
        self,
        base: torch.Tensor,
        rows: torch.Tensor,
        starts: torch.Tensor,
        offsets: torch.Tensor,
        values: torch.Tensor,
        num_values: int,
        max_len: int,
    ) -> None:
        staged_write.apply_staged_writes_torch(base, rows, starts, offsets, values, num_values)

    # stepscope: hot
    def gumbel_sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        keep_threshold: torch.Tensor,
        seeds: torch.Tensor,
        positions: torch.Tensor,
        stream: int = NoiseStream.SAMPLE,
    ) -> torch.Tensor:
        return sampling.gumbel_sample_torch(
            logits, temperature, keep_threshold, seeds, positions, stream
        )

    # stepscope: hot
    def sample_commit(self, a: sampling.SampleCommitArgs) -> torch.Tensor:
        return sampling.sample_commit_torch(a)

    # stepscope: hot
    def row_logsumexp(self, logits: torch.Tensor) -> torch.Tensor:
        return sampling.row_logsumexp_torch(logits)

    # stepscope: hot
    def rejection_scan(
        self,
        cu_num_logits: torch.Tensor,
        draft_ids: torch.Tensor,
        accepted: torch.Tensor,
        fallback_ids: torch.Tensor,
        max_rows_per_req: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rejection.rejection_scan_torch(cu_num_logits, draft_ids, accepted, fallback_ids)

    # stepscope: hot
    def _apply_token_bitmask(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return bitmask.apply_token_bitmask_torch(logits, mask)


class TritonKernels(KernelBackend):
    """The Triton kernels. ``rms_norm`` of a tensor that is not 2-D (q/k-norm head views) runs the
    torch reference, as the Triton kernel takes ``[T, H]`` rows.

    Sampling (``sample_commit``, ``gumbel_sample``, ``row_logsumexp``) runs the split-vocab
    kernels of :mod:`engine.kernels.sampling_split` (a rows x vocab-chunks grid, then one reduction
    per row; the same tokens) whenever the vocab has more than one ``split_chunk`` chunk, for every
    sampling variant; a vocab of one chunk runs the one-program-per-row kernels of
    :mod:`engine.kernels.sampling` (one launch instead of two; docs/design.md §2.15)."""

    name = "triton"

    def __init__(
        self, invariant: bool = False, split_chunk: int = sampling_split.SPLIT_CHUNK
    ) -> None:
        super().__init__(invariant)
        if not input_prep.HAS_TRITON:
            raise RuntimeError("the triton kernel backend needs triton, which is not installed")
        sampling_split.check_split_launch(split_chunk, sampling_split.SPLIT_BLOCK)
        self.split_chunk = split_chunk
        self._split_block = min(sampling_split.SPLIT_BLOCK, split_chunk)

    # stepscope: hot
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2:
            return norm.rms_norm_triton(x, weight, eps)
        return norm.rms_norm_torch(x, weight, eps)

    # stepscope: hot
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return norm.add_rms_norm_triton(x, residual, weight, eps)

    # stepscope: hot
    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return activation.silu_and_mul_triton(gate_up)

    # stepscope: hot
    def qk_norm_rope_write_kv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_norm_weight: torch.Tensor | None,
        k_norm_weight: torch.Tensor | None,
        eps: float,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
    ) -> torch.Tensor:
        return rope.qk_norm_rope_write_kv_triton(
            qkv, cos, sin, q_norm_weight, k_norm_weight, eps, kv_cache, slot_mapping, num_heads
        )

    # stepscope: hot
    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        kv_write.write_kv_triton(k, v, kv_cache, slot_mapping)

    # stepscope: hot
    def paged_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if self.batch_invariant:  # every token on its own, one fixed launch
            return attention.paged_attention_per_token_triton(q, kv_cache, attn_metadata, scale)
        return attention.paged_attention_triton(q, kv_cache, attn_metadata, scale)

    # stepscope: hot
    def _prepare_inputs(self, a: InputPrepArgs) -> None:
        input_prep.prepare_inputs_triton(a)

    # stepscope: hot
    def apply_staged_writes(
        self,
        base: torch.Tensor,
        rows: torch.Tensor,
        starts: torch.Tensor,
        offsets: torch.Tensor,
        values: torch.Tensor,
        num_values: int,
        max_len: int,
    ) -> None:
        staged_write.apply_staged_writes_triton(base, rows, starts, offsets, values, max_len)

    # stepscope: hot
    def gumbel_sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        keep_threshold: torch.Tensor,
        seeds: torch.Tensor,
        positions: torch.Tensor,
        stream: int = NoiseStream.SAMPLE,
    ) -> torch.Tensor:
        if sampling_split.split_applies(logits.shape[1], self.split_chunk):
            return sampling_split.gumbel_sample_split_triton(
                logits, temperature, keep_threshold, seeds, positions, stream,
                chunk=self.split_chunk, block=self._split_block,
            )  # fmt: skip
        return sampling.gumbel_sample_triton(
            logits, temperature, keep_threshold, seeds, positions, stream
        )

    # stepscope: hot
    def sample_commit(self, a: sampling.SampleCommitArgs) -> torch.Tensor:
        if sampling_split.split_applies(a.logits.shape[1], self.split_chunk):
            return sampling_split.sample_commit_split_triton(
                a, chunk=self.split_chunk, block=self._split_block
            )
        return sampling.sample_commit_triton(a)

    # stepscope: hot
    def row_logsumexp(self, logits: torch.Tensor) -> torch.Tensor:
        if sampling_split.split_applies(logits.shape[1], self.split_chunk):
            return sampling_split.row_logsumexp_split_triton(
                logits, chunk=self.split_chunk, block=self._split_block
            )
        return sampling.row_logsumexp_triton(logits)

    # stepscope: hot
    def rejection_scan(
        self,
        cu_num_logits: torch.Tensor,
        draft_ids: torch.Tensor,
        accepted: torch.Tensor,
        fallback_ids: torch.Tensor,
        max_rows_per_req: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rejection.rejection_scan_triton(
            cu_num_logits, draft_ids, accepted, fallback_ids, max_rows_per_req
        )

    # stepscope: hot
    def _apply_token_bitmask(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return bitmask.apply_token_bitmask_triton(logits, mask)


KERNEL_BACKENDS: dict[str, type[KernelBackend]] = {
    TorchKernels.name: TorchKernels,
    TritonKernels.name: TritonKernels,
}


def create_kernel_backend(name: str, invariant: bool = False) -> KernelBackend:
    """The backend registered as ``name`` (``"torch"`` or ``"triton"``); ``invariant``: its
    batch-invariant mode (:class:`KernelBackend`).

    Raises ``ValueError`` for an unknown name and ``RuntimeError`` for ``"triton"`` without
    triton installed."""
    try:
        cls = KERNEL_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown kernel backend {name!r}; choose one of {sorted(KERNEL_BACKENDS)}"
        ) from None
    return cls(invariant)
