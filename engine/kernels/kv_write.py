"""Write this step's K/V into the paged KV cache through the slot mapping.

``kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]``; token ``t`` goes to flat slot
``slot_mapping[t] = block_id * block_size + offset``; slot ``-1`` (padding) writes nothing.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine runs on the torch path without triton
    triton = None
    tl = None

__all__ = ["write_kv_torch", "write_kv_triton"]


# stepscope: hot
def write_kv_torch(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Reference: scatter ``k, v: [T, Hkv, D]`` into ``kv_cache`` at ``slot_mapping: [T]``.

    Sync-free: a padding row (slot -1) is redirected to the slot of the first valid row carrying
    that row's own value (or, if no row is valid, to slot 0 carrying slot 0's current value), so
    every duplicate write stores identical bytes and no boolean indexing is needed.
    """
    if k.shape[0] == 0:
        return
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    # k_flat, v_flat: [num_blocks * block_size, Hkv, D] views of the cache
    k_flat = kv_cache[0].view(-1, num_kv_heads, head_dim)
    v_flat = kv_cache[1].view(-1, num_kv_heads, head_dim)
    valid = slot_mapping >= 0  # [T]
    # Index with a [1] tensor, never a 0-dim one: a 0-dim tensor index is read on the host.
    anchor = torch.argmax(valid.to(torch.int8)).view(1)  # [1] first valid row, 0 if none
    anchor_valid = valid.index_select(0, anchor).view(1, 1, 1)
    anchor_slot = slot_mapping.index_select(0, anchor).clamp(min=0)  # [1]
    slots = torch.where(valid, slot_mapping, anchor_slot)  # [T]
    keep = valid[:, None, None]
    for src, dst in ((k, k_flat), (v, v_flat)):
        anchor_value = torch.where(  # [1, Hkv, D]
            anchor_valid, src.index_select(0, anchor), dst.index_select(0, anchor_slot)
        )
        values = torch.where(keep, src, anchor_value.to(src.dtype))
        dst.index_copy_(0, slots, values.to(dst.dtype))


def _write_kv_kernel_src(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    k_token_stride,
    v_token_stride,
    cache_kv_stride,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    offs = tl.arange(0, BLOCK)
    row_len = tl.where(slot >= 0, ROW, 0)  # padding (slot -1) masks the whole row
    mask = offs < row_len
    dst = slot.to(tl.int64) * ROW + offs
    k_row = tl.load(k_ptr + token * k_token_stride + offs, mask=mask)
    v_row = tl.load(v_ptr + token * v_token_stride + offs, mask=mask)
    tl.store(cache_ptr + dst, k_row.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptr + cache_kv_stride + dst, v_row.to(cache_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _write_kv_kernel() -> Any:
    """JIT-compile on first use, so ``TRITON_INTERPRET`` is read at the first call, not import."""
    return triton.jit(_write_kv_kernel_src)


# stepscope: hot
def write_kv_triton(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton version of :func:`write_kv_torch`: one program per token; grid = ``[T]``."""
    if triton is None:
        raise RuntimeError("write_kv_triton needs triton, which is not installed")
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    k = _rows_contiguous(k)
    v = _rows_contiguous(v)
    row = kv_cache.shape[3] * kv_cache.shape[4]
    _write_kv_kernel()[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k.stride(0),
        v.stride(0),
        kv_cache.stride(0),
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
    )


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Each token's [Hkv, D] row must be dense; the token stride may be anything."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()
