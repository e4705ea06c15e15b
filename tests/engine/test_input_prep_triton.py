"""The Triton input-prep kernel (interpreted on the CPU) against the definition."""

from __future__ import annotations

# TRITON_INTERPRET is set by tests/conftest.py when there is no CUDA device.
import pytest  # noqa: E402

from engine.kernels.backend import create_kernel_backend  # noqa: E402
from engine.kernels.input_prep import HAS_TRITON  # noqa: E402
from tests.engine.input_prep_cases import make_case, outputs, python_reference  # noqa: E402

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")


@pytest.mark.parametrize("seed", [0, 1])
def test_triton_input_prep_matches_definition(seed: int) -> None:
    args, host = make_case(seed, pad_tokens=3, pad_reqs=2)
    create_kernel_backend("triton").prepare_inputs(args)
    assert outputs(args) == python_reference(host)
