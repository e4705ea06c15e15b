"""Decode-attention kernel variants, for bench/bench_decode_variants.py (an experiment).

The engine's decode kernel (``engine.kernels.attention.paged_decode_attention_triton``) reads
the KV cache at ~4 TB/s at contexts of ~600 but at ~2 TB/s at 160 (bench/README.md, "Decode
attention tuning"): its time looks like a fixed ~40 µs per layer call plus the bytes. These
variants test where that fixed part comes from. Each computes what the engine's kernel computes
(one query token per request, ``GROUP`` query heads per KV head, paged KV, padding tokens get
zeros) and is checked against ``paged_attention_torch``:

- ``DOT``: scores and the weighted sum of V on tensor cores (``tl.dot``, rows padded to 16), as
  the engine's kernel; ``DOT`` off: on CUDA cores (broadcast multiply and sum over the
  ``GROUP`` real rows only, in float32; no shared-memory staging for the dot).
- ``SPLITS`` > 1: flash-decoding. Each (request, KV head) is cut into ``SPLITS`` segments of
  whole KV tiles, each its own program, writing its running max, denominator and accumulator;
  a second kernel combines them. More, shorter programs.
- persistent: ``programs`` programs in all, each walking a contiguous range of
  (request, KV head) items balanced by KV tiles (``bounds``, computed on the device once per
  batch: in the engine once per step for all layers). No per-item program start, no tail of a
  last wave.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from engine.kernels.attention_metadata import AttentionMetadata


@triton.jit
def _decode_item(
    q_ptr, k_ptr, v_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, qsl_ptr, seq_lens_ptr, block_table_ptr,
    i, kv_head, seg, num_kv_heads, scale_log2, q_stride_t, q_stride_h, bt_stride,
    kv_stride_slot, kv_stride_head,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr, SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Request ``i`` (a decode: one query token) at ``kv_head``, segment ``seg`` of ``SPLITS``:
    the final rows (``SPLITS == 1``) or the segment's (max, denominator, accumulator)."""
    tok = tl.load(qsl_ptr + i)
    is_decode = (tl.load(qsl_ptr + i + 1) - tok == 1).to(tl.int32)  # else: nothing to do
    seq_len = tl.load(seq_lens_ptr + i) * is_decode
    rows = tl.arange(0, ROWS)
    row_ok = rows < GROUP * is_decode
    head = kv_head * GROUP + rows
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_mask = row_ok[:, None] & d_ok[None, :]
    q_rows = tok.to(tl.int64) * q_stride_t + head * q_stride_h
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=q_mask, other=0.0)
    if not DOT:
        q = q.to(tl.float32)
    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    if SPLITS == 1:
        lo = 0
        hi = seq_len
    else:
        tiles = tl.cdiv(seq_len, BLOCK_N)
        per = tl.cdiv(tiles, SPLITS)
        lo = seg * per * BLOCK_N
        hi = tl.minimum(seq_len, lo + per * BLOCK_N)
    bt_row = block_table_ptr + i.to(tl.int64) * bt_stride
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        block_ids = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
        slots = block_ids.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
        kv_off = slots[:, None] * kv_stride_slot + kv_head * kv_stride_head + offs_d[None, :]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if DOT:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        else:
            s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale_log2
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if SPLITS == 1:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + q_rows[:, None] + offs_d[None, :], out, mask=q_mask)
    else:
        part = (i.to(tl.int64) * num_kv_heads + kv_head) * SPLITS + seg
        tl.store(m_ptr + part * ROWS + rows, m_i)
        tl.store(l_ptr + part * ROWS + rows, l_i)
        acc_off = (part * ROWS + rows)[:, None] * BLOCK_D + offs_d[None, :]
        tl.store(acc_ptr + acc_off, acc)


@triton.jit
def _zero_padding(
    out_ptr, qsl_ptr, i, kv_head, num_reqs, num_tokens, q_stride_t, q_stride_h,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Token ``i`` past the last request's (a padding token): zeros for ``kv_head``'s heads."""
    total = tl.load(qsl_ptr + num_reqs)
    if (i >= total) & (i < num_tokens):
        rows = tl.arange(0, ROWS)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (rows < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
        pad = i.to(tl.int64) * q_stride_t + (kv_head * GROUP + rows) * q_stride_h
        zeros = tl.zeros([ROWS, BLOCK_D], dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + pad[:, None] + offs_d[None, :], zeros, mask=mask)


@triton.jit
def _decode_grid_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, qsl_ptr, seq_lens_ptr, block_table_ptr,
    num_reqs, num_tokens, num_kv_heads, scale_log2, q_stride_t, q_stride_h, bt_stride,
    kv_stride_slot, kv_stride_head,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr, SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid ``[num_kv_heads, max(num_tokens, num_reqs), SPLITS]``: one program per (KV head,
    request, segment)."""
    kv_head = tl.program_id(0)
    i = tl.program_id(1)
    seg = tl.program_id(2)
    if SPLITS == 1:
        _zero_padding(out_ptr, qsl_ptr, i, kv_head, num_reqs, num_tokens, q_stride_t,
                      q_stride_h, HEAD_DIM, GROUP, ROWS, BLOCK_D)  # fmt: skip
    if i < num_reqs:
        _decode_item(
            q_ptr, k_ptr, v_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, qsl_ptr, seq_lens_ptr,
            block_table_ptr, i, kv_head, seg, num_kv_heads, scale_log2, q_stride_t, q_stride_h,
            bt_stride, kv_stride_slot, kv_stride_head, BLOCK_SIZE, HEAD_DIM, GROUP, ROWS,
            BLOCK_N, BLOCK_D, DOT, SPLITS, DOT_PRECISION,
        )  # fmt: skip


@triton.jit
def _combine_kernel(
    out_ptr, m_ptr, l_ptr, acc_ptr, qsl_ptr, num_reqs, num_tokens, num_kv_heads, q_stride_t,
    q_stride_h,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr,
):  # fmt: skip
    """Grid ``[num_kv_heads, max(num_tokens, num_reqs)]``: the ``SPLITS`` segments' partial
    results of (request, KV head) combined into its rows (zeros for padding tokens)."""
    kv_head = tl.program_id(0)
    i = tl.program_id(1)
    _zero_padding(out_ptr, qsl_ptr, i, kv_head, num_reqs, num_tokens, q_stride_t, q_stride_h,
                  HEAD_DIM, GROUP, ROWS, BLOCK_D)  # fmt: skip
    if i < num_reqs:
        tok = tl.load(qsl_ptr + i)
        if tl.load(qsl_ptr + i + 1) - tok == 1:
            rows = tl.arange(0, ROWS)
            offs_d = tl.arange(0, BLOCK_D)
            splits = tl.arange(0, SPLITS)
            part = (i.to(tl.int64) * num_kv_heads + kv_head) * SPLITS + splits  # [SPLITS]
            ml = part[:, None] * ROWS + rows[None, :]  # [SPLITS, ROWS]
            m = tl.load(m_ptr + ml)
            l_part = tl.load(l_ptr + ml)
            m_max = tl.max(m, axis=0)  # [ROWS]
            w = tl.exp2(m - m_max[None, :])  # [SPLITS, ROWS]
            denom = tl.sum(l_part * w, axis=0)
            acc = tl.load(acc_ptr + ml[:, :, None] * BLOCK_D + offs_d[None, None, :])
            num = tl.sum(acc * w[:, :, None], axis=0)  # [ROWS, BLOCK_D]
            denom = tl.where(denom > 0.0, denom, 1.0)
            out = (num / denom[:, None]).to(out_ptr.dtype.element_ty)
            mask = (rows < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
            dst = tok.to(tl.int64) * q_stride_t + (kv_head * GROUP + rows) * q_stride_h
            tl.store(out_ptr + dst[:, None] + offs_d[None, :], out, mask=mask)


@triton.jit
def _decode_persistent_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, qsl_ptr, seq_lens_ptr, block_table_ptr, bounds_ptr,
    num_reqs, num_tokens, num_kv_heads, scale_log2, q_stride_t, q_stride_h, bt_stride,
    kv_stride_slot, kv_stride_head,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid ``[P]``: program ``p`` runs items ``bounds[p] .. bounds[p + 1]`` (item = request *
    num_kv_heads + KV head; padding tokens are items past ``num_reqs * num_kv_heads``)."""
    p = tl.program_id(0)
    first = tl.load(bounds_ptr + p)
    last = tl.load(bounds_ptr + p + 1)
    for item in range(first, last):
        i = item // num_kv_heads
        kv_head = item % num_kv_heads
        _zero_padding(out_ptr, qsl_ptr, i, kv_head, num_reqs, num_tokens, q_stride_t,
                      q_stride_h, HEAD_DIM, GROUP, ROWS, BLOCK_D)  # fmt: skip
        if i < num_reqs:
            _decode_item(
                q_ptr, k_ptr, v_ptr, out_ptr, out_ptr, out_ptr, out_ptr, qsl_ptr, seq_lens_ptr,
                block_table_ptr, i, kv_head, 0, num_kv_heads, scale_log2, q_stride_t,
                q_stride_h, bt_stride, kv_stride_slot, kv_stride_head, BLOCK_SIZE, HEAD_DIM,
                GROUP, ROWS, BLOCK_N, BLOCK_D, DOT, 1, DOT_PRECISION,
            )  # fmt: skip


def item_bounds(
    attn_metadata: AttentionMetadata, num_kv_heads: int, num_items: int, programs: int,
    block_n: int, item_cost_tiles: int = 1,
) -> torch.Tensor:  # fmt: skip
    """``[programs + 1]`` int32 item boundaries, on the device: items (request-major, KV head
    inner; ``num_items`` of them, padding items past the requests) cost their KV tiles plus
    ``item_cost_tiles``; program ``p`` takes the items whose cost prefix starts in its
    ``1 / programs`` share of the total."""
    num_reqs = attn_metadata.query_start_loc.shape[0] - 1
    device = attn_metadata.seq_lens.device
    tiles = (attn_metadata.seq_lens[:num_reqs].long() + block_n - 1) // block_n + item_cost_tiles
    cost = torch.full((num_items,), item_cost_tiles, dtype=torch.long, device=device)
    cost[: num_reqs * num_kv_heads] = tiles.repeat_interleave(num_kv_heads)
    ends = torch.cumsum(cost, 0)
    starts = ends - cost
    targets = torch.arange(programs + 1, device=device) * ends[-1] // programs
    bounds = torch.searchsorted(starts, targets)  # first item starting at or past the target
    bounds[-1] = num_items
    return bounds.to(torch.int32)


def decode_variant(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    *,
    block_n: int,
    num_warps: int,
    num_stages: int,
    dot: bool,
    splits: int = 1,
    programs: int = 0,
    bounds: torch.Tensor | None = None,
    scratch: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[Any]]:
    """``(out [T, Hq, D], compiled kernels)`` of one variant; ``programs`` > 0 runs the
    persistent kernel over ``bounds`` (from :func:`item_bounds`), else the grid kernel with
    ``splits`` segments (``scratch``: reusable partial-result buffers, for CUDA graphs)."""
    q = q.contiguous()
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    num_reqs = md.query_start_loc.shape[0] - 1
    rows = max(16, triton.next_power_of_2(group)) if dot else triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    out = torch.empty_like(q)
    common = dict(
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, GROUP=group, ROWS=rows, BLOCK_N=block_n,
        BLOCK_D=block_d, DOT=dot, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    strides = (q.stride(0), q.stride(1), md.block_table.stride(0), kv_cache.stride(2),
               kv_cache.stride(3))  # fmt: skip
    width = max(num_tokens, num_reqs)
    scale_log2 = scale * 1.4426950408889634
    if programs:
        if bounds is None:
            bounds = item_bounds(md, num_kv_heads, width * num_kv_heads, programs, block_n)
        k = _decode_persistent_kernel[(programs,)](
            q, kv_cache[0], kv_cache[1], out, md.query_start_loc, md.seq_lens, md.block_table,
            bounds, num_reqs, num_tokens, num_kv_heads, scale_log2, *strides, **common,
        )  # fmt: skip
        return out, [k]
    m = l_part = acc = out
    if splits > 1:
        n = width * num_kv_heads * splits * rows
        if scratch is None or scratch["m"].numel() < n:
            scratch = {"m": torch.empty(n, device=q.device, dtype=torch.float32),
                       "l": torch.empty(n, device=q.device, dtype=torch.float32),
                       "acc": torch.empty(n * block_d, device=q.device, dtype=torch.float32)}  # fmt: skip
        m, l_part, acc = scratch["m"], scratch["l"], scratch["acc"]
    k1 = _decode_grid_kernel[(num_kv_heads, width, splits)](
        q, kv_cache[0], kv_cache[1], out, m, l_part, acc, md.query_start_loc, md.seq_lens,
        md.block_table, num_reqs, num_tokens, num_kv_heads, scale_log2, *strides,
        SPLITS=splits, **common,
    )  # fmt: skip
    if splits == 1:
        return out, [k1]
    k2 = _combine_kernel[(num_kv_heads, width)](
        out, m, l_part, acc, md.query_start_loc, num_reqs, num_tokens, num_kv_heads,
        q.stride(0), q.stride(1), HEAD_DIM=head_dim, GROUP=group, ROWS=rows, BLOCK_D=block_d,
        SPLITS=splits, num_warps=4,
    )  # fmt: skip
    return out, [k1, k2]
