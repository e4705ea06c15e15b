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
    out: SchedulerOutput, states: RequestStates, padded_reqs: int | None = None
) -> tuple[InputBatch, np.ndarray]:
    """Order requests as the scheduler listed them; advance the state mirrors; pack the inputs.

    ``padded_reqs`` (CUDA graphs, uniform decode only) pads requests and tokens to that count.
    """
    req_ids = list(out.num_scheduled_tokens)
    rows = [states.row_of[r] for r in req_ids]
    query_lens = [out.num_scheduled_tokens[r] for r in req_ids]
    num_logits = [1 + len(out.scheduled_spec_decode_tokens.get(r, ())) for r in req_ids]
    seq_lens, returns = [], []
    for row, q in zip(rows, query_lens, strict=True):
        seq_len = int(states.num_computed_cpu[row]) + q
        if seq_len > states.max_model_len:
            raise ValueError(f"row {row} would reach {seq_len} > max_model_len tokens")
        seq_lens.append(seq_len)
        returns.append(seq_len >= states.prefill_len_cpu[row])
        states.advance(row, q)
    b, t = len(req_ids), sum(query_lens)
    bp = b if padded_reqs is None else padded_reqs
    params = [states.params[r] for r in rows]
    wanted = [p.logprobs for p in params if p is not None and p.logprobs is not None]
    batch = InputBatch(
        step=out.step,
        req_ids=req_ids,
        rows=rows,
        query_lens=query_lens,
        num_logits_per_req=num_logits,
        returns_tokens=returns,
        num_reqs=b,
        num_tokens=t,
        num_logits=sum(num_logits),
        num_padded_reqs=bp,
        num_padded_tokens=t + (bp - b),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        is_uniform_decode=b > 0 and all(q == 1 for q in query_lens),
        any_penalties=any(p is not None and p.has_penalties for p in params),
        all_greedy=all(p is not None and p.is_greedy for p in params),
        no_top_k_top_p_min_p=all(
            p is not None and p.top_k <= 0 and p.top_p == 1.0 and p.min_p == 0.0 for p in params
        ),
        max_num_logprobs=max(wanted) if wanted else None,
        num_drafts=sum(num_logits) - b,
        max_logits_per_req=max(num_logits, default=1),
    )
    num_blocks = [int(states.num_blocks_cpu[r]) for r in rows]
    return batch, _pack(batch, states.trash_row, num_blocks)


def _pack(batch: InputBatch, trash_row: int, num_blocks: list[int]) -> np.ndarray:
    b, bp = batch.num_reqs, batch.num_padded_reqs
    pad = bp - b
    idx_mapping = np.array(batch.rows + [trash_row] * pad, np.int32)
    # Padded requests own no query token (the model's convention); padding tokens get slot -1.
    qsl = np.concatenate([[0], np.cumsum(batch.query_lens + [0] * pad)]).astype(np.int32)
    cu_logits = np.concatenate([[0], np.cumsum(batch.num_logits_per_req)]).astype(np.int32)
    logit_rows = np.repeat(np.array(batch.rows, np.int32), batch.num_logits_per_req)
    commit = [
        r if ok else trash_row for r, ok in zip(batch.rows, batch.returns_tokens, strict=True)
    ]
    commit_rows = np.repeat(np.array(commit, np.int32), batch.num_logits_per_req)
    blocks = np.array(num_blocks, np.int32)
    return np.concatenate([idx_mapping, qsl, cu_logits, logit_rows, commit_rows, blocks]).astype(
        np.int32
    )
