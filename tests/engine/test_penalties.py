"""Penalties against a float64 hand computation; bin-count updates on the device."""

from __future__ import annotations

import torch

from engine.sample.penalties import (
    apply_penalties,
    reset_penalty_rows,
    set_prompt_bin_mask,
    update_output_bin_counts,
)

VOCAB = 16


def hand_penalties(
    logits: list[float],
    prompt: list[int],
    output: list[int],
    repetition: float,
    presence: float,
    frequency: float,
) -> list[float]:
    out = []
    for v, x in enumerate(logits):
        if v in prompt or v in output:
            x = x / repetition if x > 0 else x * repetition
        count = output.count(v)
        x -= frequency * count
        x -= presence * (1.0 if count > 0 else 0.0)
        out.append(x)
    return out


CASES = [
    # (prompt, output, repetition, presence, frequency)
    ([1, 2, 3], [3, 3, 4], 1.5, 0.0, 0.0),
    ([0], [5, 5, 5, 6], 1.0, 0.7, 0.0),
    ([], [7, 8, 8], 1.0, 0.0, 0.3),
    ([9, 10], [10, 11, 11, 11], 1.2, -0.5, 0.25),
    ([], [], 1.3, 1.0, 1.0),
    ([2, 4], [1], 1.0, 0.0, 0.0),
]


def test_penalties_match_hand_computation() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(CASES), VOCAB, generator=gen) * 3
    counts = torch.zeros(len(CASES), VOCAB, dtype=torch.int32)
    mask = torch.zeros(len(CASES), VOCAB, dtype=torch.bool)
    rows = []
    for row, (prompt, output, *_) in enumerate(CASES):
        set_prompt_bin_mask(mask, row, torch.tensor(prompt, dtype=torch.int64))
        rows += [row] * len(output)
    token_ids = torch.tensor([t for case in CASES for t in case[1]], dtype=torch.int64)
    update_output_bin_counts(counts, torch.tensor(rows, dtype=torch.int64), token_ids)

    def col(i: int) -> torch.Tensor:
        return torch.tensor([case[i] for case in CASES], dtype=torch.float32)

    got = apply_penalties(logits, counts, mask, col(2), col(3), col(4))
    for row, (prompt, output, rep, pres, freq) in enumerate(CASES):
        expected = hand_penalties(logits[row].double().tolist(), prompt, output, rep, pres, freq)
        torch.testing.assert_close(
            got[row].double(), torch.tensor(expected, dtype=torch.float64), atol=1e-5, rtol=1e-6
        )
    # Out of place: the raw logits are untouched.
    assert not torch.equal(got, logits)


def test_update_counts_accumulates_duplicates_and_skips_padding() -> None:
    counts = torch.zeros(4, VOCAB, dtype=torch.int32)
    rows = torch.tensor([2, 2, 2, 0, 3, 3], dtype=torch.int64)
    token_ids = torch.tensor([5, 5, 6, 1, -1, 0], dtype=torch.int64)
    update_output_bin_counts(counts, rows, token_ids)
    expected = torch.zeros(4, VOCAB, dtype=torch.int32)
    expected[2, 5], expected[2, 6], expected[0, 1], expected[3, 0] = 2, 1, 1, 1
    assert torch.equal(counts, expected)
    mask = torch.ones(4, VOCAB, dtype=torch.bool)
    reset_penalty_rows(counts, mask, torch.tensor([2], dtype=torch.int64))
    assert counts[2].sum() == 0 and not mask[2].any() and mask[0].all() and counts[0, 1] == 1
