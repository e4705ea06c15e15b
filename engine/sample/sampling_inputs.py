"""The sampler's per-row inputs, gathered on the device from the state table by column name.

The state table (``engine.runner.states.RequestStates``) and the host batch
(``engine.runner.input_batch.InputBatch``) live in the runner, a layer above this one
(docs/design.md §1.2): this module reads them through the typed views :class:`SamplingRows` and
:class:`BatchFlags`, which they implement, and never imports the runner.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.sample.metadata import SamplingMetadata

__all__ = ["BatchFlags", "SamplingRows", "gather_sampling_metadata"]


class SamplingRows(Protocol):
    """What sampling reads of the state table: per-row parameters by name and the penalty
    books (``[R + 1, V]``), all on the device."""

    @property
    def output_bin_counts(self) -> torch.Tensor: ...  # [R + 1, V] int32

    @property
    def prompt_bin_mask(self) -> torch.Tensor: ...  # [R + 1, V] bool

    def sampling_columns(self, rows: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def top_k_of(self, rows: torch.Tensor) -> torch.Tensor: ...

    def seeds_of(self, rows: torch.Tensor) -> torch.Tensor: ...


class BatchFlags(Protocol):
    """The host flags of one step that decide which sampling paths run (no device tensors)."""

    @property
    def any_penalties(self) -> bool: ...

    @property
    def all_greedy(self) -> bool: ...

    @property
    def no_top_k_top_p_min_p(self) -> bool: ...

    @property
    def max_num_logprobs(self) -> int | None: ...


# stepscope: hot
def gather_sampling_metadata(
    states: SamplingRows,
    batch: BatchFlags,
    logit_rows: torch.Tensor,  # [N] int64 state rows
    sample_positions: torch.Tensor,  # [N] int64 position each sampled token will occupy
) -> SamplingMetadata:
    """Per-logits-row sampling tensors gathered from the state table; host flags from the batch."""
    f32 = states.sampling_columns(logit_rows)  # name -> [N] f32
    penalties = batch.any_penalties
    return SamplingMetadata(
        temperature=f32["temperature"],
        top_k=states.top_k_of(logit_rows),
        top_p=f32["top_p"],
        min_p=f32["min_p"],
        seeds=states.seeds_of(logit_rows),
        positions=sample_positions,
        repetition_penalties=f32["repetition"],
        presence_penalties=f32["presence"],
        frequency_penalties=f32["frequency"],
        output_bin_counts=states.output_bin_counts[logit_rows] if penalties else None,
        prompt_bin_mask=states.prompt_bin_mask[logit_rows] if penalties else None,
        all_greedy=batch.all_greedy,
        no_top_k_top_p_min_p=batch.no_top_k_top_p_min_p,
        no_penalties=not penalties,
        max_num_logprobs=batch.max_num_logprobs,
    )
