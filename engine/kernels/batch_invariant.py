"""Batch-invariant GEMMs: a row's product does not depend on the batch it was computed in.

A GEMM library chooses its kernel (tile shape, split of the reduction over K) from the problem's
shape. The same activation row multiplied by the same weight inside a batch of 64 rows and inside
one of 256 can then be reduced in another order and differ in its last bits. Speculative decoding
meets exactly this: verification computes a position's logits in a batch of ``(1 + k)`` rows per
request, a plain decode step in one of 1 row per request. In float32 the difference is ~1e-6
relative, enough to flip a near-tied greedy argmax (docs/design.md §2.16; bench/README.md, issue
19: a top-2 logit gap of 1.05e-5).

:func:`linear` computes ``x @ weight.T + bias`` in chunks of exactly ``INVARIANT_ROWS`` rows, the
last chunk padded with zeros, so the library always sees one problem shape per weight: every
output element is reduced by the same kernel in the same order whatever the batch, and a row's
result is a function of that row alone. The cost is the padding (a decode batch of 64 rows does
the work of 256) and one launch per chunk: a mode for exactness checks, not for speed.
"""

from __future__ import annotations

import torch

__all__ = ["INVARIANT_ROWS", "linear"]

# Rows of every GEMM problem in batch-invariant mode: the largest CUDA-graph decode batch of the
# sample runs (batch 64 x (1 + k = 3) drafts fits in one chunk); any fixed value is invariant.
INVARIANT_ROWS = 256


# stepscope: hot
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with a batch-invariant reduction: ``x: [..., K]``,
    ``weight: [N, K]`` -> ``[..., N]``, computed as ``ceil(M / INVARIANT_ROWS)`` GEMMs of exactly
    ``INVARIANT_ROWS x K`` by ``K x N`` (``M`` = the rows of ``x``), then the bias added
    elementwise (an addition per element, the same in any batch)."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    chunks = max(1, -(-m // INVARIANT_ROWS))
    padded = rows.new_zeros(chunks * INVARIANT_ROWS, k)
    padded[:m] = rows
    wt = weight.t()
    out = torch.cat(
        [torch.mm(padded[i * INVARIANT_ROWS : (i + 1) * INVARIANT_ROWS], wt) for i in range(chunks)]
    )[:m]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])
