"""Rejection sampler: greedy semantics against a plain loop, and distribution preservation of
probabilistic verification (chi-square over many seeded requests against the exact target law),
including a deliberately broken acceptance rule that the same test must catch."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.backend import TorchKernels
from engine.kernels.noise import NoiseStream, uniform_noise
from engine.sample.metadata import build_sampling_metadata
from engine.sample.sampler import Sampler, compute_probs
from engine.sampling_params import SamplingParams
from engine.spec.proposer import sample_drafts
from engine.spec.rejection import RejectionSampler, acceptance_mask, recovered_tokens
from tests.engine.test_sampler import P_THRESHOLD, chi_square_p_value

VOCAB = 6
NUM_REQS = 20_000
K = 2  # drafts per request: 3 logits rows each
# Target logits of the rows after the first, second and third query token (context-free, so the
# law of each emitted token is known exactly) and the draft law of the two drafts.
TARGET = torch.tensor(
    [[1.0, 0.2, -0.5, 2.0, 0.0, -1.0], [0.0, 1.5, 0.3, -0.7, 0.9, 0.1], [0.5] * VOCAB]
)
DRAFT = torch.tensor([[0.3, 0.3, 0.1, 0.1, 0.1, 0.1], [0.05, 0.1, 0.5, 0.05, 0.2, 0.1]])


def _batch(num_reqs: int, first_seed: int = 0):
    """Metadata, drafts and their law for ``num_reqs`` requests of K drafts, one seed each."""
    seeds = torch.arange(first_seed, first_seed + num_reqs)
    base = 10 + seeds % 50  # the position of each request's last verified token
    params = [SamplingParams(temperature=1.0, seed=int(s)) for s in seeds]
    positions = (base[:, None] + 1 + torch.arange(K + 1)).reshape(-1)  # [N]
    meta = build_sampling_metadata(
        [p for p in params for _ in range(K + 1)], positions.tolist(), vocab_size=VOCAB
    )
    drafts, laws = [], []
    for j in range(K):
        log_q = DRAFT[j].log().expand(num_reqs, VOCAB)
        ids, q = sample_drafts(
            log_q, torch.ones(num_reqs), seeds, base + 1 + j, False, TorchKernels()
        )
        drafts.append(ids)
        laws.append(q)
    draft_ids = torch.stack(drafts + [torch.zeros_like(drafts[0])], 1).reshape(-1)  # [N]
    draft_probs = torch.stack(laws + [torch.ones_like(laws[0]) / VOCAB], 1).reshape(-1, VOCAB)
    cu = torch.arange(0, (K + 1) * num_reqs + 1, K + 1, dtype=torch.int32)
    logits = TARGET.repeat(num_reqs, 1)  # [N, V]
    return logits, meta, draft_ids, draft_probs, cu


def _target_law(row: int) -> list[float]:
    return torch.softmax(TARGET[row].double(), 0).tolist()


def _emitted(tokens: torch.Tensor, num_accepted: torch.Tensor, position: int) -> torch.Tensor:
    """Histogram of the ``position``-th emitted token over requests that emitted it."""
    rows = tokens.view(-1, K + 1)
    has = num_accepted >= position
    return torch.bincount(rows[has, position], minlength=VOCAB)


@pytest.mark.parametrize("use_draft_probs", [True, False])
def test_probabilistic_verify_preserves_the_target_distribution(use_draft_probs):
    logits, meta, draft_ids, draft_probs, cu = _batch(NUM_REQS)
    if not use_draft_probs:  # n-gram style: fixed drafts, q = one-hot at them
        draft_ids = torch.tensor([3, 1, 0]).repeat(NUM_REQS)
        draft_probs = None
    out = RejectionSampler(Sampler()).verify(logits, meta, draft_ids, draft_probs, cu, K + 1)
    assert int(out.num_accepted.sum()) > NUM_REQS // 4  # drafts really got accepted
    for position in range(K + 1):  # first, second and third emitted token
        counts = _emitted(out.token_ids, out.num_accepted, position)
        assert counts.sum() > 1000
        assert chi_square_p_value(counts, _target_law(position)) > P_THRESHOLD


def test_broken_rejection_rule_is_caught():
    """The classic bug: accept with u < p(d)/q(d) but, on rejection, sample from p instead of
    normalize(max(0, p - q)). The emitted law drifts toward q and the same test must see it."""
    logits, meta, draft_ids, draft_probs, cu = _batch(NUM_REQS)
    p = compute_probs(logits, meta)
    u = uniform_noise(meta.seeds, meta.positions, 1, NoiseStream.ACCEPT)[:, 0]
    accepted = acceptance_mask(p, draft_probs, draft_ids, u)
    no_q = torch.zeros_like(p)  # the bug: the residual p - q becomes p
    recovered = recovered_tokens(p, no_q, draft_ids, meta.seeds, meta.positions, TorchKernels())
    bonus = Sampler().sample(logits, meta).sampled_token_ids
    last = (torch.arange(logits.shape[0]) % (K + 1)) == K
    fallback = torch.where(last, bonus, recovered)
    tokens, num_accepted = TorchKernels().rejection_scan(cu, draft_ids, accepted, fallback, K + 1)
    counts = _emitted(tokens, num_accepted, 0)
    assert chi_square_p_value(counts, _target_law(0)) < 1e-6


def test_seeded_verify_is_batch_invariant():
    logits, meta, draft_ids, draft_probs, cu = _batch(64)
    full = RejectionSampler(Sampler()).verify(logits, meta, draft_ids, draft_probs, cu, K + 1)
    # the same requests 10..19 on their own
    lo, hi = 10 * (K + 1), 20 * (K + 1)
    sub_logits, sub_meta, sub_drafts, sub_probs, sub_cu = _batch(10, first_seed=10)
    assert torch.equal(sub_drafts, draft_ids[lo:hi])
    part = RejectionSampler(Sampler()).verify(
        sub_logits, sub_meta, sub_drafts, sub_probs, sub_cu, K + 1
    )
    assert torch.equal(part.token_ids, full.token_ids[lo:hi])
    assert torch.equal(part.num_accepted, full.num_accepted[10:20])


def _greedy_reference(logits, drafts_per_req):
    """Accept while the draft equals the target argmax; then emit the argmax."""
    out, start = [], 0
    for drafts in drafts_per_req:
        n = len(drafts) + 1
        target = logits[start : start + n].argmax(-1).tolist()
        emitted = []
        for i in range(n):
            emitted.append(target[i])
            if i == n - 1 or drafts[i] != target[i]:
                break
        out.append(emitted)
        start += n
    return out


def test_greedy_verify_matches_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    num_drafts = [0, 3, 1, 4, 2, 3]
    logits = torch.randn(sum(num_drafts) + len(num_drafts), 5, generator=g)
    targets = logits.argmax(-1)
    drafts_per_req, draft_rows, start = [], [], 0
    for n in num_drafts:  # drafts agree with the target for a random prefix, then diverge
        agree = int(torch.randint(0, n + 1, (1,), generator=g))
        drafts = [int(targets[start + i]) if i < agree else (int(targets[start + i]) + 1) % 5
                  for i in range(n)]  # fmt: skip
        drafts_per_req.append(drafts)
        draft_rows += drafts + [0]
        start += n + 1
    cu = torch.tensor(
        [0] + torch.cumsum(torch.tensor(num_drafts) + 1, 0).tolist(), dtype=torch.int32
    )
    params = [SamplingParams(temperature=0.0)] * logits.shape[0]
    meta = build_sampling_metadata(
        params, [0] * logits.shape[0], vocab_size=5, default_seeds=[0] * logits.shape[0]
    )
    out = RejectionSampler(Sampler()).verify(
        logits, meta, torch.tensor(draft_rows), None, cu, max(num_drafts) + 1
    )
    expected = _greedy_reference(logits, drafts_per_req)
    got = [
        t[t >= 0].tolist()
        for t in torch.split(out.token_ids, (torch.tensor(num_drafts) + 1).tolist())
    ]
    assert got == expected
    assert out.num_accepted.tolist() == [len(e) - 1 for e in expected]
