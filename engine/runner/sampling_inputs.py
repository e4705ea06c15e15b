"""The sampler's per-row inputs, gathered on the device from the state table by column name."""

from __future__ import annotations

import torch

from engine.runner.input_batch import InputBatch
from engine.runner.states import RequestStates
from engine.sample.metadata import SamplingMetadata

__all__ = ["gather_sampling_metadata"]


# stepscope: hot
def gather_sampling_metadata(
    states: RequestStates,
    batch: InputBatch,
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
