"""Skinny GEMM for decode batches: ``y = x @ w.T`` with ``x: [M, K]``, ``w: [N, K]``, small ``M``.

A decode step's projections have few rows (``M`` = the batch, at most a few hundred) and
``N``/``K`` of a thousand or a few: the library GEMM's tiles then leave most SMs idle or run long
K loops on few of them. This kernel tiles ``M x N`` and can split ``K`` over ``SPLIT_K`` programs,
which write fp32 partial sums to a workspace ``[SPLIT_K, M, N]`` that a second kernel sums and
rounds to the output dtype (no atomics: the sum order is fixed, so results are deterministic).
``gemm_torch`` is the reference. An experiment, not an engine kernel: on the H200 the library
GEMM was as fast or faster at batch 256 (``bench/bench_gemm.py``, bench/README.md "Decode GEMMs"),
so the engine keeps ``F.linear``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine runs on the torch path without triton
    triton = None
    tl = None

__all__ = ["GemmLaunch", "gemm_torch", "gemm_triton"]


@dataclass(frozen=True)
class GemmLaunch:
    """Launch constants of one skinny GEMM: tile rows/cols/depth, K split, warps, stages."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def gemm_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Reference: ``x: [M, K] @ w: [N, K].T -> [M, N]`` (the library GEMM)."""
    return F.linear(x, w)


def _gemm_kernel_src(
    x_ptr, w_ptr, out_ptr, M, N, K, k_per_split, x_stride, w_stride, out_stride_s, out_stride_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_begin = pid_k * k_per_split
    x_rows = x_ptr + rm[:, None].to(tl.int64) * x_stride
    w_rows = w_ptr + rn[None, :].to(tl.int64) * w_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        k = k_begin + k0 + rk
        a = tl.load(x_rows + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(w_rows + k[:, None], mask=(rn[None, :] < N) & (k[:, None] < K), other=0.0)
        acc = tl.dot(a, b, acc)
    out = out_ptr + pid_k * out_stride_s + rm[:, None] * out_stride_m + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if PARTIAL:
        tl.store(out, acc, mask=mask)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _split_sum_kernel_src(
    part_ptr, out_ptr, numel, part_stride, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * part_stride + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """JIT-compile on first use, so ``TRITON_INTERPRET`` is read at the first call, not import."""
    return triton.jit(_gemm_kernel_src), triton.jit(_split_sum_kernel_src)


_SUM_BLOCK = 1024


def gemm_triton(x: torch.Tensor, w: torch.Tensor, launch: GemmLaunch | None = None) -> torch.Tensor:
    """Triton version of :func:`gemm_torch`; fp32 accumulation, output in ``x``'s dtype."""
    if triton is None:
        raise RuntimeError("gemm_triton needs triton, which is not installed")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"gemm_triton: x [M, K] and w [N, K] expected, got {list(x.shape)} and {list(w.shape)}"
        )
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("gemm_triton: x and w need a contiguous last dimension")
    launch = launch or GemmLaunch()
    m, k = x.shape
    n = w.shape[0]
    gemm, split_sum = _kernels()
    split = max(1, launch.split_k)
    k_per_split = triton.cdiv(triton.cdiv(k, split), launch.block_k) * launch.block_k
    split = triton.cdiv(k, k_per_split)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, launch.block_n), triton.cdiv(m, launch.block_m), split)
    gemm[grid](
        x, w, part, m, n, k, k_per_split, x.stride(0), w.stride(0), m * n, n,
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        PARTIAL=split > 1,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    if split > 1:
        split_sum[(triton.cdiv(m * n, _SUM_BLOCK),)](
            part, out, m * n, m * n, SPLIT_K=split, BLOCK=_SUM_BLOCK
        )
    return out
