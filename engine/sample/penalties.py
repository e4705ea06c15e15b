"""Repetition, presence and frequency penalties, applied on the device from per-row bin counts.

Conventions (HF / vLLM):

* repetition penalty r, for every token that occurs in the prompt or the output so far:
  ``l' = l / r`` if ``l > 0`` else ``l * r`` (r > 1 always makes the token less likely);
* frequency penalty f and presence penalty a, on output counts c only:
  ``l' = l - f * c - a * [c > 0]``.

Repetition is applied first, then frequency and presence, as vLLM does.
"""

from __future__ import annotations

import torch

__all__ = [
    "apply_penalties",
    "update_output_bin_counts",
    "reset_penalty_rows",
    "set_prompt_bin_mask",
]


# stepscope: hot
def apply_penalties(
    logits: torch.Tensor,
    output_bin_counts: torch.Tensor,
    prompt_bin_mask: torch.Tensor,
    repetition_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
) -> torch.Tensor:
    """Return penalised logits (out of place; the raw logits stay intact for logprobs).

    logits: [N, V] f32; output_bin_counts: [N, V] int32; prompt_bin_mask: [N, V] bool;
    penalties: [N] f32. Rows with neutral penalties (1, 0, 0) are returned unchanged.
    """
    # logits: [N, V]
    output_mask = output_bin_counts > 0
    seen = prompt_bin_mask | output_mask
    rep = repetition_penalties[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency_penalties[:, None] * output_bin_counts.to(logits.dtype)
    return logits - presence_penalties[:, None] * output_mask.to(logits.dtype)


# stepscope: hot
def update_output_bin_counts(
    output_bin_counts: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor
) -> None:
    """counts[rows[i], token_ids[i]] += 1 in place, on the device; token id < 0 adds nothing.

    output_bin_counts: [num_state_rows, V] int32 (the runner's state table); rows: [M] int64
    state-table rows (repeat a row once per accepted token under speculative decoding);
    token_ids: [M] int64, -1 for padding/rejected slots. Duplicates accumulate.
    """
    valid = token_ids >= 0
    safe_ids = torch.where(valid, token_ids, torch.zeros_like(token_ids))
    output_bin_counts.index_put_(
        (rows.to(torch.int64), safe_ids.to(torch.int64)),
        valid.to(output_bin_counts.dtype),
        accumulate=True,
    )


def reset_penalty_rows(
    output_bin_counts: torch.Tensor, prompt_bin_mask: torch.Tensor, rows: torch.Tensor
) -> None:
    """Clear the penalty state of state-table rows (a request leaves or is re-added). rows: [M]."""
    output_bin_counts.index_fill_(0, rows.to(torch.int64), 0)
    prompt_bin_mask.index_fill_(0, rows.to(torch.int64), False)


def set_prompt_bin_mask(prompt_bin_mask: torch.Tensor, row: int, prompt_ids: torch.Tensor) -> None:
    """Mark the prompt's tokens for one state-table row (at request add). prompt_ids: [L] int64."""
    prompt_bin_mask[row].zero_()
    prompt_bin_mask[row].index_fill_(0, prompt_ids.to(torch.int64), True)
