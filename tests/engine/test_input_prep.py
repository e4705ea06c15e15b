"""Torch input prep against the token-by-token definition."""

from __future__ import annotations

import pytest

from engine.kernels.backend import TorchKernels
from tests.engine.input_prep_cases import make_case, outputs, python_reference


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("pad", [(0, 0), (5, 3)])
def test_torch_input_prep_matches_definition(seed: int, pad: tuple[int, int]) -> None:
    args, host = make_case(seed, *pad)
    TorchKernels().prepare_inputs(args)
    assert outputs(args) == python_reference(host)
