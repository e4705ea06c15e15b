"""The rejection sampler: verify drafts against the target, on the device.

Logits row ``l`` of a request is the target's distribution ``p_l`` for the token after query
token ``l``; for ``l < n - 1`` the draft there is ``d_{l+1}``, proposed from ``q_l``.

* greedy: accept ``d_{l+1}`` while it equals ``argmax p_l``; the first mismatch (or the last row)
  emits ``argmax p_l``. The output equals greedy decoding without speculation, token for token.
* probabilistic (Leviathan et al. / Chen et al.): accept ``d`` iff ``u_l < p_l(d) / q_l(d)``;
  at the first rejection emit a token from ``normalize(max(0, p_l - q_l))``; when every draft is
  accepted, the last row emits a bonus token from ``p_n-1``. Every emitted token is then
  distributed exactly as the target's ``p``. A proposer without a distribution (n-gram) has
  ``q = one_hot(d)``: accept iff ``u < p(d)``, recover from ``p`` with ``d`` removed.

All randomness is the sampler's stateless noise keyed by (request seed, position of the token):
``ACCEPT`` for ``u``, ``RECOVER`` for the recovered token's Gumbel noise, ``SAMPLE`` for the
bonus token (the plain sampler) and for the drafts themselves. A seeded request therefore gets the
same tokens in any batch *as long as the same drafts are verified at the same positions*: a token
verified as a draft (``ACCEPT``/``RECOVER`` noise) and one sampled plainly (``SAMPLE``) differ.
How many drafts a step verifies is the scheduler's choice: the token budget trims them, and with
async scheduling the placeholders of the step in flight count against the room left under
``max_tokens``, so near the end fewer drafts are verified than without. With speculation a seeded
request may thus differ between async on and off or between budgets (each output still distributed
exactly as ``p``); greedy output never differs (found by tests/engine/fuzz).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels.backend import KernelBackend
from engine.kernels.noise import NoiseStream, uniform_noise
from engine.sample.metadata import SamplingMetadata
from engine.sample.sampler import Sampler, apply_sampling_penalties, compute_probs

__all__ = [
    "RejectionSampler",
    "VerifyOutput",
    "acceptance_mask",
    "recovered_tokens",
    "row_layout",
]


@dataclass(frozen=True)
class VerifyOutput:
    """Device results of one verify.

    token_ids: [N] int64 per logits row: the accepted drafts, then the recovered or bonus token,
    then -1. num_accepted: [B] int64, accepted drafts per request (emitted = num_accepted + 1).
    """

    token_ids: torch.Tensor
    num_accepted: torch.Tensor


# stepscope: hot
def row_layout(cu_num_logits: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(request [N], local index [N])`` of every logits row, computed on the device."""
    cu = cu_num_logits.long()
    rows = torch.arange(num_rows, device=cu.device)
    req = torch.searchsorted(cu[1:], rows, right=True)
    return req, rows - cu[req]


# stepscope: hot
def acceptance_mask(
    target_probs: torch.Tensor,  # [N, V] p
    draft_probs: torch.Tensor | None,  # [N, V] q, None = one-hot at the draft
    draft_ids: torch.Tensor,  # [N] int64
    uniform: torch.Tensor,  # [N] f32 in (0, 1)
) -> torch.Tensor:
    """``u < p(d) / q(d)``, written ``u * q(d) < p(d)`` (no division). [N] bool."""
    p_d = target_probs.gather(1, draft_ids[:, None]).squeeze(1)
    if draft_probs is None:
        return uniform < p_d
    q_d = draft_probs.gather(1, draft_ids[:, None]).squeeze(1)
    return uniform * q_d < p_d


# stepscope: hot
def recovered_tokens(
    target_probs: torch.Tensor,  # [N, V]
    draft_probs: torch.Tensor | None,  # [N, V] or None (one-hot drafts)
    draft_ids: torch.Tensor,  # [N] int64
    seeds: torch.Tensor,  # [N] int64
    positions: torch.Tensor,  # [N] int64
    kernels: KernelBackend,
) -> torch.Tensor:
    """A token from ``normalize(max(0, p - q))`` per row (Gumbel-max, ``RECOVER`` noise). [N].

    Where the residual is empty (p == q up to rounding, so the draft cannot be rejected) the row
    falls back to ``p``.
    """
    if draft_probs is None:
        residual = target_probs.scatter(1, draft_ids[:, None], 0.0)
    else:
        residual = (target_probs - draft_probs).clamp(min=0.0)
    empty = residual.sum(dim=1, keepdim=True) <= 0
    residual = torch.where(empty, target_probs, residual)
    ones = torch.ones(residual.shape[0], dtype=torch.float32, device=residual.device)
    no_filter = torch.full_like(ones, float("-inf"))
    return kernels.gumbel_sample(
        torch.log(residual), ones, no_filter, seeds, positions, NoiseStream.RECOVER
    )


class RejectionSampler:
    """Verifies drafts for a whole batch; stateless (per-request state lives in ``meta``).
    Runs the kernels of ``sampler``'s backend."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.kernels = sampler.kernels

    # stepscope: hot
    def verify(
        self,
        logits: torch.Tensor,  # [N, V] f32, target logits of every logits row
        meta: SamplingMetadata,  # per logits row; positions = where each row's token goes
        draft_ids: torch.Tensor,  # [N] int64: row l's draft d_{l+1} (any valid id on last rows)
        draft_probs: torch.Tensor | None,  # [N, V] q per row, None = one-hot drafts
        cu_num_logits: torch.Tensor,  # [B + 1] int32
        max_rows_per_req: int,  # host int: 1 + the most drafts of any request
    ) -> VerifyOutput:
        """Accepted drafts + one recovered/bonus token per request; no host synchronisation."""
        if meta.all_greedy:
            # target: [N], the token greedy decoding would emit after each query token
            target = apply_sampling_penalties(logits, meta).argmax(dim=-1)
            accepted = draft_ids == target
            fallback = target
        else:
            probs = compute_probs(logits, meta)  # [N, V]
            u = uniform_noise(meta.seeds, meta.positions, 1, NoiseStream.ACCEPT)[:, 0]
            accepted = acceptance_mask(probs, draft_probs, draft_ids, u)
            recovered = recovered_tokens(
                probs, draft_probs, draft_ids, meta.seeds, meta.positions, self.kernels
            )
            bonus = self.sampler.sample(logits, _without_logprobs(meta)).sampled_token_ids
            _, last = _last_rows(cu_num_logits, logits.shape[0])
            fallback = torch.where(last, bonus, recovered)
        out, num_accepted = self.kernels.rejection_scan(
            cu_num_logits, draft_ids, accepted, fallback, max_rows_per_req
        )
        return VerifyOutput(token_ids=out, num_accepted=num_accepted)


def _last_rows(cu_num_logits: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    req, local = row_layout(cu_num_logits, num_rows)
    cu = cu_num_logits.long()
    return req, local == cu[req + 1] - cu[req] - 1


def _without_logprobs(meta: SamplingMetadata) -> SamplingMetadata:
    if meta.max_num_logprobs is None:
        return meta
    import dataclasses

    return dataclasses.replace(meta, max_num_logprobs=None)
