"""Split-vocab sampling kernels (TRITON_INTERPRET=1) against the torch references and the
one-program-per-row kernels: a 1000-token vocab in chunks of 128 (8 chunks, the last one ragged,
104 tokens), greedy with ties within and across chunks, seeded random sampling with and without
filters, every noise stream, bf16 logits, logsumexp, and the backend's dispatch."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels import sampling as sk  # noqa: E402
from engine.kernels import sampling_split as ss  # noqa: E402
from engine.kernels.backend import TorchKernels, TritonKernels  # noqa: E402
from engine.kernels.noise import NoiseStream  # noqa: E402
from engine.sample.metadata import build_sampling_metadata  # noqa: E402
from engine.sample.sampler import Sampler  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton interpreter tests run without CUDA"
)

VOCAB, CHUNK, BLOCK = 1000, 128, 64
ROWS, MAX_LEN = 12, 16  # state rows (the last one is trash) and token-row length
NEG_INF = float("-inf")


def _greedy_ties(dtype: torch.dtype) -> torch.Tensor:
    """Rows whose maximum is tied, within a chunk, across chunks, across a chunk boundary, in
    the ragged last chunk, or everywhere (-inf rows: token 0, as torch.argmax)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(9, VOCAB, generator=gen)
    ties = {
        0: [130, 900],  # two chunks: the first wins
        1: [127, 128],  # either side of a chunk boundary
        2: [40, 41, 999],  # within chunk 0 and in the ragged last chunk
        3: [999],  # the maximum in the ragged last chunk alone
        4: [512, 640, 768],  # first positions of three chunks
    }
    for row, cols in ties.items():
        logits[row, cols] = 9.0
    logits[5] = 0.0  # one value everywhere: token 0
    logits[6] = NEG_INF  # nothing finite: token 0
    logits[7, :896] = NEG_INF  # only the last chunk finite
    logits[8] = torch.round(logits[8])  # many ties among few values
    return logits.to(dtype)


def _commit_args(logits: torch.Tensor, temperature: torch.Tensor, seed: int, all_greedy: bool):
    gen = torch.Generator().manual_seed(seed)
    n = logits.shape[0]
    logit_rows = torch.randperm(ROWS - 1, generator=gen)[:n].to(torch.int32)
    commit_rows = logit_rows.clone()
    commit_rows[1:2] = ROWS - 1  # a discarded sample goes to the trash row
    table = torch.zeros(ROWS, 6)  # the state table's f32 columns; temperature is column 0
    table[logit_rows.long(), 0] = temperature
    seeds = torch.randint(0, 2**62, (ROWS, 1), generator=gen)
    return sk.SampleCommitArgs(
        logits=logits,
        logit_rows=logit_rows,
        commit_rows=commit_rows,
        logits_indices=torch.randperm(2 * n, generator=gen)[:n],
        positions=torch.randint(0, MAX_LEN + 3, (2 * n,), generator=gen),  # some past the row
        temperature=table[:, 0],  # strided, as the runner passes it
        seeds=seeds[:, 0],
        keep_threshold=None,
        last_sampled=torch.full((ROWS,), -5, dtype=torch.int64),
        token_ids=torch.full((ROWS, MAX_LEN), -5, dtype=torch.int64),
        all_greedy=all_greedy,
    )


def _fresh(a: sk.SampleCommitArgs) -> sk.SampleCommitArgs:
    return dataclasses.replace(
        a, last_sampled=a.last_sampled.clone(), token_ids=a.token_ids.clone()
    )


def _check_commit(a: sk.SampleCommitArgs, run) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """``run``'s tokens and commit equal the torch reference's and the per-row kernel's."""
    want_args, old_args, got_args = _fresh(a), _fresh(a), _fresh(a)
    want = sk.sample_commit_torch(want_args)
    old = sk.sample_commit_triton(old_args, block=256)
    got = run(got_args)
    assert got.dtype == torch.int64
    assert torch.equal(got, want) and torch.equal(old, want)
    trash = ROWS - 1  # several discarded samples may race for the trash row: compare the rest
    assert torch.equal(got_args.last_sampled[:trash], want_args.last_sampled[:trash])
    assert torch.equal(got_args.token_ids[:trash], want_args.token_ids[:trash])
    return got


def _split_commit(a: sk.SampleCommitArgs) -> torch.Tensor:
    return ss.sample_commit_split_triton(a, chunk=CHUNK, block=BLOCK)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ties_take_the_lowest_index(dtype: torch.dtype) -> None:
    logits = _greedy_ties(dtype)
    a = _commit_args(logits, torch.zeros(logits.shape[0]), seed=0, all_greedy=True)
    got = _check_commit(a, _split_commit)
    assert got[:8].tolist() == [130, 127, 40, 999, 512, 0, 0, int(logits[7].float().argmax())]


@pytest.mark.parametrize("seed", [0, 1])
def test_random_sampling_matches_per_seed(seed: int) -> None:
    # Greedy rows (T = 0, with ties) ride in a random batch, as in a mixed workload.
    gen = torch.Generator().manual_seed(100 + seed)
    logits = torch.cat([torch.randn(4, VOCAB, generator=gen) * 2, _greedy_ties(torch.float32)[:2]])
    temperature = torch.tensor([1.0, 0.7, 1.5, 0.3, 0.0, 0.0])
    a = _commit_args(logits, temperature, seed=seed, all_greedy=False)
    got = _check_commit(a, _split_commit)
    assert got[4:].tolist() == [130, 127]


@pytest.mark.parametrize("seed", [0])
def test_filtered_sampling_matches_per_seed(seed: int) -> None:
    gen = torch.Generator().manual_seed(200 + seed)
    logits = torch.randn(6, VOCAB, generator=gen) * 3
    temperature = torch.tensor([1.0, 0.7, 1.5, 0.0, 1.0, 0.5])  # row 3 greedy: filters ignored
    # Thresholds in scaled-logit units: a few dozen tokens kept, one row keeping only its max.
    scaled = logits / torch.where(temperature == 0, 1.0, temperature)[:, None]
    threshold = torch.quantile(scaled, 0.97, dim=1)
    threshold[4] = scaled[4].max()
    threshold[5] = NEG_INF
    a = dataclasses.replace(
        _commit_args(logits, temperature, seed=seed, all_greedy=False), keep_threshold=threshold
    )
    got = _check_commit(a, _split_commit)
    assert int(got[4]) == int(scaled[4].argmax())


@pytest.mark.parametrize(
    ("stream", "dtype"), [(s, torch.float32) for s in NoiseStream] + [(0, torch.bfloat16)]
)
def test_gumbel_sample_matches_torch(stream: NoiseStream, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(int(stream))
    logits = (torch.randn(5, VOCAB, generator=gen) * 2).to(dtype)
    logits[4] = 0.0  # flat at T = 1: the token is the argmax of the noise itself
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.5, 1.0])
    threshold = torch.tensor([NEG_INF, 0.5, 0.0, -1.0, NEG_INF])
    seeds = torch.randint(0, 2**62, (5,), generator=gen)
    positions = torch.randint(0, 2**34, (5,), generator=gen)
    args = (logits, temperature, threshold, seeds, positions, stream)
    want = sk.gumbel_sample_torch(*args)
    got = ss.gumbel_sample_split_triton(*args, chunk=CHUNK, block=BLOCK)
    assert torch.equal(got, want)


def test_row_logsumexp_matches_torch() -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(5, VOCAB, generator=gen) * 4
    logits[1] = NEG_INF  # nothing finite: -inf
    logits[2, 128:] = NEG_INF  # only the first chunk finite
    logits[3, :900] = NEG_INF  # only part of the ragged last chunk finite
    logits[4, 300] = 80.0  # one dominant value
    got = ss.row_logsumexp_split_triton(logits, chunk=CHUNK, block=BLOCK)
    want = torch.logsumexp(logits.double(), dim=-1).float()
    assert got.shape == (5,) and got[1].item() == NEG_INF  # an all -inf row stays -inf, not NaN
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)


def test_backend_dispatches_by_vocab() -> None:
    """The backend runs the split path when the vocab has more than one chunk (V = 1000, chunk
    128) and the per-row kernel otherwise (chunk 1024): the same tokens either way."""
    assert ss.split_applies(VOCAB, CHUNK) and not ss.split_applies(VOCAB, 1024)
    logits = _greedy_ties(torch.float32)[:4]
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.5])
    a = _commit_args(logits, temperature, seed=3, all_greedy=False)
    want = sk.sample_commit_torch(_fresh(a))
    for chunk in (CHUNK, 1024):
        assert torch.equal(TritonKernels(split_chunk=chunk).sample_commit(_fresh(a)), want)
    lse = TritonKernels(split_chunk=CHUNK).row_logsumexp(logits)
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1), atol=1e-5, rtol=1e-6)


def test_zero_rows_and_one_chunk() -> None:
    empty = _commit_args(torch.zeros(0, VOCAB), torch.zeros(0), seed=0, all_greedy=True)
    assert ss.sample_commit_split_triton(empty, chunk=CHUNK, block=BLOCK).shape == (0,)
    small = _commit_args(_greedy_ties(torch.float32)[:, :100], torch.zeros(9), 0, True)
    _check_commit(small, _split_commit)  # V < chunk: one (ragged) chunk per row


@pytest.mark.parametrize(("chunk", "block"), [(100, 32), (128, 48), (8, 8)])
def test_bad_launch_constants_are_refused(chunk: int, block: int) -> None:
    a = _commit_args(torch.zeros(2, VOCAB), torch.zeros(2), seed=0, all_greedy=True)
    with pytest.raises(ValueError, match="power of two"):
        ss.sample_commit_split_triton(a, chunk=chunk, block=block)
    with pytest.raises(ValueError, match="power of two"):
        TritonKernels(split_chunk=chunk if chunk != 128 else 96)


def test_sampler_on_the_split_path_matches_torch() -> None:
    """The sampler's penalised path (gumbel_sample) and logprobs (row_logsumexp) through the
    backend's split kernels: the torch backend's tokens and logprobs."""
    params = [
        SamplingParams(temperature=0.8, seed=1, logprobs=3),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.1, top_k=40, top_p=0.9, seed=3),
        SamplingParams(temperature=1.0, min_p=0.01, repetition_penalty=1.2, seed=4),
    ]
    meta = build_sampling_metadata(
        params, positions=[3, 4, 5, 6], vocab_size=VOCAB, default_seeds=[9] * 4
    )
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(11)) * 3
    want = Sampler(TorchKernels()).sample(logits, meta)
    got = Sampler(TritonKernels(split_chunk=CHUNK)).sample(logits, meta)
    assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
    assert torch.equal(got.logprob_token_ids, want.logprob_token_ids)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)


def test_split_path_is_capturable() -> None:
    """No host data goes in and no device value comes out (engine/runner/capture_guard.py): the
    split path may run inside a captured graph (spec verify's, with logprobs)."""
    from engine.runner.capture_guard import HostDataGuard

    a = _commit_args(_greedy_ties(torch.float32)[:3], torch.tensor([0.0, 0.5, 1.0]), 0, False)
    temperature, seeds = torch.ones(3), torch.arange(3)
    registered = [getattr(a, f.name) for f in dataclasses.fields(a)]
    registered = [t for t in registered if isinstance(t, torch.Tensor)] + [temperature, seeds]
    with HostDataGuard(registered) as guard:
        ss.sample_commit_split_triton(a, chunk=CHUNK, block=BLOCK)
        ss.gumbel_sample_split_triton(
            a.logits, temperature, temperature, seeds, seeds, chunk=CHUNK, block=BLOCK
        )
        ss.row_logsumexp_split_triton(a.logits, chunk=CHUNK, block=BLOCK)
    assert guard.num_ops > 0 and guard.violations == []
