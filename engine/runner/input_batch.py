"""The host side of one step's batch: which rows run, how many tokens each, what gets sampled.

Everything here is built from the scheduler's host ints and the state table's host mirrors; the
packed int32 array travels to the device in one staged copy and the input-prep kernel expands it.

Packed layout (int32), offsets in :class:`InputBatch`:
``idx_mapping [num_padded_reqs] | query_start_loc [num_padded_reqs + 1] |
cu_num_logits [num_reqs + 1] | logit_rows [num_logits] | commit_rows [num_logits] |
num_blocks [num_reqs]``.
``logit_rows[j]`` is the state row that logits row ``j`` samples for; ``commit_rows[j]`` is the
same row when the sampled token is real, and the trash row when it is discarded (a chunk that
ends before the prompt does). ``num_blocks[b]`` is how many KV blocks request ``b`` holds once
this step's block-table diffs are applied (proposers keep their chain KV inside them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.runner.states import RequestStates
from engine.scheduler.outputs import SchedulerOutput

__all__ = ["InputBatch", "build_input_batch", "packed_capacity"]


@dataclass(frozen=True)
class InputBatch:
    """Host description of one step (no device tensors)."""

    step: int
    req_ids: list[str]
    rows: list[int]
    query_lens: list[int]
    num_logits_per_req: list[int]
    returns_tokens: list[bool]  # per request: False while its prompt is still being prefilled
    num_reqs: int
    num_tokens: int
    num_logits: int
    num_padded_reqs: int
    num_padded_tokens: int
    max_query_len: int
    max_seq_len: int
    is_uniform_decode: bool  # every request runs exactly one token (CUDA-graph candidate)
    any_penalties: bool
    all_greedy: bool
    no_top_k_top_p_min_p: bool
    max_num_logprobs: int | None
    num_drafts: int = 0  # speculative tokens verified this step, all requests together
    max_logits_per_req: int = 1

    @property
    def offsets(self) -> dict[str, tuple[int, int]]:
        """Name -> (start, end) inside the packed int32 array."""
        b, bp, n = self.num_reqs, self.num_padded_reqs, self.num_logits
        sizes = [
            ("idx_mapping", bp),
            ("query_start_loc", bp + 1),
            ("cu_num_logits", b + 1),
            ("logit_rows", n),
            ("commit_rows", n),
            ("num_blocks", b),
        ]
        out, start = {}, 0
        for name, size in sizes:
            out[name] = (start, start + size)
            start += size
        return out


def packed_capacity(max_num_reqs: int, max_num_tokens: int) -> int:
    """Upper bound of the packed array length (logits rows are bounded by tokens)."""
    return 4 * (max_num_reqs + 1) + 2 * max_num_tokens


# stepscope: hot
def build_input_batch(
    out: SchedulerOutput,
    states: RequestStates,
    padded_reqs: int | None = None,
    padded_tokens: int | None = None,
) -> tuple[InputBatch, np.ndarray]:
    """Order requests as the scheduler listed them; advance the state mirrors; pack the inputs.

    ``padded_reqs`` (a CUDA graph's shape) pads requests to that count; ``padded_tokens`` pads
    tokens to that count (default: one padding token per padded request, the decode shape).
    Per-request work is NumPy over the batch's rows (looked up once per change of the batch);
    the lists of :class:`InputBatch` are converted once at the end.
    """
    req_ids = list(out.num_scheduled_tokens)
    b = len(req_ids)
    rows = states.rows_of(req_ids)  # [b] int64
    query_lens = np.fromiter(out.num_scheduled_tokens.values(), np.int64, b)  # [b]
    spec_tokens = out.scheduled_spec_decode_tokens
    t = int(query_lens.sum())
    bp = b if padded_reqs is None else padded_reqs
    if bp < b or (padded_tokens is not None and padded_tokens < t):
        raise ValueError(f"a batch of {b} requests / {t} tokens does not fit its padded shape")
    if spec_tokens:
        num_logits = np.fromiter((1 + len(spec_tokens.get(r, ())) for r in req_ids), np.int64, b)
    else:  # no drafts this step: one logits row per request
        num_logits = np.ones(b, np.int64)
    seq_lens = states.num_computed_cpu[rows] + query_lens  # [b]
    max_seq_len = int(seq_lens.max()) if b else 0
    if max_seq_len > states.max_model_len:
        index = int(np.argmax(seq_lens > states.max_model_len))
        raise ValueError(
            f"row {int(rows[index])} would reach {int(seq_lens[index])} > max_model_len tokens"
        )
    returns = seq_lens >= states.prefill_len_cpu[rows]  # [b] bool
    states.advance(rows, query_lens)
    max_query_len = int(query_lens.max()) if b else 0
    total_logits = int(num_logits.sum())
    flags = states.sampling_flags(rows)
    batch = InputBatch(
        step=out.step,
        req_ids=req_ids,
        rows=rows.tolist(),
        query_lens=query_lens.tolist(),
        num_logits_per_req=num_logits.tolist(),
        returns_tokens=returns.tolist(),
        num_reqs=b,
        num_tokens=t,
        num_logits=total_logits,
        num_padded_reqs=bp,
        num_padded_tokens=t + (bp - b) if padded_tokens is None else padded_tokens,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        is_uniform_decode=b > 0 and max_query_len == 1 and t == b,
        any_penalties=flags.any_penalties,
        all_greedy=flags.all_greedy,
        no_top_k_top_p_min_p=flags.no_top_k_top_p_min_p,
        max_num_logprobs=flags.max_num_logprobs,
        num_drafts=total_logits - b,
        max_logits_per_req=int(num_logits.max()) if b else 1,
    )
    packed = _pack(
        rows, query_lens, num_logits, returns, states.num_blocks_cpu[rows], bp, states.trash_row
    )
    return batch, packed


def _pack(
    rows: np.ndarray,  # [b] int64
    query_lens: np.ndarray,  # [b]
    num_logits: np.ndarray,  # [b]
    returns: np.ndarray,  # [b] bool
    num_blocks: np.ndarray,  # [b]
    num_padded_reqs: int,
    trash_row: int,
) -> np.ndarray:
    """The packed int32 layout of the module docstring (sections written into one array)."""
    b, bp = rows.shape[0], num_padded_reqs
    n = int(num_logits.sum())
    packed = np.empty(2 * bp + 1 + (b + 1) + 2 * n + b, np.int32)
    sections = {}
    start = 0
    for name, size in (("idx", bp), ("qsl", bp + 1), ("cu", b + 1), ("logit", n),
                       ("commit", n), ("blocks", b)):  # fmt: skip
        sections[name] = packed[start : start + size]
        start += size
    idx = sections["idx"]
    idx[:b] = rows
    idx[b:] = trash_row
    # Padded requests own no query token (the model's convention); padding tokens get slot -1.
    qsl = sections["qsl"]
    qsl[0] = 0
    np.cumsum(query_lens, out=qsl[1 : b + 1])
    qsl[b + 1 :] = qsl[b]
    cu = sections["cu"]
    cu[0] = 0
    np.cumsum(num_logits, out=cu[1:])
    commit = np.where(returns, rows, trash_row)  # [b]
    if n == b:  # one logits row per request: nothing to repeat
        sections["logit"][:] = rows
        sections["commit"][:] = commit
    else:
        sections["logit"][:] = np.repeat(rows, num_logits)
        sections["commit"][:] = np.repeat(commit, num_logits)
    sections["blocks"][:] = num_blocks
    return packed
