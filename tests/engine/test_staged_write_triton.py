"""The Triton staged-write kernel (interpreted on the CPU) against the torch reference."""

from __future__ import annotations

# TRITON_INTERPRET is set by tests/conftest.py when there is no CUDA device.
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from engine.kernels.staged_write import (  # noqa: E402
    HAS_TRITON,
    apply_staged_writes_torch,
    apply_staged_writes_triton,
)

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
def test_triton_matches_torch(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(1)
    num_rows, num_cols = 6, 300  # writes longer than one 128-wide block
    rows = rng.choice(num_rows, size=4, replace=False)
    starts = rng.integers(0, 100, size=4)
    lengths = rng.integers(1, 200, size=4)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values = torch.tensor(rng.integers(-500, 500, size=int(offsets[-1]) + 3), dtype=dtype)
    args = [torch.tensor(a, dtype=torch.int32) for a in (rows, starts, offsets)]
    expected = torch.full((num_rows, num_cols), 7, dtype=dtype)
    actual = expected.clone()
    apply_staged_writes_torch(expected, *args, values, num_values=int(offsets[-1]))
    apply_staged_writes_triton(actual, *args, values, max_len=int(lengths.max()))
    assert torch.equal(actual, expected)
    assert not torch.equal(expected, torch.full_like(expected, 7))
