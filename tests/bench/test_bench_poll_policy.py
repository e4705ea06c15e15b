"""bench/bench_poll_policy.py: both poll policies emit every device stage of a host-bound run
(``_micro_steps`` checks the count itself and raises otherwise); the auto policy's polls run on
the engine thread, the background one's on the poller thread."""

from __future__ import annotations

import math
import threading

import pytest

from bench import bench_poll_policy
from instrument.device_timeline import DeviceTimeline


@pytest.mark.parametrize("policy", ["auto", "background"])
def test_policy_emits_everything_and_polls_where_it_says(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: set[str] = set()
    poll = DeviceTimeline.poll

    def spy(self: DeviceTimeline, limit: int | None = None) -> int:
        threads.add(threading.current_thread().name)
        return poll(self, limit)

    monkeypatch.setattr(DeviceTimeline, "poll", spy)
    wall_us, cpu_us = bench_poll_policy.one_run(policy, 400)  # 2,000 stages: past MAX_DEFERRED
    assert math.isfinite(wall_us) and wall_us > 0 and math.isfinite(cpu_us) and cpu_us > 0
    if policy == "auto":
        assert threads == {threading.current_thread().name}
    else:
        assert "stepscope-device-poll" in threads
