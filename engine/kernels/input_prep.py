"""Per-step model inputs gathered on the device from the request state table.

Batch position ``b`` runs request row ``r = idx_mapping[b]``, whose query tokens are
``query_start_loc[b] : query_start_loc[b + 1]``. With ``nc = num_computed[r]`` (tokens whose KV is
already written) token ``t`` of that range sits at position ``p = nc + (t - query_start_loc[b])``:

* ``input_ids[t]`` = ``token_ids[r, p]`` (prompt / resumed tokens, or drafts staged there), except
  for the first query token of a request past its prefill (``p >= prefill_len[r]``), which is
  ``last_sampled[r]``: the token the previous step sampled, read on the device, never via the host;
* ``positions[t] = p``; ``slot_mapping[t] = block_table[r, p // bs] * bs + p % bs``;
* ``seq_lens[b] = nc + q_len``;
* logits rows ``cu_num_logits[b] : cu_num_logits[b + 1]`` index the last ``num_logits_b`` query
  tokens of the request (1 normally; 1 + drafts when verifying speculative tokens).

Then ``num_computed[r] += q_len``: the device advances its own frontier, so steady decode needs no
host write. Entries past the live batch (CUDA-graph padding) get id 0, position 0, slot -1, and
padded requests ``seq_len`` 0. With ``attn_block_table`` given, row ``b < num_padded_reqs`` of it
becomes ``block_table[idx_mapping[b]]`` (the trash row's for padded requests): the attention's
per-batch block table. The Triton version does all of it in one launch (docs/design.md §2.6).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine runs without triton; only the torch path is available
    triton = None
    tl = None

__all__ = [
    "InputPrepArgs",
    "fill_padding",
    "gather_block_table",
    "prepare_inputs_torch",
    "prepare_inputs_triton",
]

HAS_TRITON = triton is not None


@dataclass(frozen=True)
class InputPrepArgs:
    """Device tensors in, persistent device buffers out, host ints from the scheduler."""

    # per-step inputs
    idx_mapping: torch.Tensor  # [>= num_reqs] int32: batch position -> state row
    query_start_loc: torch.Tensor  # [>= num_reqs + 1] int32
    cu_num_logits: torch.Tensor  # [>= num_reqs + 1] int32
    # state table (num_computed is advanced in place)
    num_computed: torch.Tensor  # [max_num_reqs] int32
    prefill_len: torch.Tensor  # [max_num_reqs] int32
    token_ids: torch.Tensor  # [max_num_reqs, max_model_len] int64
    last_sampled: torch.Tensor  # [max_num_reqs] int64
    block_table: torch.Tensor  # [max_num_reqs, max_blocks_per_req] int32
    # outputs, written in place
    input_ids: torch.Tensor  # [>= num_padded_tokens] int64
    positions: torch.Tensor  # [>= num_padded_tokens] int64
    slot_mapping: torch.Tensor  # [>= num_padded_tokens] int64
    seq_lens: torch.Tensor  # [>= num_padded_reqs] int32
    logits_indices: torch.Tensor  # [>= num_logits] int64
    # host ints
    block_size: int
    num_reqs: int
    num_tokens: int
    num_logits: int
    max_query_len: int
    num_padded_tokens: int
    num_padded_reqs: int
    # [>= num_padded_reqs, max_blocks] int32 out: block_table rows gathered by idx_mapping
    attn_block_table: torch.Tensor | None = None


# stepscope: hot
def prepare_inputs_torch(a: InputPrepArgs) -> None:
    """Reference: the same gather written as whole-batch torch ops (no host reads)."""
    b, t, n = a.num_reqs, a.num_tokens, a.num_logits
    dev = a.input_ids.device
    rows = a.idx_mapping[:b].long()  # [B]
    q_start = a.query_start_loc[:b].long()  # [B]
    q_end = a.query_start_loc[1 : b + 1].long()  # [B]
    nc = a.num_computed[rows].long()  # [B]
    tok = torch.arange(t, device=dev)  # [T]
    req = torch.searchsorted(q_end, tok, right=True)  # [T] batch position of each token
    row_t = rows[req]
    pos = nc[req] + tok - q_start[req]  # [T]
    from_table = a.token_ids[row_t, pos.clamp(max=a.token_ids.shape[1] - 1)]
    use_last = (pos >= a.prefill_len[row_t]) & (tok == q_start[req])
    a.input_ids[:t] = torch.where(use_last, a.last_sampled[row_t], from_table)
    a.positions[:t] = pos
    block = a.block_table[row_t, pos // a.block_size].long()
    a.slot_mapping[:t] = block * a.block_size + pos % a.block_size
    a.seq_lens[:b] = (nc + q_end - q_start).to(torch.int32)
    cu = a.cu_num_logits[: b + 1].long()  # [B + 1]
    j = torch.arange(n, device=dev)  # [N]
    req_l = torch.searchsorted(cu[1:], j, right=True)  # [N]
    a.logits_indices[:n] = q_end[req_l] - (cu[req_l + 1] - cu[req_l]) + (j - cu[req_l])
    a.num_computed[rows] = (nc + q_end - q_start).to(torch.int32)


@functools.cache
def _build_kernel() -> Any:
    """Define the kernel on first use, so TRITON_INTERPRET set by then is honoured."""

    @triton.jit(do_not_specialize=["num_reqs", "num_tokens", "num_padded_tokens"])
    def _prepare_inputs_kernel(
        idx_mapping_ptr,
        qsl_ptr,
        cu_logits_ptr,
        num_computed_ptr,
        prefill_len_ptr,
        token_ids_ptr,
        token_ids_stride,
        last_sampled_ptr,
        block_table_ptr,
        block_table_stride,
        input_ids_ptr,
        positions_ptr,
        slot_mapping_ptr,
        seq_lens_ptr,
        logits_indices_ptr,
        attn_block_table_ptr,
        attn_block_table_stride,
        num_block_cols,
        block_size,
        max_model_len,
        num_reqs,
        num_tokens,
        num_padded_tokens,
        BLOCK: tl.constexpr,
        BLOCK_COLS: tl.constexpr,
        GATHER_BLOCK_TABLE: tl.constexpr,
    ):
        # Programs 0..num_padded_reqs-1: one batch position each; the last one: token padding.
        b = tl.program_id(0)
        if b == tl.num_programs(0) - 1:
            for off in range(num_tokens, num_padded_tokens, BLOCK):
                i = off + tl.arange(0, BLOCK)
                mask = i < num_padded_tokens
                tl.store(input_ids_ptr + i, tl.zeros((BLOCK,), tl.int64), mask=mask)
                tl.store(positions_ptr + i, tl.zeros((BLOCK,), tl.int64), mask=mask)
                tl.store(slot_mapping_ptr + i, tl.full((BLOCK,), -1, tl.int64), mask=mask)
            return
        row = tl.load(idx_mapping_ptr + b).to(tl.int64)
        if GATHER_BLOCK_TABLE:
            for off in range(0, num_block_cols, BLOCK_COLS):
                c = off + tl.arange(0, BLOCK_COLS)
                cols = c < num_block_cols
                blocks = tl.load(block_table_ptr + row * block_table_stride + c, mask=cols)
                tl.store(attn_block_table_ptr + b * attn_block_table_stride + c, blocks, mask=cols)
        if b >= num_reqs:  # a padded request: no tokens
            tl.store(seq_lens_ptr + b, 0)
            return
        q_start = tl.load(qsl_ptr + b).to(tl.int64)
        q_end = tl.load(qsl_ptr + b + 1).to(tl.int64)
        nc = tl.load(num_computed_ptr + row).to(tl.int64)
        plen = tl.load(prefill_len_ptr + row).to(tl.int64)
        last = tl.load(last_sampled_ptr + row)
        for off in range(0, q_end - q_start, BLOCK):
            i = off + tl.arange(0, BLOCK)
            mask = i < q_end - q_start
            pos = nc + i
            safe_pos = tl.minimum(pos, max_model_len - 1)
            ids = tl.load(token_ids_ptr + row * token_ids_stride + safe_pos, mask=mask, other=0)
            ids = tl.where((pos >= plen) & (i == 0), last, ids)
            block = tl.load(
                block_table_ptr + row * block_table_stride + pos // block_size, mask=mask, other=0
            ).to(tl.int64)
            tl.store(input_ids_ptr + q_start + i, ids, mask=mask)
            tl.store(positions_ptr + q_start + i, pos, mask=mask)
            tl.store(
                slot_mapping_ptr + q_start + i, block * block_size + pos % block_size, mask=mask
            )
        new_nc = nc + q_end - q_start
        tl.store(seq_lens_ptr + b, new_nc.to(tl.int32))
        l_start = tl.load(cu_logits_ptr + b).to(tl.int64)
        l_end = tl.load(cu_logits_ptr + b + 1).to(tl.int64)
        for off in range(0, l_end - l_start, BLOCK):
            j = off + tl.arange(0, BLOCK)
            tl.store(
                logits_indices_ptr + l_start + j,
                q_end - (l_end - l_start) + j,
                mask=j < l_end - l_start,
            )
        tl.store(num_computed_ptr + row, new_nc.to(tl.int32))

    return _prepare_inputs_kernel


# stepscope: hot
def prepare_inputs_triton(a: InputPrepArgs) -> None:
    """One launch: a program per (padded) request, looping over its query tokens in blocks (and
    copying its block-table row), plus one program for the padding tokens."""
    if triton is None:
        raise RuntimeError("prepare_inputs_triton needs triton, which is not installed")
    if a.num_padded_reqs == 0 and a.num_padded_tokens == 0:
        return
    block = max(16, min(1024, triton.next_power_of_2(max(a.max_query_len, 1))))
    table = a.attn_block_table
    num_cols = a.block_table.shape[1]
    _build_kernel()[(a.num_padded_reqs + 1,)](
        a.idx_mapping,
        a.query_start_loc,
        a.cu_num_logits,
        a.num_computed,
        a.prefill_len,
        a.token_ids,
        a.token_ids.stride(0),
        a.last_sampled,
        a.block_table,
        a.block_table.stride(0),
        a.input_ids,
        a.positions,
        a.slot_mapping,
        a.seq_lens,
        a.logits_indices,
        a.block_table if table is None else table,  # unread without a table
        a.block_table.stride(0) if table is None else table.stride(0),
        num_cols,
        a.block_size,
        a.token_ids.shape[1],
        a.num_reqs,
        a.num_tokens,
        a.num_padded_tokens,
        BLOCK=block,
        BLOCK_COLS=max(16, min(1024, triton.next_power_of_2(num_cols))),
        GATHER_BLOCK_TABLE=table is not None,
    )


# stepscope: hot
def gather_block_table(a: InputPrepArgs) -> None:
    """``attn_block_table[:num_padded_reqs] = block_table[idx_mapping]`` (when given)."""
    if a.attn_block_table is not None and a.num_padded_reqs > 0:
        bp = a.num_padded_reqs
        rows = a.idx_mapping[:bp].long()
        torch.index_select(a.block_table, 0, rows, out=a.attn_block_table[:bp])


# stepscope: hot
def fill_padding(a: InputPrepArgs) -> None:
    """Padding past the step's tokens and requests (a CUDA graph's padded batch): id 0,
    position 0, slot -1 (write nothing), seq_len 0."""
    t, tp = a.num_tokens, a.num_padded_tokens
    if tp > t:
        a.input_ids[t:tp].zero_()
        a.positions[t:tp].zero_()
        a.slot_mapping[t:tp].fill_(-1)
    if a.num_padded_reqs > a.num_reqs:
        a.seq_lens[a.num_reqs : a.num_padded_reqs].zero_()
