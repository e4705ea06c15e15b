"""Device glue between the state table and the sampler: gather per-row params, commit tokens."""

from __future__ import annotations

import torch

from engine.runner.input_batch import InputBatch
from engine.runner.states import SAMPLING_F32_COLUMNS, RequestStates
from engine.sample.metadata import SamplingMetadata
from engine.sample.penalties import update_output_bin_counts

__all__ = ["gather_sampling_metadata", "commit_sampled"]

_COL = {name: i for i, name in enumerate(SAMPLING_F32_COLUMNS)}


# stepscope: hot
def gather_sampling_metadata(
    states: RequestStates,
    batch: InputBatch,
    logit_rows: torch.Tensor,  # [N] int64 state rows
    sample_positions: torch.Tensor,  # [N] int64 position each sampled token will occupy
) -> SamplingMetadata:
    """Per-logits-row sampling tensors gathered from the state table; host flags from the batch."""
    f32 = states.sampling_f32.gpu[logit_rows]  # [N, 6]
    penalties = batch.any_penalties
    return SamplingMetadata(
        temperature=f32[:, _COL["temperature"]].contiguous(),
        top_k=states.top_k.gpu[logit_rows, 0].contiguous(),
        top_p=f32[:, _COL["top_p"]].contiguous(),
        min_p=f32[:, _COL["min_p"]].contiguous(),
        seeds=states.seeds.gpu[logit_rows, 0].contiguous(),
        positions=sample_positions,
        repetition_penalties=f32[:, _COL["repetition"]].contiguous(),
        presence_penalties=f32[:, _COL["presence"]].contiguous(),
        frequency_penalties=f32[:, _COL["frequency"]].contiguous(),
        output_bin_counts=states.output_bin_counts[logit_rows] if penalties else None,
        prompt_bin_mask=states.prompt_bin_mask[logit_rows] if penalties else None,
        all_greedy=batch.all_greedy,
        no_top_k_top_p_min_p=batch.no_top_k_top_p_min_p,
        no_penalties=not penalties,
        max_num_logprobs=batch.max_num_logprobs,
    )


# stepscope: hot
def commit_sampled(
    states: RequestStates,
    batch: InputBatch,
    commit_rows: torch.Tensor,  # [N] int64; the trash row for discarded samples
    sample_positions: torch.Tensor,  # [N] int64
    sampled: torch.Tensor,  # [N] int64
) -> None:
    """Record sampled tokens in the state table, on the device: the next step reads them here."""
    states.last_sampled[commit_rows] = sampled
    cols = sample_positions.clamp(max=states.max_model_len - 1)
    states.token_ids.gpu[commit_rows, cols] = sampled
    if batch.any_penalties:
        update_output_bin_counts(states.output_bin_counts, commit_rows, sampled)
