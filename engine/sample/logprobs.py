"""Top-k logprobs without a ``[num_tokens, vocab]`` logprob tensor.

log p_v = l_v - logsumexp(l), so a row needs only its logsumexp (one reduction), the top-k raw
logits (topk is order-preserving under the shift) and the logit of the token of interest. The
sampled token's rank is 1 + #{v : l_v > l_token}. Logprobs are of the raw model distribution,
before penalties, temperature and filtering (vLLM's default).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kernels.backend import KernelBackend, TorchKernels
from engine.sampling_params import MAX_LOGPROBS

__all__ = ["LogprobsTensors", "compute_topk_logprobs", "prompt_logprobs_chunked"]


@dataclass(frozen=True)
class LogprobsTensors:
    """Logprobs of N tokens. Column 0 is the token of interest (sampled or prompt target),
    columns 1..k the top-k tokens by probability, highest first.

    token_ids: [N, k+1] int64; logprobs: [N, k+1] f32; ranks: [N] int64 (1 = most likely).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor

    def __post_init__(self) -> None:
        if self.token_ids.shape != self.logprobs.shape or self.token_ids.dim() != 2:
            raise ValueError("token_ids and logprobs must both be [N, k+1]")
        if self.ranks.shape != self.token_ids.shape[:1]:
            raise ValueError("ranks must be [N]")


# stepscope: hot
def compute_topk_logprobs(
    logits: torch.Tensor,
    num_logprobs: int,
    token_ids: torch.Tensor,
    kernels: KernelBackend | None = None,
) -> LogprobsTensors:
    """Logprobs of ``token_ids`` and of the top ``num_logprobs`` tokens, per row.

    logits: [N, V] f32 raw logits; num_logprobs: host int in [0, 20]; token_ids: [N] int64.
    Memory beyond the inputs is O(N * k) plus one [N, V] bool temporary for the rank.
    ``kernels``: the engine's kernel backend (default: the torch references).
    """
    if not 0 <= num_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"num_logprobs must be in [0, {MAX_LOGPROBS}], got {num_logprobs}")
    # lse: [N]
    lse = (kernels or TorchKernels()).row_logsumexp(logits)
    token_ids = token_ids.to(torch.int64)
    # token_logit: [N, 1]
    token_logit = logits.gather(1, token_ids[:, None])
    ranks = (logits > token_logit).sum(dim=-1) + 1
    if num_logprobs > 0:
        top_logits, top_ids = torch.topk(logits, num_logprobs, dim=-1)
        ids = torch.cat([token_ids[:, None], top_ids], dim=1)
        selected = torch.cat([token_logit, top_logits], dim=1)
    else:
        ids, selected = token_ids[:, None], token_logit
    return LogprobsTensors(token_ids=ids, logprobs=selected - lse[:, None], ranks=ranks)


def prompt_logprobs_chunked(
    logits_fn: Callable[[int, int], torch.Tensor],
    target_ids: torch.Tensor,
    num_logprobs: int,
    chunk_size: int,
    kernels: KernelBackend | None = None,
) -> LogprobsTensors:
    """Prompt logprobs computed ``chunk_size`` rows at a time, so peak memory stays bounded.

    logits_fn(start, end) returns the logits of prompt rows [start, end): [end - start, V] f32
    (typically the LM head applied to hidden[start:end]); target_ids: [N] int64, the next prompt
    token of each row. Only one chunk's logits are alive at a time.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    num_tokens = target_ids.shape[0]
    parts: list[LogprobsTensors] = []
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        logits = logits_fn(start, end)
        parts.append(compute_topk_logprobs(logits, num_logprobs, target_ids[start:end], kernels))
        del logits
    if not parts:
        width = num_logprobs + 1
        device = target_ids.device
        return LogprobsTensors(
            token_ids=torch.empty(0, width, dtype=torch.int64, device=device),
            logprobs=torch.empty(0, width, dtype=torch.float32, device=device),
            ranks=torch.empty(0, dtype=torch.int64, device=device),
        )
    return LogprobsTensors(
        token_ids=torch.cat([p.token_ids for p in parts]),
        logprobs=torch.cat([p.logprobs for p in parts]),
        ranks=torch.cat([p.ranks for p in parts]),
    )
