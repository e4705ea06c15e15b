"""Paged attention for varlen queries over a paged KV cache (decode, prefill, chunked, verify).

Request ``i`` owns query tokens ``query_start_loc[i] : query_start_loc[i + 1]`` (``q_len_i``
of them). Query token ``j`` sits at position ``seq_lens[i] - q_len_i + j`` and attends to KV
positions ``<=`` its own (causal inside the request). KV position ``p`` of request ``i`` lives at
flat slot ``block_table[i, p // block_size] * block_size + p % block_size`` of
``kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]``. GQA maps query head ``h`` to
KV head ``h // (num_heads // num_kv_heads)``. Tokens past ``query_start_loc[-1]`` (padding)
get zeros.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from engine.kernels.attention_metadata import AttentionMetadata

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine runs on the torch path without triton
    triton = None
    tl = None

__all__ = [
    "paged_attention_torch",
    "paged_attention_triton",
    "paged_decode_attention_triton",
    "paged_varlen_attention_triton",
]


# stepscope: hot
def paged_attention_torch(
    q: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Reference in fp32, vectorised over requests (no host reads of device tensors).

    Queries are gathered into a padded ``[R, max_query_len]`` grid and each request's KV into
    ``[R, max_seq_len]``; both bounds are host ints from the scheduler.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    md = attn_metadata
    num_reqs = md.query_start_loc.shape[0] - 1
    max_q, max_s = max(md.max_query_len, 1), max(md.max_seq_len, 1)
    device = q.device
    starts = md.query_start_loc.long()  # [R + 1]
    q_lens = starts[1:] - starts[:-1]  # [R]
    ctx_lens = md.seq_lens.long() - q_lens  # [R]: tokens before this step's queries

    # q_pad: [R, max_q, Hq, D], gathered from the flat token axis
    j = torch.arange(max_q, device=device)
    tok = (starts[:-1, None] + j).clamp(max=max(num_tokens - 1, 0))  # [R, max_q]
    q_valid = j[None, :] < q_lens[:, None]  # [R, max_q]
    q_pad = q[tok].float() * q_valid[:, :, None, None]

    # k, v: [R, max_s, Hkv, D], gathered through the block table
    kv_pos = torch.arange(max_s, device=device)
    page = (kv_pos // block_size).clamp(max=md.block_table.shape[1] - 1)
    slots = md.block_table[:, page].long() * block_size + kv_pos % block_size  # [R, max_s]
    k = kv_cache[0].reshape(-1, num_kv_heads, head_dim)[slots].float()
    v = kv_cache[1].reshape(-1, num_kv_heads, head_dim)[slots].float()

    # scores: [R, Hkv, group, max_q, max_s]
    q_grp = q_pad.view(num_reqs, max_q, num_kv_heads, group, head_dim)
    scores = torch.einsum("rqhgd,rshd->rhgqs", q_grp, k) * scale
    q_pos = ctx_lens[:, None] + j[None, :]  # [R, max_q]
    allowed = kv_pos[None, None, :] <= q_pos[:, :, None]  # [R, max_q, max_s]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out_pad = torch.einsum("rhgqs,rshd->rqhgd", probs, v)  # [R, max_q, Hkv, group, D]
    out_pad = out_pad.reshape(num_reqs, max_q, num_heads, head_dim)

    # back to the flat token axis; padding tokens (past the last request) get zeros
    t = torch.arange(num_tokens, device=device)
    req = torch.searchsorted(starts[1:], t, right=True)  # [T]; == R for padding
    tok_valid = req < num_reqs
    req_c = req.clamp(max=max(num_reqs - 1, 0))
    local = (t - starts[req_c]).clamp(0, max_q - 1)
    out = out_pad[req_c, local] * tok_valid[:, None, None]
    return out.to(q.dtype)  # [T, Hq, D]


def _softmax_tile_src(
    q, k, v, allowed, m_i, l_i, acc, scale_log2, DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr
):  # fmt: skip
    """One KV tile of the online softmax, in base 2: scores ``q kᵀ`` (scaled by
    ``scale_log2``), where ``allowed`` when ``MASKED`` (else every score counts), then the
    running max ``m_i``, the running denominator ``l_i`` and the accumulator ``acc`` updated
    with this tile. Returns the three."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


def _attend_rows_src(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_row_ptr, q_start, q_len, first_q, ctx_len, seq_len, kv_head,
    scale_log2, q_stride_t, q_stride_h, kv_stride_slot, kv_stride_head,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Attention of one request's query tokens ``first_q .. first_q + BLOCK_Q`` (local
    indices; rows past ``q_len`` are computed on zeros and never stored) for the ``GROUP`` query
    heads of ``kv_head``: rows are token-major, ``BLOCK_Q * GROUP <= BLOCK_M`` of them.

    KV tiles below ``ctx_len + first_q + 1`` (the first row's position) are visible to every
    row and run unmasked; only the tiles from there to the last row's position (the diagonal)
    carry the causal mask."""
    rows = tl.arange(0, BLOCK_M)
    q_local = first_q + rows // GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_local < q_len)
    head = kv_head * GROUP + rows % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_rows = (q_start + q_local).to(tl.int64) * q_stride_t + head * q_stride_h
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=q_mask, other=0.0)
    q_pos = ctx_len + q_local  # [BLOCK_M]
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    kv_col = kv_head * kv_stride_head + offs_d  # [BLOCK_D]
    # Full tiles: every key < full_end is at or before the first row's position.
    full_end = (ctx_len + first_q + 1) // BLOCK_N * BLOCK_N
    for start in range(0, full_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        block_ids = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE)
        slots = block_ids.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
        kv_off = slots[:, None] * kv_stride_slot + kv_col[None, :]
        if BLOCK_D == HEAD_DIM:
            k = tl.load(k_ptr + kv_off)  # [BLOCK_N, BLOCK_D]
            v = tl.load(v_ptr + kv_off)
        else:
            k = tl.load(k_ptr + kv_off, mask=d_ok[None, :], other=0.0)
            v = tl.load(v_ptr + kv_off, mask=d_ok[None, :], other=0.0)
        m_i, l_i, acc = _softmax_tile(
            q, k, v, row_ok[:, None], m_i, l_i, acc, scale_log2, DOT_PRECISION, False
        )
    # Diagonal tiles: up to the last row's position (or the request's end).
    kv_end = tl.minimum(seq_len, ctx_len + first_q + BLOCK_Q)
    for start in range(full_end, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        block_ids = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
        slots = block_ids.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
        kv_off = slots[:, None] * kv_stride_slot + kv_col[None, :]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        allowed = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        m_i, l_i, acc = _softmax_tile(
            q, k, v, allowed, m_i, l_i, acc, scale_log2, DOT_PRECISION, True
        )
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(
        out_ptr + q_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask
    )


# The kernels call these helpers by name; _jit() binds them (compiled or interpreted, as the
# kernels are) before the first kernel is built.
_softmax_tile: Any = None
_attend_rows: Any = None


def _jit(src: Any, **kwargs: Any) -> Any:
    """``triton.jit(src)``, with the shared helpers bound first (same mode as the kernel)."""
    global _softmax_tile, _attend_rows
    if _softmax_tile is None:
        _softmax_tile = triton.jit(_softmax_tile_src)
        _attend_rows = triton.jit(_attend_rows_src)
    return triton.jit(src, **kwargs)


def _paged_attention_kernel_src(
    q_ptr, k_ptr, v_ptr, out_ptr, qsl_ptr, seq_lens_ptr, block_table_ptr,
    num_reqs, num_tokens, scale_log2, q_stride_t, q_stride_h, bt_stride, kv_stride_slot,
    kv_stride_head,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SMALL_M: tl.constexpr, SMALL_Q: tl.constexpr, SMALL_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, REVERSE: tl.constexpr,
    HEAD_MAJOR: tl.constexpr, SKIP_SINGLE: tl.constexpr,
):  # fmt: skip
    """Grid ``[num_tokens // BLOCK_Q + num_reqs + 1, num_kv_heads]`` (transposed when
    HEAD_MAJOR). Request ``i`` owns the q
    blocks ``qsl[i] // BLOCK_Q + i ..`` (one per BLOCK_Q of its tokens, plus one to spare);
    "request" ``num_reqs`` (the padding tokens ``qsl[num_reqs] .. num_tokens``) owns the rest
    and writes zeros. Requests of at most ``SMALL_Q`` tokens (decodes, short verifies) run in
    one program with ``SMALL_M``-row tiles; the rest in ``BLOCK_M``-row tiles. REVERSE: the
    last q blocks (the longest KV walks of a causal prompt) start first. SKIP_SINGLE: requests of
    one query token are left to the decode kernel (``split_decodes``)."""
    if HEAD_MAJOR:  # grid transposed: the KV heads of one q block are neighbouring programs
        kv_head = tl.program_id(0)
        q_block = tl.program_id(1)
        num_q_blocks = tl.num_programs(1)
    else:
        q_block = tl.program_id(0)
        kv_head = tl.program_id(1)
        num_q_blocks = tl.num_programs(0)
    if REVERSE:
        q_block = num_q_blocks - 1 - q_block
    # Request owning this q block: the last i with qsl[i] // BLOCK_Q + i <= q_block.
    lo = num_reqs * 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid
        else:
            hi = mid - 1
    req = lo
    q_start = tl.load(qsl_ptr + req)
    first_q = (q_block - (q_start // BLOCK_Q + req)) * BLOCK_Q  # local index of row 0
    if req == num_reqs:  # padding tokens: zeros (the output starts uninitialised)
        rows = tl.arange(0, BLOCK_M)
        tok = q_start + first_q + rows // GROUP
        pad_ok = (rows < BLOCK_Q * GROUP) & (tok < num_tokens)
        head = kv_head * GROUP + rows % GROUP
        offs_d = tl.arange(0, BLOCK_D)
        pad_rows = tok.to(tl.int64) * q_stride_t + head * q_stride_h
        zeros = tl.zeros([BLOCK_M, BLOCK_D], dtype=out_ptr.dtype.element_ty)
        pad_mask = pad_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
        tl.store(out_ptr + pad_rows[:, None] + offs_d[None, :], zeros, mask=pad_mask)
    else:
        q_len = tl.load(qsl_ptr + req + 1) - q_start
        run = first_q < q_len
        if SKIP_SINGLE:
            run = run & (q_len != 1)
        if run:
            seq_len = tl.load(seq_lens_ptr + req)
            ctx_len = seq_len - q_len
            bt_row = block_table_ptr + req.to(tl.int64) * bt_stride
            if q_len <= SMALL_Q:  # first_q == 0: the whole request in one small tile
                _attend_rows(
                    q_ptr, k_ptr, v_ptr, out_ptr, bt_row, q_start, q_len, first_q, ctx_len,
                    seq_len, kv_head, scale_log2, q_stride_t, q_stride_h, kv_stride_slot,
                    kv_stride_head, BLOCK_SIZE, HEAD_DIM, GROUP, SMALL_M, SMALL_Q, SMALL_N,
                    BLOCK_D, DOT_PRECISION,
                )  # fmt: skip
            else:
                _attend_rows(
                    q_ptr, k_ptr, v_ptr, out_ptr, bt_row, q_start, q_len, first_q, ctx_len,
                    seq_len, kv_head, scale_log2, q_stride_t, q_stride_h, kv_stride_slot,
                    kv_stride_head, BLOCK_SIZE, HEAD_DIM, GROUP, BLOCK_M, BLOCK_Q, BLOCK_N,
                    BLOCK_D, DOT_PRECISION,
                )  # fmt: skip


def _paged_decode_kernel_src(
    q_ptr, k_ptr, v_ptr, out_ptr, qsl_ptr, seq_lens_ptr, block_table_ptr,
    num_reqs, num_tokens, scale_log2, q_stride_t, q_stride_h, bt_stride, kv_stride_slot,
    kv_stride_head,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HEAD_MAJOR: tl.constexpr, ZERO_PADDING: tl.constexpr,
):  # fmt: skip
    """Decode (every request has 0 or 1 query token): program ``i`` is request ``i`` and token
    ``i``; no search for the owning request, and padding tokens are zeroed here (no memset).
    HEAD_MAJOR: the KV heads of one request are neighbouring programs (axis 0), so the blocks
    they share are read at about the same time. Not ZERO_PADDING (a mixed batch's one-token
    requests, ``split_decodes``): program ``i`` is request ``i`` only, attends it when it has one
    query token (at its own token row) and writes nothing else."""
    if HEAD_MAJOR:
        kv_head = tl.program_id(0)
        i = tl.program_id(1)
    else:
        i = tl.program_id(0)
        kv_head = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)  # the GROUP query heads sharing this KV head
    row_ok = rows < GROUP
    head = kv_head * GROUP + rows
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_mask = row_ok[:, None] & d_ok[None, :]
    if ZERO_PADDING:
        total = tl.load(qsl_ptr + num_reqs)
        if (i >= total) & (i < num_tokens):  # a padding token: zeros
            pad_rows = i.to(tl.int64) * q_stride_t + head * q_stride_h
            zeros = tl.zeros([BLOCK_M, BLOCK_D], dtype=out_ptr.dtype.element_ty)
            tl.store(out_ptr + pad_rows[:, None] + offs_d[None, :], zeros, mask=q_mask)
    if i < num_reqs:
        tok = tl.load(qsl_ptr + i)
        if tl.load(qsl_ptr + i + 1) - tok == 1:
            seq_len = tl.load(seq_lens_ptr + i)
            q_rows = tok.to(tl.int64) * q_stride_t + head * q_stride_h
            q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=q_mask, other=0.0)
            m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            bt_row = block_table_ptr + i.to(tl.int64) * bt_stride
            for start in range(0, seq_len, BLOCK_N):  # the query sees all seq_len positions
                offs_n = start + tl.arange(0, BLOCK_N)
                n_ok = offs_n < seq_len
                block_ids = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
                slots = block_ids.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
                kv_off = (
                    slots[:, None] * kv_stride_slot + kv_head * kv_stride_head + offs_d[None, :]
                )
                kv_mask = n_ok[:, None] & d_ok[None, :]
                k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
                v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
                m_i, l_i, acc = _softmax_tile(
                    q, k, v, n_ok[None, :], m_i, l_i, acc, scale_log2, DOT_PRECISION, True
                )
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)
            tl.store(
                out_ptr + q_rows[:, None] + offs_d[None, :],
                (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty),
                mask=q_mask,
            )


# Launch parameters of the decode kernel, chosen on the H200 (Qwen3-0.6B heads, block size 16;
# bench/README.md "Decode attention"). Many programs (large batches): KV tiles of 64, 3 stages,
# timed inside CUDA graphs by bench/bench_decode_variants.py (1.05x the earlier 32-wide tiles
# over contexts 128..640 at batch 256, 1.16x at 64 x 640). Few programs (small batches, where
# each program walks a long context): wide tiles, from bench/tune_decode_attention.py.
DECODE_LAUNCH = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "head_major": True}
DECODE_LAUNCH_FEW_PROGRAMS = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2, "head_major": True}
# Below this many programs per SM, use DECODE_LAUNCH_FEW_PROGRAMS: at 64 x 640 (3.9 programs per
# SM) the 64-wide tiles took 43 us against 50 us for the wide ones (bench_decode_variants.py).
FEW_PROGRAMS_PER_SM = 2


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def decode_launch(num_programs: int, device: torch.device) -> dict[str, Any]:
    """The decode kernel's launch parameters for a grid of ``num_programs`` programs."""
    if num_programs < FEW_PROGRAMS_PER_SM * _num_sms(device):
        return DECODE_LAUNCH_FEW_PROGRAMS
    return DECODE_LAUNCH


def _launch_inputs(
    q: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
) -> tuple[torch.Tensor, int, int]:
    """``(q made contiguous, num_reqs, GQA group size)``; the KV cache must be contiguous."""
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    num_reqs = attn_metadata.query_start_loc.shape[0] - 1
    return q.contiguous(), num_reqs, q.shape[1] // kv_cache.shape[3]


def _kernel_args(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    num_reqs: int,
) -> tuple[Any, ...]:
    """The positional arguments the decode and varlen kernels share (pointers, counts, the scale
    in log2 units, strides)."""
    md = attn_metadata
    return (
        q, kv_cache[0], kv_cache[1], out, md.query_start_loc, md.seq_lens, md.block_table,
        num_reqs, q.shape[0], scale * 1.4426950408889634, q.stride(0), q.stride(1),
        md.block_table.stride(0), kv_cache.stride(2), kv_cache.stride(3),
    )  # fmt: skip


@functools.cache
def _paged_decode_kernel() -> Any:
    return _jit(_paged_decode_kernel_src)


# stepscope: hot
def paged_decode_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    head_major: bool | None = None,
) -> torch.Tensor:
    """Decode batches (``max_query_len <= 1``): grid ``[max(num_tokens, num_reqs), num_kv_heads]``
    (transposed when ``head_major``).

    Launch parameters default to :func:`decode_launch`'s; the tuning script overrides them."""
    q, num_reqs, group = _launch_inputs(q, kv_cache, attn_metadata)
    out = torch.empty_like(q)  # [T, Hq, D]: every row is written by the kernel
    if q.shape[0] == 0:
        return out
    _launch_decode(q, kv_cache, attn_metadata, scale, out, num_reqs, group, True,
                   block_n, num_warps, num_stages, head_major)  # fmt: skip
    return out


def _launch_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    num_reqs: int,
    group: int,
    zero_padding: bool,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    head_major: bool | None = None,
) -> None:
    """The decode kernel over ``max(num_tokens, num_reqs)`` programs per KV head that also zero
    the padding tokens, or (not ``zero_padding``: a mixed batch's one-token requests, the rest
    left to the varlen kernel) over ``num_reqs``."""
    num_tokens, _, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    grid = (max(num_tokens, num_reqs) if zero_padding else num_reqs, num_kv_heads)
    launch = decode_launch(grid[0] * grid[1], q.device)
    head_major = launch["head_major"] if head_major is None else head_major
    if head_major:
        grid = (grid[1], grid[0])
    _paged_decode_kernel()[grid](
        *_kernel_args(q, kv_cache, attn_metadata, scale, out, num_reqs),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, GROUP=group,
        BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n or launch["BLOCK_N"],
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HEAD_MAJOR=head_major,
        ZERO_PADDING=zero_padding,
        num_warps=num_warps or launch["num_warps"],
        num_stages=num_stages or launch["num_stages"],
    )  # fmt: skip


# Batch-invariant mode (docs/design.md §2.16): one fixed launch, whatever the grid's size.
INVARIANT_LAUNCH: dict[str, Any] = {
    "BLOCK_N": 64,
    "num_warps": 4,
    "num_stages": 2,
    "head_major": True,
}


# stepscope: hot
def paged_attention_per_token_triton(
    q: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Any batch, every query token attended on its own: token ``t`` of request ``r`` becomes a
    one-token "request" of the decode kernel, with context ``seq_lens[r] - q_len[r] + local + 1``
    (its causal prefix) and ``r``'s block-table row; padding tokens get context 0 (zeros). One
    program per (token, KV head), one fixed launch (``INVARIANT_LAUNCH``): a token's output is
    computed by the same instructions in the same order whatever batch it is in, so a verify's
    row equals the plain decode's to the bit (batch-invariant mode). Every tensor here is built on
    the device (CUDA-graph safe). It reads each token's whole prefix: O(context) per token, made
    for exactness checks, not speed."""
    q, num_reqs, _ = _launch_inputs(q, kv_cache, attn_metadata)
    num_tokens = q.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return torch.zeros_like(q)
    device = q.device
    qsl = attn_metadata.query_start_loc.long()
    t = torch.arange(num_tokens, device=device)
    req = torch.searchsorted(qsl[1:], t, right=True)  # [T]; num_reqs for padding tokens
    real = req < num_reqs
    req = req.clamp(max=num_reqs - 1)
    local = t - qsl[req]
    q_len = qsl[req + 1] - qsl[req]
    ctx = attn_metadata.seq_lens.long()[req] - q_len + local + 1
    per_token = AttentionMetadata(
        query_start_loc=torch.arange(num_tokens + 1, device=device, dtype=torch.int32),
        seq_lens=torch.where(real, ctx, 0).to(torch.int32),
        block_table=attn_metadata.block_table[req],
        slot_mapping=attn_metadata.slot_mapping,
        num_reqs=num_tokens,
        num_tokens=num_tokens,
        max_query_len=1,
        max_seq_len=attn_metadata.max_seq_len,
    )
    launch = INVARIANT_LAUNCH
    return paged_decode_attention_triton(
        q, kv_cache, per_token, scale, block_n=launch["BLOCK_N"], num_warps=launch["num_warps"],
        num_stages=launch["num_stages"], head_major=launch["head_major"],
    )  # fmt: skip


@functools.cache
def _paged_attention_kernel() -> Any:
    """JIT-compile on first use, so ``TRITON_INTERPRET`` is read at the first call, not import.
    The counts and the block-table width are not specialised on (1, multiples of 16), so one
    build serves every batch."""
    return _jit(
        _paged_attention_kernel_src, do_not_specialize=["num_reqs", "num_tokens", "bt_stride"]
    )


# stepscope: hot
def paged_attention_triton(
    q: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Decode batches (``max_query_len <= 1``, known on the host) run
    :func:`paged_decode_attention_triton`, everything else :func:`paged_varlen_attention_triton`.

    Either grid depends only on the token and request counts (fixed for a padded CUDA-graph
    shape), never on ``max_seq_len``: each program reads its request's ``seq_len`` on the device
    and loops over KV tiles.
    """
    if triton is None:
        raise RuntimeError("paged_attention_triton needs triton, which is not installed")
    if attn_metadata.max_query_len <= 1:
        return paged_decode_attention_triton(q, kv_cache, attn_metadata, scale)
    return paged_varlen_attention_triton(q, kv_cache, attn_metadata, scale)


# Launch parameters of the varlen kernel by the element size of q (2: bf16/fp16, 4: fp32), to be
# chosen on the H200 with bench/tune_varlen_attention.py (Qwen3-0.6B heads, block size 16; it
# prints the table to paste here). BLOCK_M: rows (query tokens x GQA group) of a prefill tile;
# BLOCK_N: KV positions per tile; SMALL_M / SMALL_N: the tile of requests of at most
# SMALL_M // group tokens (decodes, verifies) in one program (SMALL_M 0: no small path);
# reverse: the longest causal KV walks start first; head_major (optional, default False): the
# grid is [KV heads, q blocks], so the heads of one q block (reading neighbouring KV bytes) run
# together, as the decode kernel's head_major; split_decodes (optional, default False): a second
# launch, the decode kernel, attends the one-token requests and the varlen kernel skips them (a
# mixed step's decodes read their KV at the decode kernel's bandwidth; on the H200 it was slower:
# the decode kernel took 35 us a layer for 64 decodes at context 256, bench/README.md session 16).
VARLEN_LAUNCH: dict[int, dict[str, Any]] = {
    # bench/tune_varlen_attention.py on the H200 (bench/results/h200/tune_varlen.json; head_major
    # from its phase 3, tune_varlen_split_session16.json): best overall, 1.003x of each shape's
    # best on average; head-major cut a 1984-token prompt's layer from 105 to 85 us and a
    # 2048-token one's from 79 to 56 us. split_decodes measured slower there (0.96x on mix128).
    2: {"BLOCK_M": 64, "BLOCK_N": 64, "SMALL_M": 16, "SMALL_N": 128, "num_warps": 4,
        "num_stages": 2, "reverse": True, "head_major": True},
    4: {"BLOCK_M": 64, "BLOCK_N": 32, "SMALL_M": 16, "SMALL_N": 32, "num_warps": 4,
        "num_stages": 2, "reverse": True},
}  # fmt: skip
# Used (with a warning) when the table's entry fails to compile on this device/Triton version.
VARLEN_FALLBACK: dict[str, Any] = {"BLOCK_M": 64, "BLOCK_N": 32, "SMALL_M": 16, "SMALL_N": 32,
                                   "num_warps": 4, "num_stages": 2, "reverse": False}  # fmt: skip


MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension


def varlen_tiles(launch: Mapping[str, Any], group: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_Q, SMALL_M, SMALL_Q)`` of a launch for a GQA group: row counts are
    powers of two >= 16 that hold at least one token's group of heads; ``SMALL_Q`` 0 turns the
    small path off."""
    min_m = max(16, triton.next_power_of_2(group))
    block_m = max(int(launch["BLOCK_M"]), min_m)
    small_m = min(max(int(launch["SMALL_M"]), min_m), block_m) if launch["SMALL_M"] else 0
    return block_m, block_m // group, small_m, small_m // group


# stepscope: hot
def paged_varlen_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
    launch: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Any batch (prefill, chunked, verify, mixed, decode): one kernel, grid
    ``[num_tokens // BLOCK_Q + num_reqs + 1, num_kv_heads]``; each program finds the request
    owning its q block by binary search over ``query_start_loc``. Programs whose q block is
    empty (query_len 0, padded requests) exit without writing; padding tokens (past
    ``query_start_loc[-1]``) get zeros from the programs past the last request, so the output
    needs no fill.

    ``launch`` defaults to ``VARLEN_LAUNCH`` for q's element size; the tuning script and tests
    override it. Nothing here depends on ``max_query_len``/``max_seq_len``."""
    q, num_reqs, group = _launch_inputs(q, kv_cache, attn_metadata)
    out = torch.empty_like(q)  # [T, Hq, D]: every row is written by the kernel
    if q.shape[0] == 0:
        return out
    if num_reqs == 0:
        return out.zero_()
    key = q.element_size()
    table = VARLEN_LAUNCH.get(key, VARLEN_FALLBACK) if launch is None else launch
    try:
        _launch_varlen(q, kv_cache, attn_metadata, scale, out, num_reqs, group, table)
    except Exception as exc:  # a tuned entry this device's compiler rejects
        if launch is not None or table == VARLEN_FALLBACK:
            raise
        warnings.warn(
            f"varlen attention launch {table} failed ({type(exc).__name__}: {exc}); "
            f"using {VARLEN_FALLBACK}",
            RuntimeWarning,
            stacklevel=2,
        )
        VARLEN_LAUNCH[key] = dict(VARLEN_FALLBACK)
        _launch_varlen(q, kv_cache, attn_metadata, scale, out, num_reqs, group, VARLEN_FALLBACK)
    return out


def _launch_varlen(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    num_reqs: int,
    group: int,
    launch: Mapping[str, Any],
) -> None:
    num_tokens, _, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    block_m, block_q, small_m, small_q = varlen_tiles(launch, group)
    split = bool(launch.get("split_decodes", False))
    num_q_blocks = num_tokens // block_q + num_reqs + 1
    head_major = bool(launch.get("head_major", False)) and num_q_blocks <= MAX_GRID_Y
    grid = (num_kv_heads, num_q_blocks) if head_major else (num_q_blocks, num_kv_heads)
    _paged_attention_kernel()[grid](
        *_kernel_args(q, kv_cache, attn_metadata, scale, out, num_reqs),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, GROUP=group,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=int(launch["BLOCK_N"]),
        SMALL_M=max(small_m, 16), SMALL_Q=small_q, SMALL_N=int(launch["SMALL_N"]),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        REVERSE=bool(launch["reverse"]), HEAD_MAJOR=head_major, SKIP_SINGLE=split,
        num_warps=int(launch["num_warps"]), num_stages=int(launch["num_stages"]),
    )  # fmt: skip
    if split:  # the one-token requests, at the decode kernel's speed
        _launch_decode(q, kv_cache, attn_metadata, scale, out, num_reqs, group, False)
