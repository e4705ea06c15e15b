"""RMSNorm and fused residual-add + RMSNorm: torch reference vs float64, Triton vs torch."""

from __future__ import annotations

# TRITON_INTERPRET is set by tests/conftest.py when there is no CUDA device.
import pytest  # noqa: E402
import torch  # noqa: E402

from engine.kernels.backend import create_kernel_backend  # noqa: E402
from engine.kernels.norm import (  # noqa: E402
    add_rms_norm_torch,
    add_rms_norm_triton,
    rms_norm_torch,
    rms_norm_triton,
)

EPS = 1e-6
# Triton's interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even), so on the CPU a
# bf16 result may sit a few ulps off at each rounding point; tests/engine/test_fused_gpu.py
# holds the GPU to 1 ulp.
BF16_INTERP_TOL = {"rtol": 3e-2, "atol": 1e-2}


def _rms_norm_f64(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` in float64."""
    x64 = x.double()
    return weight.double() * x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + EPS)


def _inputs(
    num_rows: int, n: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(num_rows, n, generator=gen) * 3).to(dtype)
    residual = torch.randn(num_rows, n, generator=gen).to(dtype)
    weight = (1 + 0.2 * torch.randn(n, generator=gen)).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("n", [64, 48])
def test_torch_reference_matches_float64(n: int) -> None:
    x, residual, weight = _inputs(5, n, torch.float32)
    torch.testing.assert_close(rms_norm_torch(x, weight, EPS), _rms_norm_f64(x, weight).float())
    normed, res_out = add_rms_norm_torch(x, residual, weight, EPS)
    assert torch.equal(res_out, x + residual)
    torch.testing.assert_close(normed, _rms_norm_f64(x + residual, weight).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [64, 48])
def test_triton_matches_torch(n: int, dtype: torch.dtype) -> None:
    """bf16: the kernel rounds where the reference rounds (see BF16_INTERP_TOL)."""
    x, residual, weight = _inputs(6, n, dtype, seed=n)
    tol = BF16_INTERP_TOL if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(
        rms_norm_triton(x, weight, EPS), rms_norm_torch(x, weight, EPS), **tol
    )
    normed, res_out = add_rms_norm_triton(x, residual, weight, EPS)
    ref_normed, ref_res = add_rms_norm_torch(x, residual, weight, EPS)
    torch.testing.assert_close(res_out, ref_res, **tol)
    torch.testing.assert_close(normed, ref_normed, **tol)


def test_triton_strided_rows_and_empty() -> None:
    """Rows may be a strided view (e.g. a slice of a wider buffer); zero rows launch nothing."""
    x, residual, weight = _inputs(4, 96, torch.float32)
    x_view, res_view = x[:, :32], residual[:, 16:48]
    normed, res_out = add_rms_norm_triton(x_view, res_view, weight[:32], EPS)
    ref_normed, ref_res = add_rms_norm_torch(x_view, res_view, weight[:32], EPS)
    torch.testing.assert_close(normed, ref_normed)
    assert torch.equal(res_out, ref_res)
    assert rms_norm_triton(x[:0], weight, EPS).shape == (0, 96)


def test_comparison_can_fail() -> None:
    """A kernel that skipped the residual add would be caught."""
    x, residual, weight = _inputs(3, 64, torch.float32)
    normed, _ = add_rms_norm_triton(x, residual, weight, EPS)
    assert not torch.allclose(normed, rms_norm_torch(x, weight, EPS), atol=1e-3)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backends(backend: str) -> None:
    kernels = create_kernel_backend(backend)
    x, residual, weight = _inputs(3, 64, torch.float32)
    torch.testing.assert_close(kernels.rms_norm(x, weight, EPS), rms_norm_torch(x, weight, EPS))
    head_view = x.view(3, 4, 16)  # 3-D input (q/k heads) always takes the torch path
    assert kernels.rms_norm(head_view, weight[:16], EPS).shape == (3, 4, 16)
    got = kernels.add_rms_norm(x, residual, weight, EPS)
    for g, e in zip(got, add_rms_norm_torch(x, residual, weight, EPS), strict=True):
        torch.testing.assert_close(g, e)
