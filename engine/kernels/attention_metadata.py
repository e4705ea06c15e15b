"""Per-step attention metadata shared by the model runner and the attention kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AttentionMetadata"]


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each request's query tokens sit and where its KV lives.

    Device tensors are prepared on the device by the runner's input-prep kernel; the host ints come
    from the scheduler output and are never read back from the device.

    Requests are laid out back to back: request ``i`` owns query tokens
    ``query_start_loc[i] : query_start_loc[i + 1]`` whose positions are the last ``q_len`` of its
    ``seq_lens[i]`` context tokens (causal inside the request).
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32: context length after this step's tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = padding, write nothing
    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
