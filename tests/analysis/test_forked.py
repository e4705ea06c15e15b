"""``analysis.forked`` and the report's forked bubble blame: the same results as a plain call."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from analysis import analyze_frames, forked, load_trace
from analysis.records import records

REAL = Path(__file__).resolve().parents[1] / "data" / "real"
can_fork = pytest.mark.skipif(
    not hasattr(os, "fork") or threading.active_count() > 1, reason="needs fork, no other threads"
)


def _pid_and(x: int) -> tuple[int, int]:
    return os.getpid(), x * 2


def _fails(x: int) -> int:
    raise ValueError(f"bad {x}")


@can_fork
def test_forked_call_runs_in_a_child_and_returns_its_value() -> None:
    job = forked.start(_pid_and, 21)
    assert job.forked
    pid, value = job.result()
    assert value == 42 and pid != os.getpid()
    plain = forked.start(_pid_and, 21, fork=False)
    assert not plain.forked and plain.result() == (os.getpid(), 42)


def _keep_and_report(x: list[int]) -> tuple[bool, int]:
    forked.keep_until_exit(x)
    return forked.in_child(), len(forked._KEPT)


@can_fork
def test_keep_until_exit_holds_objects_only_in_a_child() -> None:
    """A child holds what it is given until its os._exit; this process (and a call made here
    without a child) keeps nothing."""
    kept_before = len(forked._KEPT)
    assert forked.start(_keep_and_report, [1, 2]).result() == (True, 1)
    assert forked.start(_keep_and_report, [1, 2], fork=False).result() == (False, kept_before)
    assert len(forked._KEPT) == kept_before == 0 and not forked.in_child()


@can_fork
def test_forked_call_that_raises_raises_the_same_here() -> None:
    job = forked.start(_fails, 3)
    with pytest.raises(ValueError, match="bad 3"):
        job.result()


@can_fork
def test_forked_blame_equals_the_plain_report(monkeypatch: pytest.MonkeyPatch) -> None:
    import analysis.analyzers as analyzers

    monkeypatch.setattr(analyzers, "PARALLEL_MIN_SLICES", 0)  # fork even on a small trace
    path = REAL / "tracelens" / "inference" / "vllm_prefilldecode_piecewise"
    frames = load_trace(path / "graph_execution.json.gz")
    started: list[bool] = []
    real_start = forked.start

    def spy(*args: object, **kw: object) -> forked.Forked[object]:
        job = real_start(*args, **kw)  # type: ignore[arg-type]
        started.append(job.forked)
        return job

    monkeypatch.setattr(analyzers.forked, "start", spy)
    parallel = analyze_frames(frames, parallel=True)
    assert started == [True]
    plain = analyze_frames(frames)
    assert parallel.to_dict() == plain.to_dict()
    assert records(parallel.tables["bubbles"]) == records(plain.tables["bubbles"])
