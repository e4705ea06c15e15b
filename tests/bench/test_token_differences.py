"""bench_trace_overhead.token_differences: which requests two runs of the same prompts disagree
on, and where (what the overhead bench prints when its digests differ)."""

from __future__ import annotations

import pytest

from bench.bench_trace_overhead import token_differences

BASE = {"a": [1, 2, 3, 4, 5, 6], "b": [7, 8], "c": [9]}


@pytest.mark.parametrize(
    ("got", "expected"),
    [
        (dict(BASE), []),
        (
            {"a": [1, 2, 3, 0, 5, 6], "b": [7, 8], "c": [9]},
            [{"req": "a", "pos": 3, "len": 6, "want": [4, 5, 6], "have": [0, 5, 6]}],
        ),
        (  # a shorter output differs where it ends
            {"a": [1, 2, 3, 4, 5, 6], "b": [7], "c": [9]},
            [{"req": "b", "pos": 1, "len": 2, "want": [8], "have": []}],
        ),
        (  # a request missing from the other run
            {"a": [1, 2, 3, 4, 5, 6], "b": [7, 8]},
            [{"req": "c", "pos": 0, "len": 1, "want": [9], "have": []}],
        ),
        (
            {"a": [0, 2, 3, 4, 5, 6], "b": [7, 0], "c": [9]},
            [
                {"req": "a", "pos": 0, "len": 6, "want": [1, 2, 3, 4], "have": [0, 2, 3, 4]},
                {"req": "b", "pos": 1, "len": 2, "want": [8], "have": [0]},
            ],
        ),
    ],
)
def test_token_differences(got, expected):
    assert token_differences(BASE, got) == expected
