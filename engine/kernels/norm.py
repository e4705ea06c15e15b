"""RMSNorm, optionally fused with the residual add that precedes it (one kernel per call).

``rms_norm(x) = weight * (x / sqrt(mean(x^2) + eps))``, normalised in fp32 like HF: the
normalised value is rounded to ``x``'s dtype before the (dtype) multiply by ``weight``. The fused
form first forms ``residual_out = x + residual`` in ``x``'s dtype (the rounded sum HF keeps as
its residual stream) and normalises that. The Triton kernel rounds at the same points, so in bf16
it reproduces the torch reference up to the fp32 reduction order.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine runs on the torch path without triton
    triton = None
    tl = None

__all__ = [
    "add_rms_norm_torch",
    "add_rms_norm_triton",
    "rms_norm_torch",
    "rms_norm_triton",
]


# stepscope: hot
def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference: ``x: [..., N]``, ``weight: [N]`` -> ``[..., N]`` in ``x``'s dtype."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


# stepscope: hot
def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: ``(rms_norm(x + residual), x + residual)``; ``x, residual: [T, N]``."""
    residual_out = x + residual
    return rms_norm_torch(residual_out, weight, eps), residual_out


def _rms_norm_kernel_src(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    x_stride, res_stride, out_stride, res_out_stride, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like the dtype add
        tl.store(res_out_ptr + row * res_out_stride + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + offs, (normed * w).to(x.dtype), mask=mask)


@functools.cache
def _rms_norm_kernel() -> Any:
    """JIT-compile on first use, so ``TRITON_INTERPRET`` is read at the first call, not import."""
    return triton.jit(_rms_norm_kernel_src)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One program per row of ``x: [T, N]`` (rows may be strided; columns must be dense)."""
    if triton is None:
        raise RuntimeError("the rms_norm Triton kernels need triton, which is not installed")
    if x.dim() != 2 or x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rms_norm_triton expects [T, N] inputs with dense rows")
    num_rows, n_cols = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # [T, N]
    res_out = None if residual is None else torch.empty_like(out)  # [T, N]
    if num_rows == 0:
        return out, res_out
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel()[(num_rows,)](
        x, x if residual is None else residual, weight, out, out if res_out is None else res_out,
        x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0), out.stride(0),
        n_cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 8),
    )  # fmt: skip
    return out, res_out


# stepscope: hot
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton version of :func:`rms_norm_torch` for ``x: [T, N]``: one kernel."""
    out, _ = _launch(x, None, weight, eps)
    return out


# stepscope: hot
def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`add_rms_norm_torch`: one kernel writes both outputs."""
    out, res_out = _launch(x, residual, weight, eps)
    assert res_out is not None
    return out, res_out
