"""Sampling Triton kernels under TRITON_INTERPRET=1 against their torch references."""

from __future__ import annotations

import os

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from engine.kernels import sampling as sampling_kernels  # noqa: E402
from engine.kernels.backend import create_kernel_backend  # noqa: E402
from engine.kernels.noise import NoiseStream, uniform_noise  # noqa: E402
from engine.sample.metadata import build_sampling_metadata  # noqa: E402
from engine.sample.sampler import Sampler  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

# tests/conftest.py sets TRITON_INTERPRET=1 (before any import) when there is no CUDA device;
# on a CUDA machine these interpreter tests are skipped (the GPU tests run the compiled kernels).
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton interpreter tests run without CUDA"
)


NUM_ROWS = 6
VOCAB = 37  # not a multiple of the block: exercises the tail mask


def inputs(seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(NUM_ROWS, VOCAB, generator=gen) * 2
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.5, 0.3, 1.0])
    threshold = torch.tensor([float("-inf"), 0.5, 0.0, -1.0, float("-inf"), 1.0])
    seeds = torch.randint(0, 2**62, (NUM_ROWS,), generator=gen)
    positions = torch.randint(0, 5000, (NUM_ROWS,), generator=gen)
    return logits, temperature, threshold, seeds, positions


@interpreted
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gumbel_sample_triton_matches_torch(seed: int) -> None:
    args = inputs(seed)
    expected = sampling_kernels.gumbel_sample_torch(*args)
    got = sampling_kernels.gumbel_sample_triton(*args, block=16)
    assert got.dtype == torch.int64
    assert torch.equal(got, expected)


@interpreted
@pytest.mark.parametrize("stream", list(NoiseStream))
def test_triton_noise_hash_matches_torch(stream: NoiseStream) -> None:
    # Flat logits at T = 1: the token is argmax_v u_v, so every row checks the in-kernel hash.
    seeds = torch.arange(48, dtype=torch.int64) * 1_000_003 + 2**40
    seeds[-1] = 2**63 - 1
    positions = torch.arange(48, dtype=torch.int64) * 31 + 2**33 * (torch.arange(48) % 2)
    logits = torch.zeros(48, VOCAB)
    ones = torch.ones(48)
    no_threshold = torch.full((48,), float("-inf"))
    got = sampling_kernels.gumbel_sample_triton(
        logits, ones, no_threshold, seeds, positions, stream, block=16
    )
    expected = uniform_noise(seeds, positions, VOCAB, stream).argmax(-1)
    assert torch.equal(got, expected)


@interpreted
def test_row_logsumexp_triton_matches_torch() -> None:
    logits, *_ = inputs(3)
    logits[2, :] = float("-inf")
    logits[3, 5:] = float("-inf")
    got = sampling_kernels.row_logsumexp_triton(logits, block=16)
    torch.testing.assert_close(
        got, sampling_kernels.row_logsumexp_torch(logits), atol=1e-5, rtol=1e-6
    )


@interpreted
def test_sampler_triton_path_matches_torch_path() -> None:
    params = [
        SamplingParams(temperature=0.8, seed=1, logprobs=2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.1, top_k=4, top_p=0.9, seed=3),
        SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.2, seed=4),
    ]
    meta = build_sampling_metadata(
        params, positions=[3, 4, 5, 6], vocab_size=VOCAB, default_seeds=[9] * 4
    )
    logits = inputs(4)[0][:4]
    torch_out = Sampler(create_kernel_backend("torch")).sample(logits, meta)
    triton_out = Sampler(create_kernel_backend("triton")).sample(logits, meta)
    assert torch.equal(torch_out.sampled_token_ids, triton_out.sampled_token_ids)
    assert torch.equal(torch_out.logprob_token_ids, triton_out.logprob_token_ids)
    torch.testing.assert_close(torch_out.logprobs, triton_out.logprobs, atol=1e-5, rtol=0)
