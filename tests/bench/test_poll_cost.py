"""bench/poll_cost.py: the device timeline's poll per emitted slice, on the poller thread."""

from __future__ import annotations

from bench.poll_cost import main
from instrument import device_timeline


def test_poll_cost_counts_the_pollers_bytecodes_and_cpu_time(tmp_path, monkeypatch) -> None:
    common = ["--requests", "32", "--out-len", "48", "--max-num-seqs", "32",
              "--trace", str(tmp_path / "t.pftrace")]  # fmt: skip
    # The default: the compiled core builds a poll's slices in C (35 bytecodes a slice here).
    compiled = main([*common, "--bytecodes"])
    assert compiled["bytecodes_per_slice"] <= 50
    monkeypatch.setattr(device_timeline, "COMPILED_EMIT", False)  # the Python slice loop
    counted = main([*common, "--bytecodes"])
    row = counted["rounds"][0]
    assert row["polls"] > 0 and row["slices"] >= 50  # polls ran on the poller thread
    # The same bound as tests/engine/test_trace_cost.py's (a larger model, more requests).
    assert 100 < counted["bytecodes_per_slice"] <= 215
    timed = main([*common, "--rounds", "2", "--chunk", "16"])
    assert timed["poll_chunk"] == 16 and len(timed["rounds"]) == 2
    assert all(r["us_per_slice"] > 0 for r in timed["rounds"])
    assert device_timeline.POLL_CHUNK == 256  # the engine's, restored
