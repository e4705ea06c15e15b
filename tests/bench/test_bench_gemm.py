"""bench/_gemm_triton.py on the CPU (TRITON_INTERPRET=1): the skinny split-K GEMM against a float64
product, for odd shapes and every K split, and its shape errors; bench_gemm.py's smoke mode."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from bench._gemm_triton import GemmLaunch, gemm_triton  # noqa: E402


@pytest.mark.parametrize("split", [1, 2, 3, 4])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 17, 64), (7, 70, 96), (33, 64, 200)])
def test_gemm_matches_float64(m: int, n: int, k: int, split: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k + split)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    y = gemm_triton(x, w, GemmLaunch(block_m=16, block_n=32, block_k=32, split_k=split))
    ref = x.double() @ w.double().T
    assert y.shape == (m, n) and y.dtype == x.dtype
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5)


def test_gemm_reads_strided_rows() -> None:
    x = torch.randn(6, 160)[:, 16:112]  # rows 160 apart, 96 columns
    w = torch.randn(40, 96)
    assert x.stride(0) == 160 and not x.is_contiguous()
    y = gemm_triton(x, w, GemmLaunch(block_m=16, block_n=32, block_k=32, split_k=2))
    assert y.shape == (6, 40)
    torch.testing.assert_close(y.double(), x.double() @ w.double().T, atol=1e-4, rtol=1e-5)


def test_gemm_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\]"):
        gemm_triton(torch.randn(4, 32), torch.randn(8, 16))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        gemm_triton(torch.randn(32, 4).T, torch.randn(8, 32))


def test_bench_smoke_mode_checks_every_config(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    from bench.bench_gemm import main

    monkeypatch.setattr("sys.argv", ["bench_gemm.py", "--smoke"])
    assert main() == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("smoke ")]
    assert len(lines) == 4 and all("rel err" in ln for ln in lines)
