"""Apply a packed batch of row writes to a 2-D device tensor in one kernel.

A batch of ``W`` writes is three int32 arrays plus the values, all on the device:

* ``rows[w]``, ``starts[w]``: write ``w`` targets ``base[rows[w], starts[w] : starts[w] + len_w]``;
* ``offsets[W + 1]``: ``len_w = offsets[w + 1] - offsets[w]``, values of write ``w`` sit at
  ``values[offsets[w] : offsets[w + 1]]`` (an exclusive cumsum of the lengths).

Writes in one batch must not overlap (the host side checks); their order is then irrelevant.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine runs without triton; only the torch path is available
    triton = None
    tl = None

__all__ = [
    "apply_staged_writes_torch",
    "apply_staged_writes_triton",
    "HAS_TRITON",
]

HAS_TRITON = triton is not None
_BLOCK = 128


# stepscope: hot
def apply_staged_writes_torch(
    base: torch.Tensor,  # [num_rows, num_cols]
    rows: torch.Tensor,  # [W] int32
    starts: torch.Tensor,  # [W] int32
    offsets: torch.Tensor,  # [W + 1] int32
    values: torch.Tensor,  # [>= num_values] base.dtype
    num_values: int,
) -> None:
    """Reference: one scatter of all values (``num_values`` is the host-known total)."""
    num_writes = rows.shape[0]
    if num_writes == 0 or num_values == 0:
        return
    flat = torch.arange(num_values, device=base.device, dtype=torch.int64)  # [num_values]
    ends = offsets[1:].to(torch.int64)  # [W]
    write_id = torch.searchsorted(ends, flat, right=True)  # [num_values]: which write owns it
    col = starts.to(torch.int64)[write_id] + flat - offsets.to(torch.int64)[write_id]
    base[rows.to(torch.int64)[write_id], col] = values[:num_values]


@functools.cache
def _build_kernel() -> Any:
    """Define the kernel on first use, so TRITON_INTERPRET set by then is honoured."""

    @triton.jit
    def _apply_staged_writes_kernel(
        base_ptr,
        base_stride,
        rows_ptr,
        starts_ptr,
        offsets_ptr,
        values_ptr,
        BLOCK: tl.constexpr,
    ):
        w = tl.program_id(0)
        chunk = tl.program_id(1)
        row = tl.load(rows_ptr + w).to(tl.int64)
        start = tl.load(starts_ptr + w).to(tl.int64)
        begin = tl.load(offsets_ptr + w).to(tl.int64)
        length = tl.load(offsets_ptr + w + 1).to(tl.int64) - begin
        i = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = i < length
        vals = tl.load(values_ptr + begin + i, mask=mask)
        tl.store(base_ptr + row * base_stride + start + i, vals, mask=mask)

    return _apply_staged_writes_kernel


# stepscope: hot
def apply_staged_writes_triton(
    base: torch.Tensor,  # [num_rows, num_cols], contiguous rows
    rows: torch.Tensor,  # [W] int32
    starts: torch.Tensor,  # [W] int32
    offsets: torch.Tensor,  # [W + 1] int32
    values: torch.Tensor,  # [>= num_values] base.dtype
    max_len: int,
) -> None:
    """One program per (write, chunk of ``_BLOCK`` values); ``max_len`` is the longest write."""
    if triton is None:
        raise RuntimeError("apply_staged_writes_triton needs triton, which is not installed")
    num_writes = rows.shape[0]
    if num_writes == 0 or max_len == 0:
        return
    if base.stride(1) != 1:
        raise ValueError("staged-write base tensor needs unit stride along columns")
    grid = (num_writes, triton.cdiv(max_len, _BLOCK))
    _build_kernel()[grid](base, base.stride(0), rows, starts, offsets, values, BLOCK=_BLOCK)
