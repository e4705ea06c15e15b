"""Sampling on a CUDA device: compiled Triton kernels vs torch, batch invariance, no host sync."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.backend import create_kernel_backend
from engine.kernels.sampling import (
    gumbel_sample_torch,
    gumbel_sample_triton,
    row_logsumexp_torch,
    row_logsumexp_triton,
)
from engine.sample.metadata import build_sampling_metadata
from engine.sample.sampler import Sampler
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

VOCAB = 32_000


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")


def test_compiled_kernels_match_torch_on_cuda() -> None:
    _require_cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = 256
    logits = torch.randn(rows, VOCAB, device="cuda", generator=gen) * 3
    temperature = torch.rand(rows, device="cuda", generator=gen) + 0.2
    temperature[::7] = 0.0
    threshold = torch.full((rows,), float("-inf"), device="cuda")
    threshold[::3] = 4.0
    seeds = torch.randint(0, 2**62, (rows,), device="cuda", generator=gen)
    positions = torch.arange(rows, device="cuda")
    expected = gumbel_sample_torch(logits, temperature, threshold, seeds, positions)
    got = gumbel_sample_triton(logits, temperature, threshold, seeds, positions)
    # The device's log may differ from torch's by an ulp; a flip needs a near tie, so allow
    # at most one row in 256.
    assert (got != expected).sum().item() <= 1
    torch.testing.assert_close(
        row_logsumexp_triton(logits), row_logsumexp_torch(logits), atol=1e-4, rtol=1e-6
    )


@pytest.mark.parametrize("use_triton", [False, True])
def test_batch_invariant_and_sync_free_on_cuda(use_triton: bool) -> None:
    _require_cuda()
    params = [
        SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=i, logprobs=5) for i in range(8)
    ]
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(8, VOCAB, device="cuda", generator=gen)
    sampler = Sampler(create_kernel_backend("triton" if use_triton else "torch"))

    def run(rows: list[int]) -> torch.Tensor:
        meta = build_sampling_metadata(
            [params[r] for r in rows], [100 + r for r in rows], vocab_size=VOCAB, device="cuda"
        )
        batch_logits = logits[rows]
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = sampler.sample(batch_logits, meta)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return out.sampled_token_ids

    full = run(list(range(8)))
    for rows in ([3], [7, 0, 5], [6, 5, 4, 3, 2, 1, 0]):
        assert torch.equal(run(rows), full[rows])


def test_split_vocab_kernels_match_per_row_kernels_on_cuda() -> None:
    """The split-vocab kernels (engine/kernels/sampling_split.py) at the Qwen3 vocab: the same
    tokens as the per-row kernel, bit for bit (both score with the same compiled code), bf16
    logits included; logsumexp within fp32 rounding."""
    _require_cuda()
    from engine.kernels.sampling_split import gumbel_sample_split_triton, row_logsumexp_split_triton

    gen = torch.Generator(device="cuda").manual_seed(2)
    rows, vocab = 256, 151_936
    temperature = torch.rand(rows, device="cuda", generator=gen) + 0.2
    temperature[::5] = 0.0
    threshold = torch.full((rows,), float("-inf"), device="cuda")
    threshold[1::4] = 3.0
    seeds = torch.randint(0, 2**62, (rows,), device="cuda", generator=gen)
    positions = torch.randint(0, 2**20, (rows,), device="cuda", generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 3).to(dtype)
        args = (logits, temperature, threshold, seeds, positions)
        assert torch.equal(gumbel_sample_split_triton(*args), gumbel_sample_triton(*args))
    torch.testing.assert_close(
        row_logsumexp_split_triton(logits),
        row_logsumexp_torch(logits.float()),
        atol=1e-4,
        rtol=1e-6,
    )
