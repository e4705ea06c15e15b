"""The rejection scan of speculative decoding: where each request stops accepting drafts.

Request ``b`` owns logits rows ``cu_num_logits[b] : cu_num_logits[b + 1]`` (``n_b`` rows, local
index ``l = 0 .. n_b - 1``). Row ``l < n_b - 1`` verifies draft ``d_{l+1}``; the last row has no
draft and yields the bonus token. With ``stop_b`` = the first ``l`` whose draft is rejected, or
``n_b - 1`` when every draft is accepted:

* ``num_accepted[b] = stop_b``;
* ``out[row l] = draft[l]`` for ``l < stop_b``, ``fallback[l]`` at ``l = stop_b`` (the recovered
  token of a rejected row, or the bonus token of the last row), ``-1`` after it.

The per-row work (probabilities, acceptance tests, recovered tokens) happens before this scan;
the scan is the only sequential part and runs on the device without reading anything back.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

try:  # the engine runs without triton; only the torch path is then available
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

__all__ = ["rejection_scan_torch", "rejection_scan_triton"]


# stepscope: hot
def rejection_scan_torch(
    cu_num_logits: torch.Tensor,  # [B + 1] int32
    draft_ids: torch.Tensor,  # [N] int64: row l's draft d_{l+1} (ignored on the last row)
    accepted: torch.Tensor,  # [N] bool: row l's draft passed its test
    fallback_ids: torch.Tensor,  # [N] int64: recovered token (bonus on the last row)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: returns ``out: [N] int64`` and ``num_accepted: [B] int64``."""
    num_rows, num_reqs = draft_ids.shape[0], cu_num_logits.shape[0] - 1
    dev = draft_ids.device
    cu = cu_num_logits.long()
    rows = torch.arange(num_rows, device=dev)  # [N]
    req = torch.searchsorted(cu[1:], rows, right=True)  # [N] request of each row
    local = rows - cu[req]  # [N]
    last = cu[req + 1] - 1 == rows
    # stop candidate of each row: its local index where it stops the scan, else a large value
    candidate = torch.where(~accepted | last, local, torch.full_like(local, num_rows))
    stop = torch.full((num_reqs,), num_rows, dtype=torch.int64, device=dev)
    stop = stop.scatter_reduce(0, req, candidate, reduce="amin")  # [B]
    stop_row = stop[req]
    out = torch.where(local < stop_row, draft_ids, fallback_ids)
    out = torch.where(local > stop_row, torch.full_like(out, -1), out)
    return out, stop


@functools.cache
def _build_kernel() -> Any:
    """Define the kernel on first use, so TRITON_INTERPRET set by then is honoured."""

    @triton.jit
    def _rejection_scan_kernel(
        cu_ptr,
        draft_ptr,
        accepted_ptr,
        fallback_ptr,
        out_ptr,
        num_accepted_ptr,
        BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0)
        start = tl.load(cu_ptr + b).to(tl.int64)
        n = tl.load(cu_ptr + b + 1).to(tl.int64) - start
        local = tl.arange(0, BLOCK)
        mask = local < n
        acc = tl.load(accepted_ptr + start + local, mask=mask, other=0)
        stops = (acc == 0) | (local == n - 1)
        stop = tl.min(tl.where(stops & mask, local, BLOCK), axis=0)
        draft = tl.load(draft_ptr + start + local, mask=mask, other=0)
        fallback = tl.load(fallback_ptr + start + local, mask=mask, other=0)
        out = tl.where(local < stop, draft, fallback)
        out = tl.where(local > stop, -1, out)
        tl.store(out_ptr + start + local, out, mask=mask)
        tl.store(num_accepted_ptr + b, stop.to(tl.int64))

    return _rejection_scan_kernel


# stepscope: hot
def rejection_scan_triton(
    cu_num_logits: torch.Tensor,
    draft_ids: torch.Tensor,
    accepted: torch.Tensor,
    fallback_ids: torch.Tensor,
    max_rows_per_req: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One program per request over its (at most ``max_rows_per_req``, a host int) rows."""
    if triton is None:
        raise RuntimeError("rejection_scan_triton needs triton, which is not installed")
    num_reqs = cu_num_logits.shape[0] - 1
    out = torch.empty_like(draft_ids)
    num_accepted = torch.zeros(num_reqs, dtype=torch.int64, device=draft_ids.device)
    if num_reqs == 0:
        return out, num_accepted
    block = max(16, triton.next_power_of_2(max(max_rows_per_req, 1)))
    _build_kernel()[(num_reqs,)](
        cu_num_logits,
        draft_ids,
        accepted.to(torch.int8),
        fallback_ids,
        out,
        num_accepted,
        BLOCK=block,
    )
    return out, num_accepted
