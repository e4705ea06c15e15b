"""Applying the packed token bitmask: the torch reference against a plain per-token loop, and the
Triton kernel (TRITON_INTERPRET=1, tiny shapes) against the torch reference."""

from __future__ import annotations

import os

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.kernels.backend import TorchKernels, create_kernel_backend  # noqa: E402
from engine.kernels.bitmask import (  # noqa: E402
    apply_token_bitmask_torch,
    num_bitmask_words,
)

# tests/conftest.py sets TRITON_INTERPRET=1 (before any import) when there is no CUDA device;
# on a CUDA machine these interpreter tests are skipped (the GPU tests run the compiled kernels).
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton interpreter tests run without CUDA"
)


def _case(num_rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=g)
    words = num_bitmask_words(vocab)
    bitmask = torch.randint(-(2**31), 2**31, (num_rows, words), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[0] = -1  # a free row: nothing masked
    return logits, bitmask


def _loop_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for i in range(logits.shape[0]):
        for v in range(logits.shape[1]):
            word = int(bitmask[i, v // 32]) & 0xFFFFFFFF
            if not (word >> (v % 32)) & 1:
                out[i, v] = float("-inf")
    return out


@pytest.mark.parametrize(("num_rows", "vocab"), [(3, 70), (2, 64), (4, 33)])
def test_torch_reference_matches_a_loop(num_rows: int, vocab: int) -> None:
    logits, bitmask = _case(num_rows, vocab, seed=vocab)
    expected = _loop_reference(logits, bitmask)
    got = TorchKernels().apply_token_bitmask(logits.clone(), bitmask)
    assert torch.equal(got, expected)
    assert torch.isfinite(got[0]).all()  # the all-ones row is untouched
    assert torch.isinf(got).any()  # and the random rows do mask something


def test_wrong_width_is_refused() -> None:
    with pytest.raises(ValueError, match="words per row"):
        TorchKernels().apply_token_bitmask(torch.zeros(1, 70), torch.zeros(1, 2, dtype=torch.int32))


@interpreted
@pytest.mark.parametrize(("num_rows", "vocab"), [(3, 70), (2, 1100)])
def test_triton_matches_torch(num_rows: int, vocab: int) -> None:
    pytest.importorskip("triton")
    logits, bitmask = _case(num_rows, vocab, seed=1)
    expected = apply_token_bitmask_torch(logits.clone(), bitmask)
    # a taller bitmask buffer, as the runner's persistent one: only the first rows are read
    tall = torch.cat([bitmask, torch.zeros(2, bitmask.shape[1], dtype=torch.int32)])
    got = create_kernel_backend("triton").apply_token_bitmask(logits.clone(), tall)
    assert torch.equal(got, expected)
