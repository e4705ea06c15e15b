"""Tensor-parallel layers (Megatron-style) that keep the HF parameter names and shapes' meaning.

Each layer is the plain module it replaces (``nn.Linear`` / ``nn.Embedding``-like ``weight``), holding
only this rank's shard, so the model's merged QKV / gate-up buffers and their HF-named views work
unchanged on a shard (rank r's ``qkv_weight`` is ``[q_r; k_r; v_r]``).

* :class:`ColumnParallelLinear` -- rows of ``W`` (output features) split: ``y_r = x W_r^T``; no
  communication (the next row-parallel layer consumes the split activations).
* :class:`RowParallelLinear` -- columns of ``W`` (input features) split: ``y = sum_r x_r W_r^T``,
  one all-reduce; a bias is added once, after it.
* :class:`VocabParallelEmbedding` -- vocab rows split (padded to ``ceil(V / tp)`` per rank): each
  rank looks up the ids it owns, zeros the rest, then all-reduce.
* :class:`ParallelLMHead` -- vocab rows split like the embedding (so tied weights share a shard);
  the logits ``[n, V/tp]`` of every rank are all-gathered into ``[n, V]``.

``shard_specs(model)`` says how to cut each full (checkpoint) tensor for this rank; the loader
uses it. The ``*_linear``/``*_embedding`` factories return the plain module when ``tp`` is None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import TPGroup

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ParallelLMHead",
    "ShardSpec",
    "shard_specs",
    "column_linear",
    "row_linear",
    "vocab_embedding",
    "lm_head_linear",
]


@dataclass(frozen=True)
class ShardSpec:
    """Rank ``rank`` of ``world_size`` holds a slice of length ``size`` along ``dim`` of a full
    tensor of ``full_size`` there (``padded``: the last slices may run past it; zero filled)."""

    dim: int
    full_size: int
    rank: int
    world_size: int
    padded: bool = False

    def __post_init__(self) -> None:
        if not self.padded and self.full_size % self.world_size:
            raise ValueError(
                f"size {self.full_size} does not split over tensor_parallel_size={self.world_size}"
            )

    @property
    def size(self) -> int:
        return -(-self.full_size // self.world_size)

    @property
    def start(self) -> int:
        return self.rank * self.size

    @property
    def num_valid(self) -> int:
        """Rows/columns of this shard inside the full tensor (< ``size`` only when padded)."""
        return max(0, min(self.size, self.full_size - self.start))

    def full_shape(self, local_shape: torch.Size) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = self.full_size
        return tuple(shape)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``full`` (a copy when zero padding is needed)."""
        piece = full.narrow(self.dim, min(self.start, self.full_size), self.num_valid)
        if self.num_valid == self.size:
            return piece
        pad_shape = list(full.shape)
        pad_shape[self.dim] = self.size - self.num_valid
        return torch.cat([piece, full.new_zeros(pad_shape)], dim=self.dim)


class ColumnParallelLinear(nn.Linear):
    """``nn.Linear(in, out / tp)`` holding output rows ``[r * out/tp, (r+1) * out/tp)``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.spec = ShardSpec(0, out_features, tp.rank, tp.world_size)
        super().__init__(in_features, self.spec.size, bias=bias, dtype=dtype, device=device)
        self.tp = tp

    def shard_spec(self, param_name: str) -> ShardSpec | None:
        return self.spec  # weight [out, in] and bias [out] both split along the outputs


class RowParallelLinear(nn.Linear):
    """``nn.Linear(in / tp, out)`` holding input columns of rank r; forward all-reduces."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.spec = ShardSpec(1, in_features, tp.rank, tp.world_size)
        super().__init__(self.spec.size, out_features, bias=bias, dtype=dtype, device=device)
        self.tp = tp

    def shard_spec(self, param_name: str) -> ShardSpec | None:
        return self.spec if param_name == "weight" else None  # the bias is whole on every rank

    # stepscope: hot
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [T, in/tp]`` (this rank's columns) -> ``[T, out]``, summed over the ranks."""
        y = self.tp.all_reduce(F.linear(x, self.weight))  # [T, out]
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows ``[r * ceil(V/tp), ...)`` of the vocab; ``weight: [ceil(V/tp), hidden]``."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.spec = ShardSpec(0, num_embeddings, tp.rank, tp.world_size, padded=True)
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.weight = nn.Parameter(
            torch.zeros(self.spec.size, embedding_dim, dtype=dtype, device=device)
        )

    def shard_spec(self, param_name: str) -> ShardSpec | None:
        return self.spec

    # stepscope: hot
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids: [T]`` int64 -> ``[T, hidden]`` (ids of other ranks contribute zeros)."""
        local = input_ids - self.spec.start  # [T]
        mine = (local >= 0) & (local < self.spec.num_valid)  # [T] bool
        rows = F.embedding(torch.where(mine, local, 0), self.weight)  # [T, hidden]
        return self.tp.all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype))


class ParallelLMHead(nn.Linear):
    """``nn.Linear(hidden, ceil(V/tp))`` with the vocab rows of rank r (padded like the
    embedding, so a tied ``lm_head.weight`` is the embedding's shard)."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.spec = ShardSpec(0, vocab_size, tp.rank, tp.world_size, padded=True)
        super().__init__(hidden_size, self.spec.size, bias=False, dtype=dtype, device=device)
        self.tp = tp
        self.vocab_size = vocab_size

    def shard_spec(self, param_name: str) -> ShardSpec | None:
        return self.spec

    # stepscope: hot
    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """``local_logits: [n, ceil(V/tp)]`` of this rank -> ``[n, V]`` (padding cut off)."""
        full = self.tp.all_gather_last_dim(local_logits)  # [n, tp * ceil(V/tp)]
        return full[:, : self.vocab_size]


def shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """``{parameter name: ShardSpec}`` for every sharded parameter of ``model`` (empty for a
    single-rank model). Tied parameters appear under every name they have."""
    specs: dict[str, ShardSpec] = {}
    for module_name, module in model.named_modules():
        shard_spec = getattr(module, "shard_spec", None)
        if shard_spec is None:
            continue
        for param_name, _ in module.named_parameters(recurse=False):
            spec = shard_spec(param_name)
            if spec is not None:
                specs[f"{module_name}.{param_name}" if module_name else param_name] = spec
    return specs


def column_linear(
    in_features: int,
    out_features: int,
    bias: bool,
    tp: TPGroup | None,
    dtype: torch.dtype,
    device: torch.device | str,
) -> nn.Linear:
    """:class:`ColumnParallelLinear`, or ``nn.Linear`` when ``tp`` is None."""
    if tp is None:
        return nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device=device)
    return ColumnParallelLinear(in_features, out_features, bias, tp, dtype, device)


def row_linear(
    in_features: int,
    out_features: int,
    bias: bool,
    tp: TPGroup | None,
    dtype: torch.dtype,
    device: torch.device | str,
) -> nn.Linear:
    """:class:`RowParallelLinear`, or ``nn.Linear`` when ``tp`` is None."""
    if tp is None:
        return nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device=device)
    return RowParallelLinear(in_features, out_features, bias, tp, dtype, device)


def vocab_embedding(
    vocab_size: int,
    hidden_size: int,
    tp: TPGroup | None,
    dtype: torch.dtype,
    device: torch.device | str,
) -> nn.Embedding | VocabParallelEmbedding:
    """:class:`VocabParallelEmbedding`, or ``nn.Embedding`` when ``tp`` is None."""
    if tp is None:
        return nn.Embedding(vocab_size, hidden_size, dtype=dtype, device=device)
    return VocabParallelEmbedding(vocab_size, hidden_size, tp, dtype, device)


def lm_head_linear(
    hidden_size: int,
    vocab_size: int,
    tp: TPGroup | None,
    dtype: torch.dtype,
    device: torch.device | str,
) -> nn.Linear:
    """:class:`ParallelLMHead`, or ``nn.Linear(hidden, vocab)`` when ``tp`` is None."""
    if tp is None:
        return nn.Linear(hidden_size, vocab_size, bias=False, dtype=dtype, device=device)
    return ParallelLMHead(hidden_size, vocab_size, tp, dtype, device)
