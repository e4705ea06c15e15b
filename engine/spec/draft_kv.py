"""The paged KV layout of a proposer with its own attention (draft model, EAGLE head, MTP module).

The proposer's cache mirrors the target's: block ``i`` of the proposer cache holds the same
positions of the same request as block ``i`` of the target cache, so the target's block table,
slot mapping and prefix-cache hits apply unchanged to the proposer's query pass.

The draft chain runs ahead of what the scheduler allocated: it writes KV at positions up to
``P + k - 1`` while a request holds blocks only up to the end of step N. Each state row therefore
owns ``lookahead_blocks`` private blocks after the shared ones; a chain position inside the
request's allocated blocks uses the real block (the next query pass rewrites it), a position past
them uses the row's lookahead block. No chain write ever lands in another request's block.
"""

from __future__ import annotations

import torch

from engine.kernels.attention_metadata import AttentionMetadata
from engine.spec.proposer import ProposeInputs

__all__ = ["LookaheadKV"]


class LookaheadKV:
    """Block-table arithmetic for chain steps; owns no tensors besides what it returns."""

    def __init__(
        self, num_blocks: int, block_size: int, max_num_reqs: int, num_spec_tokens: int
    ) -> None:
        if min(num_blocks, block_size, max_num_reqs, num_spec_tokens) <= 0:
            raise ValueError("LookaheadKV sizes must be positive")
        self.num_shared_blocks = num_blocks
        self.block_size = block_size
        self.num_spec_tokens = num_spec_tokens
        self.lookahead_blocks = -(-num_spec_tokens // block_size) + 1
        # one set per state row, the trash row included
        self.num_blocks = num_blocks + (max_num_reqs + 1) * self.lookahead_blocks

    # stepscope: hot
    def chain_block_table(self, inputs: ProposeInputs) -> torch.Tensor:
        """``[B, W + lookahead]`` int32: real blocks, then the row's private lookahead blocks."""
        real = inputs.block_table[: inputs.num_reqs]  # [B, W]
        width = real.shape[1] + self.lookahead_blocks
        j = torch.arange(width, device=real.device)  # [W']
        held = inputs.num_blocks[: inputs.num_reqs].long()[:, None]  # [B, 1]
        padded = torch.nn.functional.pad(real, (0, self.lookahead_blocks))
        extra = (j[None, :] - held).clamp(0, self.lookahead_blocks - 1)
        lookahead = self.num_shared_blocks + inputs.rows[:, None] * self.lookahead_blocks + extra
        return torch.where(j[None, :] < held, padded.long(), lookahead).to(torch.int32)

    # stepscope: hot
    def chain_metadata(
        self, inputs: ProposeInputs, table: torch.Tensor, positions: torch.Tensor
    ) -> AttentionMetadata:
        """One query token per request at ``positions: [B]`` (already clamped), seq = pos + 1."""
        b, bs = inputs.num_reqs, self.block_size
        pages = table.gather(1, (positions // bs)[:, None]).squeeze(1).long()
        return AttentionMetadata(
            query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=table.device),
            seq_lens=(positions + 1).to(torch.int32),
            block_table=table,
            slot_mapping=pages * bs + positions % bs,
            num_reqs=b,
            num_tokens=b,
            max_query_len=1,
            max_seq_len=min(inputs.max_seq_len + self.num_spec_tokens + 1, inputs.max_model_len),
        )

    @staticmethod
    # stepscope: hot
    def chain_positions(inputs: ProposeInputs, offset: int) -> torch.Tensor:
        """``bonus_pos + offset`` clamped inside the model: [B] int64."""
        return (inputs.bonus_pos + offset).clamp(max=inputs.max_model_len - 1)
