"""Host-side construction of one step's AttentionMetadata, for tests and benchmarks.

The engine's runner prepares these tensors on the device; this builder is the plain, obviously
correct version used to drive the model directly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kernels.attention_metadata import AttentionMetadata

__all__ = ["build_attention_metadata"]


def build_attention_metadata(
    num_computed_tokens: Sequence[int],
    num_new_tokens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str,
    num_padded_tokens: int | None = None,
    num_padded_reqs: int | None = None,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and ``positions: [T]`` int64 for requests advancing by ``num_new_tokens``.

    Request ``i`` has ``num_computed_tokens[i]`` tokens already in its KV blocks
    ``block_tables[i]`` and computes ``num_new_tokens[i]`` more this step. Padding tokens (up to
    ``num_padded_tokens``) get slot -1 and position 0; padded requests (up to
    ``num_padded_reqs``) get query_len 0, seq_len 0 and an all-zero block-table row.
    """
    num_reqs = len(num_new_tokens)
    if not (len(num_computed_tokens) == len(block_tables) == num_reqs):
        raise ValueError("num_computed_tokens, num_new_tokens, block_tables differ in length")
    positions: list[int] = []
    slots: list[int] = []
    for computed, new, blocks in zip(
        num_computed_tokens, num_new_tokens, block_tables, strict=True
    ):
        if computed + new > len(blocks) * block_size:
            raise ValueError(f"{computed + new} tokens do not fit in {len(blocks)} blocks")
        for pos in range(computed, computed + new):
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    num_tokens = max(num_padded_tokens or 0, len(positions))
    total_reqs = max(num_padded_reqs or 0, num_reqs)
    pad_tokens, pad_reqs = num_tokens - len(positions), total_reqs - num_reqs
    positions += [0] * pad_tokens
    slots += [-1] * pad_tokens
    seq_lens = [c + n for c, n in zip(num_computed_tokens, num_new_tokens, strict=True)] + [
        0
    ] * pad_reqs
    query_start_loc = [0]
    for new in list(num_new_tokens) + [0] * pad_reqs:
        query_start_loc.append(query_start_loc[-1] + new)
    width = max([len(b) for b in block_tables] + [1])
    table = [list(b) + [0] * (width - len(b)) for b in block_tables] + [[0] * width] * pad_reqs
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.tensor(table, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_reqs=total_reqs,
        num_tokens=num_tokens,
        max_query_len=max(list(num_new_tokens) + [0]),
        max_seq_len=max(seq_lens + [0]),
    )
    return metadata, torch.tensor(positions, dtype=torch.int64, device=device)
