"""SiLU-and-mul over the merged gate_up output: torch vs float64, Triton vs torch."""

from __future__ import annotations

# TRITON_INTERPRET is set by tests/conftest.py when there is no CUDA device.
import pytest  # noqa: E402
import torch  # noqa: E402

from engine.kernels.activation import (  # noqa: E402
    silu_and_mul_torch,
    silu_and_mul_triton,
)
from engine.kernels.backend import create_kernel_backend  # noqa: E402


def _gate_up(num_tokens: int, inter: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(inter)
    return (torch.randn(num_tokens, 2 * inter, generator=gen) * 3).to(dtype)  # [T, 2I]


@pytest.mark.parametrize("inter", [48, 1500])  # 1500: two column blocks per token
def test_matches_float64_and_torch(inter: int) -> None:
    x = _gate_up(3, inter, torch.float32)
    gate, up = x.double()[:, :inter], x.double()[:, inter:]
    expected = (gate / (1 + torch.exp(-gate)) * up).float()
    torch.testing.assert_close(silu_and_mul_torch(x), expected)
    torch.testing.assert_close(silu_and_mul_triton(x), expected)


def test_bf16_and_swapped_halves_caught() -> None:
    x = _gate_up(4, 40, torch.bfloat16)
    ref = silu_and_mul_torch(x)
    # the interpreter truncates fp32 -> bf16 at each rounding point (the GPU rounds to nearest)
    torch.testing.assert_close(silu_and_mul_triton(x), ref, rtol=3e-2, atol=1e-2)
    swapped = torch.cat((x[:, 40:], x[:, :40]), dim=1)
    assert not torch.allclose(silu_and_mul_triton(swapped).float(), ref.float(), atol=0.1)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backend_and_empty(backend: str) -> None:
    kernels = create_kernel_backend(backend)
    x = _gate_up(2, 16, torch.float32)
    torch.testing.assert_close(kernels.silu_and_mul(x), silu_and_mul_torch(x))
    assert kernels.silu_and_mul(x[:0]).shape == (0, 16)
