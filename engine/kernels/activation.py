"""SwiGLU's activation: ``silu(gate) * up`` over the merged ``gate_up`` GEMM output.

``gate_up: [T, 2 * I]`` holds ``gate`` in its first ``I`` columns and ``up`` in the last ``I``
(the order the model concatenates ``gate_proj`` and ``up_proj``). Like HF, ``silu`` is rounded to
the input dtype before the multiply; the Triton kernel rounds at the same points.
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

__all__ = ["silu_and_mul_torch", "silu_and_mul_triton"]

_BLOCK = 1024


# stepscope: hot
def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """Reference: ``gate_up: [T, 2 * I]`` -> ``silu(gate) * up: [T, I]``."""
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]


def _silu_and_mul_kernel_src(
    x_ptr, out_ptr, x_stride, out_stride, inter, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + inter + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(
        out_ptr + row * out_stride + offs, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask
    )


@functools.cache
def _silu_and_mul_kernel() -> Any:
    """JIT-compile on first use, so ``TRITON_INTERPRET`` is read at the first call, not import."""
    return triton.jit(_silu_and_mul_kernel_src)


# stepscope: hot
def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`silu_and_mul_torch`; grid ``[T, cdiv(I, 1024)]``."""
    if triton is None:
        raise RuntimeError("silu_and_mul_triton needs triton, which is not installed")
    if gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.shape[1] % 2:
        raise ValueError("silu_and_mul_triton expects [T, 2 * I] with dense rows")
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(num_tokens, inter)  # [T, I]
    if num_tokens == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(inter))
    grid = (num_tokens, triton.cdiv(inter, block))
    _silu_and_mul_kernel()[grid](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4
    )
    return out
