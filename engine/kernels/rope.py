"""RoPE on the merged QKV projection, fused with Qwen3's per-head q/k RMSNorm and the KV write.

Input ``qkv: [T, (Hq + 2 * Hkv) * D]`` is the output of the one QKV GEMM: ``Hq`` query heads,
then ``Hkv`` key heads, then ``Hkv`` value heads, each ``D`` wide. Per token this op

1. RMS-normalises every query and key head over ``D`` with ``q_norm_weight`` / ``k_norm_weight``
   (Qwen3; skipped when they are ``None``),
2. rotates queries and keys by ``cos, sin: [T, 1, D]`` in HF's rotate-half (NeoX) layout:
   ``x * cos + rotate_half(x) * sin`` with ``rotate_half([x1, x2]) = [-x2, x1]``,
3. writes the keys and values into ``kv_cache: [2, num_blocks, block_size, Hkv, D]`` at
   ``slot_mapping: [T]`` (slot -1 writes nothing),

and returns the queries ``[T, Hq, D]``. The Triton kernel does all of it in one launch, rounding
to the input dtype where HF's bf16 ops round (norm, weight multiply, each RoPE product and sum).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.kernels.kv_write import write_kv_torch
from engine.kernels.norm import rms_norm_torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine runs on the torch path without triton
    triton = None
    tl = None

__all__ = [
    "apply_rotary_torch",
    "qk_norm_rope_write_kv_torch",
    "qk_norm_rope_write_kv_triton",
]


# stepscope: hot
def apply_rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [T, H, D]`` by ``cos, sin: [T, 1, D]`` (x's dtype), HF's rotate_half layout."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# stepscope: hot
def qk_norm_rope_write_kv_torch(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """Reference of the module docstring's three steps; returns ``q: [T, Hq, D]``."""
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    if q_norm_weight is not None and k_norm_weight is not None:
        q, k = rms_norm_torch(q, q_norm_weight, eps), rms_norm_torch(k, k_norm_weight, eps)
    q, k = apply_rotary_torch(q, cos, sin), apply_rotary_torch(k, cos, sin)
    write_kv_torch(k, v, kv_cache, slot_mapping)
    return q


def _qk_norm_rope_kernel_src(
    qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_out_ptr, cache_ptr, slot_ptr,
    qkv_stride, cos_stride, sin_stride, q_out_stride, cache_kv_stride, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_KV: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    # One [heads, D/2] tile per half: rows 0..Hq-1 are query heads, Hq..Hq+Hkv-1 key heads.
    heads = tl.arange(0, BLOCK_H)
    is_q = heads < NUM_HEADS
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    mask = (heads < NUM_HEADS + NUM_KV_HEADS)[:, None] & d_ok[None, :]
    src = qkv_ptr + t * qkv_stride + heads[:, None] * HEAD_DIM + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:
        sum_sq = tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)
        rstd = (1.0 / tl.sqrt(sum_sq / HEAD_DIM + eps))[:, None]
        w1 = tl.where(
            is_q[:, None],
            tl.load(qw_ptr + d, mask=d_ok, other=0.0)[None, :],
            tl.load(kw_ptr + d, mask=d_ok, other=0.0)[None, :],
        ).to(tl.float32)
        w2 = tl.where(
            is_q[:, None],
            tl.load(qw_ptr + HALF + d, mask=d_ok, other=0.0)[None, :],
            tl.load(kw_ptr + HALF + d, mask=d_ok, other=0.0)[None, :],
        ).to(tl.float32)
        x1f = ((x1f * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2f = ((x2f * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    c1 = tl.load(cos_ptr + t * cos_stride + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * cos_stride + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * sin_stride + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * sin_stride + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    # out = x * cos + rotate_half(x) * sin, each product and the sum rounded like HF's dtype ops
    out1 = (x1f * c1).to(dtype).to(tl.float32) - (x2f * s1).to(dtype).to(tl.float32)
    out2 = (x2f * c2).to(dtype).to(tl.float32) + (x1f * s2).to(dtype).to(tl.float32)
    q_dst = q_out_ptr + t * q_out_stride + heads[:, None] * HEAD_DIM + d[None, :]
    q_mask = mask & is_q[:, None]
    tl.store(q_dst, out1.to(dtype), mask=q_mask)
    tl.store(q_dst + HALF, out2.to(dtype), mask=q_mask)
    # keys and values into the cache; padding tokens (slot -1) write nothing
    slot = tl.load(slot_ptr + t)
    kv_row = NUM_KV_HEADS * HEAD_DIM
    k_dst = cache_ptr + slot * kv_row + (heads - NUM_HEADS)[:, None] * HEAD_DIM + d[None, :]
    k_end = tl.where(slot >= 0, NUM_HEADS + NUM_KV_HEADS, NUM_HEADS)  # no key rows for padding
    k_mask = mask & ((heads >= NUM_HEADS) & (heads < k_end))[:, None]
    cache_dtype = cache_ptr.dtype.element_ty
    tl.store(k_dst, out1.to(dtype).to(cache_dtype), mask=k_mask)
    tl.store(k_dst + HALF, out2.to(dtype).to(cache_dtype), mask=k_mask)
    offs_v = tl.arange(0, BLOCK_KV)
    v_mask = offs_v < tl.where(slot >= 0, kv_row, 0)
    v_src = qkv_ptr + t * qkv_stride + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + offs_v
    v = tl.load(v_src, mask=v_mask, other=0.0)
    tl.store(cache_ptr + cache_kv_stride + slot * kv_row + offs_v, v.to(cache_dtype), mask=v_mask)


@functools.cache
def _qk_norm_rope_kernel() -> Any:
    """JIT-compile on first use, so ``TRITON_INTERPRET`` is read at the first call, not import."""
    return triton.jit(_qk_norm_rope_kernel_src)


# stepscope: hot
def qk_norm_rope_write_kv_triton(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """Triton version of :func:`qk_norm_rope_write_kv_torch`: one program per token."""
    if triton is None:
        raise RuntimeError("qk_norm_rope_write_kv_triton needs triton, which is not installed")
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    _check_inputs(qkv, cos, sin, kv_cache, num_heads)
    q = qkv.new_empty(num_tokens, num_heads, head_dim)  # [T, Hq, D]
    if num_tokens == 0:
        return q
    has_norm = q_norm_weight is not None and k_norm_weight is not None
    block_h = triton.next_power_of_2(num_heads + num_kv_heads)
    block_half = triton.next_power_of_2(head_dim // 2)
    _qk_norm_rope_kernel()[(num_tokens,)](
        qkv, cos, sin, q_norm_weight if has_norm else qkv, k_norm_weight if has_norm else qkv,
        q, kv_cache, slot_mapping,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), kv_cache.stride(0), eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
        HAS_NORM=has_norm,
        BLOCK_H=block_h, BLOCK_HALF=block_half,
        BLOCK_KV=triton.next_power_of_2(num_kv_heads * head_dim),
        num_warps=4 if block_h * block_half <= 2048 else 8,
    )  # fmt: skip
    return q


def _check_inputs(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, num_heads: int
) -> None:
    """Shapes and layouts the kernel's pointer arithmetic assumes (host metadata only)."""
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv must be [T, (Hq + 2 * Hkv) * D], got {tuple(qkv.shape)}")
    if qkv.stride(1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("qkv, cos and sin need a dense last dimension")
    if head_dim % 2 or not kv_cache.is_contiguous():
        raise ValueError("head_dim must be even and kv_cache contiguous")
