"""N-gram prompt lookup, on the device: the request's own tokens predict its continuation.

For a request whose context is ``x_0 .. x_P`` (``P`` = the bonus position), try ``n`` from
``max_ngram`` down to ``min_ngram``: find the most recent earlier occurrence ``i`` of the suffix
``x_{P-n+1} .. x_P`` (``i + n - 1 < P``) and propose ``x_{i+n} .. x_{i+n+k-1}`` (indices past ``P``
are clamped to ``P``). With no match at any ``n``, the drafts repeat the bonus token. The search is
a batched compare of every window against the suffix (``[B, L, n]``, ``L`` = a host bound of the
context), so nothing is read back to the host.
"""

from __future__ import annotations

import torch

from engine.spec.proposer import (
    DraftOutput,
    ProposeInputs,
    Proposer,
    ProposerContext,
    register_proposer,
)

__all__ = ["NgramProposer"]


class NgramProposer(Proposer):
    """Prompt lookup decoding; drafts have no distribution (verify treats them as one-hot)."""

    def __init__(self, num_spec_tokens: int, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if num_spec_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError("need num_spec_tokens >= 1 and 1 <= min_ngram <= max_ngram")
        self.num_spec_tokens = num_spec_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    @property
    def has_draft_probs(self) -> bool:
        return False

    # stepscope: hot
    def propose(self, inputs: ProposeInputs) -> DraftOutput:
        b, k = inputs.num_reqs, self.num_spec_tokens
        length = min(inputs.max_model_len, inputs.max_seq_len + 1)
        context = inputs.token_ids[inputs.rows, :length]  # [B, L]
        last = inputs.bonus_pos.clamp(max=length - 1)  # [B] P
        # Tokens past P are stale drafts; matches end before P and drafts are clamped to P.
        start = torch.full((b,), -1, dtype=torch.int64, device=context.device)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            found = self._match(context, last, n)  # [B]: i + n of the latest match, or -1
            start = torch.where(start < 0, found, start)
        j = torch.arange(k, device=context.device)  # [k]
        idx = torch.where(start[:, None] >= 0, start[:, None] + j, last[:, None])
        idx = torch.minimum(idx, last[:, None])  # never read past the known context
        drafts = context.gather(1, idx)
        return DraftOutput(draft_ids=drafts, draft_probs=None)

    @staticmethod
    # stepscope: hot
    def _match(context: torch.Tensor, last: torch.Tensor, n: int) -> torch.Tensor:
        """Start of the continuation (``i + n``) after the latest earlier ``n``-gram equal to the
        suffix ending at ``last``; -1 where there is none. context: [B, L]; last: [B]."""
        num_windows = context.shape[1] - n + 1
        if num_windows <= 0:
            return torch.full_like(last, -1)
        offsets = torch.arange(n, device=context.device)
        suffix_idx = (last[:, None] - n + 1 + offsets).clamp(min=0)  # [B, n]
        suffix = context.gather(1, suffix_idx)  # [B, n]
        windows = context.unfold(1, n, 1)  # [B, W, n]
        equal = (windows == suffix[:, None, :]).all(dim=-1)  # [B, W]
        i = torch.arange(num_windows, device=context.device)  # [W]
        # the window must end before P and the suffix must lie inside the context
        valid = (i[None, :] + n - 1 < last[:, None]) & (last[:, None] - n + 1 >= 0)
        hits = torch.where(equal & valid, i[None, :], torch.full_like(i[None, :], -1))
        best = hits.max(dim=1).values  # [B]
        return torch.where(best >= 0, best + n, best)


def _build(ctx: ProposerContext) -> NgramProposer:
    return NgramProposer(ctx.spec.num_spec_tokens)


register_proposer("ngram", _build)
