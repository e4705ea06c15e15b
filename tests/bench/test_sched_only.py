"""bench/sched_only.py measures both phases over steady steps of a small batch."""

from __future__ import annotations

from bench.sched_only import measure


def test_measures_schedule_and_update_of_steady_steps() -> None:
    result = measure(batch=8, prompt_len=8, out_len=12, block_size=4)
    assert set(result) == {"schedule", "update"}
    assert all(us > 0 for us in result.values())
