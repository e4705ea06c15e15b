"""Shared cases for the input-prep tests: a random state table and a plain-Python reference."""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels.input_prep import InputPrepArgs

BLOCK_SIZE = 4
MAX_REQS, MAX_LEN, MAX_BLOCKS = 6, 40, 10


def make_case(seed: int, pad_tokens: int = 0, pad_reqs: int = 0) -> tuple[InputPrepArgs, dict]:
    """A batch of prefill chunks, decodes and one verify request over random rows."""
    rng = np.random.default_rng(seed)
    rows = rng.choice(MAX_REQS, size=4, replace=False)
    prefill_len = rng.integers(5, 20, size=MAX_REQS)
    token_ids = rng.integers(0, 1000, size=(MAX_REQS, MAX_LEN))
    last_sampled = rng.integers(1000, 2000, size=MAX_REQS)
    block_table = rng.integers(0, 100, size=(MAX_REQS, MAX_BLOCKS))
    num_computed = rng.integers(0, 5, size=MAX_REQS)
    q_lens, n_logits = [], []
    for k, r in enumerate(rows):
        if k == 0:  # prefill chunk from the start
            num_computed[r], q = 0, int(rng.integers(1, prefill_len[r] + 1))
        elif k == 1:  # middle chunk ending exactly at the prefill length
            num_computed[r] = 2
            q = int(prefill_len[r]) - 2
        elif k == 2:  # decode
            num_computed[r], q = prefill_len[r] + 3, 1
        else:  # verify two drafts
            num_computed[r], q = prefill_len[r] + 1, 3
        q_lens.append(q)
        n_logits.append(3 if k == 3 else 1)
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    cu = np.concatenate([[0], np.cumsum(n_logits)])
    t, n, b = int(qsl[-1]), int(cu[-1]), len(rows)
    qsl_padded = np.concatenate([qsl, [t] * pad_reqs])
    i32 = lambda x: torch.tensor(np.asarray(x), dtype=torch.int32)
    i64 = lambda x: torch.tensor(np.asarray(x), dtype=torch.int64)
    args = InputPrepArgs(
        idx_mapping=i32(np.concatenate([rows, [0] * pad_reqs])),
        query_start_loc=i32(qsl_padded),
        cu_num_logits=i32(cu),
        num_computed=i32(num_computed),
        prefill_len=i32(prefill_len),
        token_ids=i64(token_ids),
        last_sampled=i64(last_sampled),
        block_table=i32(block_table),
        input_ids=torch.full((t + pad_tokens,), -7, dtype=torch.int64),
        positions=torch.full((t + pad_tokens,), -7, dtype=torch.int64),
        slot_mapping=torch.full((t + pad_tokens,), -7, dtype=torch.int64),
        seq_lens=torch.full((b + pad_reqs,), -7, dtype=torch.int32),
        logits_indices=torch.full((n,), -7, dtype=torch.int64),
        block_size=BLOCK_SIZE,
        num_reqs=b,
        num_tokens=t,
        num_logits=n,
        max_query_len=max(q_lens),
        num_padded_tokens=t + pad_tokens,
        num_padded_reqs=b + pad_reqs,
        attn_block_table=torch.full((b + pad_reqs + 1, MAX_BLOCKS), -7, dtype=torch.int32),
    )
    host = dict(
        rows=rows,
        q_lens=q_lens,
        n_logits=n_logits,
        num_computed=num_computed.copy(),
        prefill_len=prefill_len,
        token_ids=token_ids,
        last_sampled=last_sampled,
        block_table=block_table,
        pad_tokens=pad_tokens,
        pad_reqs=pad_reqs,
        pad_row=0,  # the row padded requests map to (the runner's trash row)
    )
    return args, host


def python_reference(h: dict) -> dict[str, list[int]]:
    """The definition, one token at a time."""
    ids, pos, slots, seq_lens, logits = [], [], [], [], []
    nc_after = h["num_computed"].copy()
    start = 0
    for r, q, n in zip(h["rows"], h["q_lens"], h["n_logits"], strict=True):
        nc = int(h["num_computed"][r])
        for i in range(q):
            p = nc + i
            first_decode = i == 0 and p >= h["prefill_len"][r]
            ids.append(int(h["last_sampled"][r] if first_decode else h["token_ids"][r, p]))
            pos.append(p)
            slots.append(int(h["block_table"][r, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE)
        seq_lens.append(nc + q)
        logits.extend(range(start + q - n, start + q))
        nc_after[r] = nc + q
        start += q
    pt, pr = h["pad_tokens"], h["pad_reqs"]
    return dict(
        input_ids=ids + [0] * pt,
        positions=pos + [0] * pt,
        slot_mapping=slots + [-1] * pt,
        seq_lens=seq_lens + [0] * pr,
        logits_indices=logits,
        num_computed=nc_after.tolist(),
        # rows past num_padded_reqs are left alone
        attn_block_table=[h["block_table"][r].tolist() for r in h["rows"]]
        + [h["block_table"][h["pad_row"]].tolist()] * pr
        + [[-7] * MAX_BLOCKS],
    )


def outputs(a: InputPrepArgs) -> dict[str, list[int]]:
    return {
        name: getattr(a, name).tolist()
        for name in (
            "input_ids",
            "positions",
            "slot_mapping",
            "seq_lens",
            "logits_indices",
            "num_computed",
            "attn_block_table",
        )
    }
