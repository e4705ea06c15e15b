"""Top-k logprobs against torch.log_softmax in float64; chunked prompt logprobs == unchunked."""

from __future__ import annotations

import pytest
import torch

from engine.sample.logprobs import compute_topk_logprobs, prompt_logprobs_chunked


def random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * 4


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_topk_logprobs_match_float64_log_softmax(k: int) -> None:
    logits = random_logits(7, 300, seed=k)
    token_ids = torch.tensor([0, 5, 299, 17, 100, 3, 250], dtype=torch.int64)
    out = compute_topk_logprobs(logits, k, token_ids)
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert out.token_ids.shape == (7, k + 1) and out.logprobs.dtype == torch.float32
    assert torch.equal(out.token_ids[:, 0], token_ids)
    top = torch.topk(reference, k, dim=-1)
    assert torch.equal(out.token_ids[:, 1:], top.indices)
    torch.testing.assert_close(
        out.logprobs.double(), reference.gather(1, out.token_ids), atol=2e-5, rtol=0
    )
    expected_rank = (reference > reference.gather(1, token_ids[:, None])).sum(-1) + 1
    assert torch.equal(out.ranks, expected_rank)


def test_rank_of_the_top_token_is_one() -> None:
    logits = random_logits(3, 50, seed=1)
    out = compute_topk_logprobs(logits, 2, logits.argmax(-1))
    assert torch.equal(out.ranks, torch.ones(3, dtype=torch.int64))
    assert torch.equal(out.token_ids[:, 0], out.token_ids[:, 1])


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 64])
def test_prompt_logprobs_chunked_equals_unchunked(chunk_size: int) -> None:
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(23, 16, generator=gen)
    lm_head = torch.randn(16, 40, generator=gen)
    targets = torch.randint(0, 40, (23,), generator=gen)
    # logits: [23, 40]; the producer slices it, so chunking is the only difference.
    logits = hidden @ lm_head
    calls: list[int] = []

    def logits_fn(start: int, end: int) -> torch.Tensor:
        calls.append(end - start)
        return logits[start:end].clone()

    chunked = prompt_logprobs_chunked(logits_fn, targets, 3, chunk_size)
    full = compute_topk_logprobs(logits, 3, targets)
    assert max(calls) <= chunk_size and sum(calls) == 23
    assert torch.equal(chunked.token_ids, full.token_ids)
    torch.testing.assert_close(chunked.logprobs, full.logprobs, atol=1e-6, rtol=0)
    assert torch.equal(chunked.ranks, full.ranks)


def test_prompt_logprobs_of_no_tokens() -> None:
    out = prompt_logprobs_chunked(
        lambda s, e: torch.zeros(e - s, 8), torch.zeros(0, dtype=torch.int64), 2, 4
    )
    assert out.token_ids.shape == (0, 3) and out.ranks.shape == (0,)
