"""Sampler: batch invariance of seeded sampling, greedy, and chi-square goodness of fit of every
filter against the exact processed distribution computed in float64."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sample.metadata import SamplingMetadata, build_sampling_metadata
from engine.sample.sampler import Sampler, compute_probs, process_logits
from engine.sampling_params import SamplingParams

VOCAB = 24
NUM_DRAWS = 20_000
P_THRESHOLD = 1e-3


def reference_probs(logits: list[float], params: SamplingParams) -> list[float]:
    """Processed distribution in float64, written independently of the sampler:
    temperature, then top-k and min-p, then top-p over the renormalised remainder."""
    scaled = [x / params.temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda v: -scaled[v])
    keep = set(range(len(scaled)))
    if params.top_k > 0:
        kth = scaled[order[min(params.top_k, len(scaled)) - 1]]
        keep = {v for v in keep if scaled[v] >= kth}
    if params.min_p > 0:
        cutoff = max(scaled) + math.log(params.min_p)
        keep = {v for v in keep if scaled[v] >= cutoff}
    z = sum(math.exp(scaled[v]) for v in keep)
    if params.top_p < 1:
        mass, kept_p = 0.0, set()
        for v in order:
            if v in keep and mass < params.top_p:
                kept_p.add(v)
                mass += math.exp(scaled[v]) / z
        last = min(scaled[v] for v in kept_p)
        keep = {v for v in keep if scaled[v] >= last}
        z = sum(math.exp(scaled[v]) for v in keep)
    return [math.exp(scaled[v]) / z if v in keep else 0.0 for v in range(len(scaled))]


def chi_square_p_value(counts: torch.Tensor, probs: list[float]) -> float:
    """p-value of observed counts under probs; bins with expected < 5 are pooled.
    A draw of a zero-probability token gives p = 0."""
    expected = torch.tensor(probs, dtype=torch.float64) * counts.sum()
    counts = counts.double()
    if counts[expected == 0].sum() > 0:
        return 0.0
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small & (expected > 0)].sum()[None]])
    exp = torch.cat([expected[~small], expected[small & (expected > 0)].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor((obs.numel() - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(dof, stat / 2).item()


def draw_counts(logits: torch.Tensor, params: SamplingParams, first_seed: int = 0) -> torch.Tensor:
    """NUM_DRAWS samples of one logits row: every draw a different seed and position."""
    seeds = list(range(first_seed, first_seed + NUM_DRAWS))
    meta = build_sampling_metadata(
        [params] * NUM_DRAWS,
        positions=[s % 97 for s in seeds],
        vocab_size=VOCAB,
        default_seeds=seeds,
    )
    tokens = Sampler().sample(logits.expand(NUM_DRAWS, VOCAB), meta).sampled_token_ids
    return torch.bincount(tokens, minlength=VOCAB)


def make_logits(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, generator=gen) * 1.5


FILTER_CASES = {
    "temperature": SamplingParams(temperature=1.0),
    "hot": SamplingParams(temperature=1.7),
    "cold": SamplingParams(temperature=0.6),
    "top_k": SamplingParams(temperature=0.9, top_k=6),
    "top_p": SamplingParams(temperature=1.2, top_p=0.7),
    "min_p": SamplingParams(temperature=1.0, min_p=0.08),
    "all": SamplingParams(temperature=1.3, top_k=12, top_p=0.8, min_p=0.02),
}


@pytest.mark.parametrize("name", list(FILTER_CASES))
def test_sampling_matches_processed_distribution(name: str) -> None:
    params = FILTER_CASES[name]
    logits = make_logits(seed=len(name))
    probs = reference_probs(logits.double().tolist(), params)
    p_value = chi_square_p_value(draw_counts(logits, params), probs)
    assert p_value > P_THRESHOLD, f"{name}: p = {p_value:.2e}"


def test_chi_square_rejects_a_wrong_distribution() -> None:
    logits = make_logits(seed=1)
    counts = draw_counts(logits, SamplingParams(temperature=1.0))
    wrong = reference_probs(logits.double().tolist(), SamplingParams(temperature=1.15))
    assert chi_square_p_value(counts, wrong) < P_THRESHOLD
    dropped = reference_probs(logits.double().tolist(), SamplingParams(temperature=1.0, top_k=20))
    assert chi_square_p_value(counts, dropped) == 0.0


def test_compute_probs_matches_float64_reference() -> None:
    params = list(FILTER_CASES.values())
    logits = torch.stack([make_logits(seed=i) for i in range(len(params))])
    meta = build_sampling_metadata(
        params, positions=[0] * len(params), vocab_size=VOCAB, default_seeds=[0] * len(params)
    )
    probs = compute_probs(logits, meta)
    for row, p in enumerate(params):
        expected = torch.tensor(
            reference_probs(logits[row].double().tolist(), p), dtype=torch.float64
        )
        torch.testing.assert_close(probs[row].double(), expected, atol=1e-6, rtol=1e-5)
    processed = process_logits(logits, meta)
    assert torch.equal(torch.isinf(processed), probs == 0)


MIXED = [
    SamplingParams(temperature=0.7, seed=11),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.1, top_k=5, seed=12),
    SamplingParams(temperature=0.9, top_p=0.6, seed=13, logprobs=2),
    SamplingParams(temperature=1.0, min_p=0.05, seed=14),
    SamplingParams(temperature=1.2, repetition_penalty=1.3, frequency_penalty=0.4, seed=15),
    SamplingParams(temperature=0.5, top_k=8, top_p=0.9, presence_penalty=0.5, seed=16),
    SamplingParams(temperature=1.0, seed=17),
]


def mixed_batch(rows: list[int], logits: torch.Tensor, step: int) -> SamplingMetadata:
    return build_sampling_metadata(
        [MIXED[r] for r in rows],
        positions=[10 + r + step for r in rows],
        vocab_size=logits.shape[1],
        default_seeds=[1000 + r for r in rows],
        prompt_token_ids=[[r, r + 1, 7] for r in rows],
        output_token_ids=[[r % 3, 5, 5] for r in rows],
    )


def test_seeded_sampling_is_batch_invariant() -> None:
    gen = torch.Generator().manual_seed(3)
    # logits: [num_requests, vocab], one fixed row per request
    logits = torch.randn(len(MIXED), 64, generator=gen) * 2
    sampler = Sampler()
    for step in range(4):
        full = list(range(len(MIXED)))
        reference = sampler.sample(logits, mixed_batch(full, logits, step)).sampled_token_ids
        perm_gen = torch.Generator().manual_seed(step)
        for size in range(1, len(MIXED) + 1):
            rows = torch.randperm(len(MIXED), generator=perm_gen)[:size].tolist()
            out = sampler.sample(logits[rows], mixed_batch(rows, logits, step))
            assert torch.equal(out.sampled_token_ids, reference[rows]), (step, rows)


def test_different_positions_give_different_tokens() -> None:
    # A flat distribution: the same seed must not repeat its token at every position.
    params = [SamplingParams(temperature=1.0, seed=42)] * 64
    meta = build_sampling_metadata(params, positions=list(range(64)), vocab_size=VOCAB)
    tokens = Sampler().sample(torch.zeros(64, VOCAB), meta).sampled_token_ids
    assert len(set(tokens.tolist())) > 10


def test_greedy_is_argmax_of_penalised_logits() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 50, generator=gen)
    params = [SamplingParams(temperature=0.0)] * 3 + [
        SamplingParams(temperature=0.0, repetition_penalty=2.0, top_k=3)
    ] * 3
    prompts = [[int(logits[r].argmax())] for r in range(6)]
    meta = build_sampling_metadata(
        params, positions=[0] * 6, vocab_size=50, default_seeds=[0] * 6, prompt_token_ids=prompts
    )
    assert meta.all_greedy and not meta.no_penalties
    tokens = Sampler().sample(logits, meta).sampled_token_ids
    assert torch.equal(tokens[:3], logits[:3].argmax(-1))
    for r in range(3, 6):
        penalised = logits[r].double().clone()
        top = prompts[r][0]
        x = penalised[top]
        penalised[top] = x / 2.0 if x > 0 else x * 2.0
        assert tokens[r].item() == int(penalised.argmax())
    greedy_only = build_sampling_metadata(params[:3], [0] * 3, vocab_size=50, default_seeds=[0] * 3)
    assert greedy_only.all_greedy
    assert torch.equal(Sampler().sample(logits[:3], greedy_only).sampled_token_ids, tokens[:3])
    probs = compute_probs(logits[:3], greedy_only)
    assert torch.equal(probs.argmax(-1), tokens[:3]) and torch.equal(probs.sum(-1), torch.ones(3))


def test_sampled_logprobs_are_of_the_raw_distribution() -> None:
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(len(MIXED), 64, generator=gen)
    meta = mixed_batch(list(range(len(MIXED))), logits, 0)
    assert meta.max_num_logprobs == 2
    out = Sampler().sample(logits, meta)
    assert out.logprobs is not None and out.logprob_token_ids is not None
    raw = torch.log_softmax(logits.double(), dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    expected = raw.gather(1, out.logprob_token_ids)
    torch.testing.assert_close(out.logprobs.double(), expected, atol=1e-5, rtol=0)
