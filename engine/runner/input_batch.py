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
from itertools import accumulate, chain

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
    """
    req_ids = list(out.num_scheduled_tokens)
    row_of = states.row_of
    rows = [row_of[r] for r in req_ids]
    query_lens = list(out.num_scheduled_tokens.values())
    spec_tokens = out.scheduled_spec_decode_tokens
    b, t = len(req_ids), sum(query_lens)
    bp = b if padded_reqs is None else padded_reqs
    if bp < b or (padded_tokens is not None and padded_tokens < t):
        raise ValueError(f"a batch of {b} requests / {t} tokens does not fit its padded shape")
    if spec_tokens:
        num_logits = [1 + len(spec_tokens.get(r, ())) for r in req_ids]
    else:  # no drafts this step: one logits row per request
        num_logits = [1] * b
    # Per-request work stays in Python lists: each mirror is converted once (a few hundred ints),
    # cheaper than a numpy scalar read per request or a string of small numpy calls.
    num_computed = states.num_computed_cpu.tolist()
    prefill_len = states.prefill_len_cpu.tolist()
    seq_lens = [num_computed[row] + q for row, q in zip(rows, query_lens, strict=True)]
    max_seq_len = max(seq_lens, default=0)
    if max_seq_len > states.max_model_len:
        row, seq_len = next(
            (r, n) for r, n in zip(rows, seq_lens, strict=True) if n > states.max_model_len
        )
        raise ValueError(f"row {row} would reach {seq_len} > max_model_len tokens")
    returns = [seq_len >= prefill_len[row] for row, seq_len in zip(rows, seq_lens, strict=True)]
    states.advance(rows, query_lens)
    max_query_len = max(query_lens, default=0)
    flags = states.sampling_flags(rows)
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
        num_padded_tokens=t + (bp - b) if padded_tokens is None else padded_tokens,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        is_uniform_decode=b > 0 and max_query_len == 1 and min(query_lens) == 1,
        any_penalties=flags.any_penalties,
        all_greedy=flags.all_greedy,
        no_top_k_top_p_min_p=flags.no_top_k_top_p_min_p,
        max_num_logprobs=flags.max_num_logprobs,
        num_drafts=sum(num_logits) - b,
        max_logits_per_req=max(num_logits, default=1),
    )
    num_blocks_of_row = states.num_blocks_cpu.tolist()
    num_blocks = [num_blocks_of_row[row] for row in rows]
    return batch, _pack(batch, states.trash_row, num_blocks)


def _pack(batch: InputBatch, trash_row: int, num_blocks: list[int]) -> np.ndarray:
    """The packed int32 layout of the module docstring, built as Python lists and converted in
    one call (one conversion is cheaper than a numpy call per section)."""
    rows, pad = batch.rows, batch.num_padded_reqs - batch.num_reqs
    idx_mapping = rows + [trash_row] * pad
    # Padded requests own no query token (the model's convention); padding tokens get slot -1.
    qsl = list(accumulate(batch.query_lens + [0] * pad, initial=0))
    cu_logits = list(accumulate(batch.num_logits_per_req, initial=0))
    commit = [r if ok else trash_row for r, ok in zip(rows, batch.returns_tokens, strict=True)]
    if batch.num_drafts == 0:  # one logits row per request: nothing to repeat
        logit_rows, commit_rows = rows, commit
    else:
        logit_rows = _repeat(rows, batch.num_logits_per_req)
        commit_rows = _repeat(commit, batch.num_logits_per_req)
    sections = (idx_mapping, qsl, cu_logits, logit_rows, commit_rows, num_blocks)
    size = sum(len(section) for section in sections)
    return np.fromiter(chain.from_iterable(sections), np.int32, size)


def _repeat(values: list[int], counts: list[int]) -> list[int]:
    """``values[i]`` repeated ``counts[i]`` times, in order (``np.repeat`` on lists)."""
    return [value for value, count in zip(values, counts, strict=True) for _ in range(count)]
