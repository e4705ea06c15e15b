"""Rank sets: hand-built rank traces with exact times -> known stragglers, waits, clock shifts."""

from __future__ import annotations

from pathlib import Path

import pytest

from analysis.cli import analyze_main
from analysis.frames import TraceError
from analysis.metrics_registry import (
    RANK_METRIC_BY_KEY,
    RANK_METRICS,
    RANK_TABLE_METRIC_BY_KEY,
    RANK_TABLE_METRICS,
)
from analysis.ranks.cli import is_rank_set
from analysis.ranks.rank_set import load_rank_set, rank_trace_files
from analysis.ranks.report import analyze_ranks
from tracekit.perfetto import TraceSpec, write

US = 1_000
# Per rank and step: (forward start, forward end) in us; collectives inside each forward.
FORWARDS = {
    0: {1: (100, 200), 2: (300, 390), 3: (500, 640)},
    1: {1: (110, 230), 2: (300, 400), 3: (520, 600)},
}
# Host-timed all_reduce slices (us) nested in rank r's forward of step s.
ALL_REDUCES = {(0, 1): [(120, 150), (160, 170)], (1, 1): [(130, 140)], (1, 3): [(550, 590)]}


def _rank_trace(
    tmp: Path, rank: int, host: str = "h", offset_us: int = 0, name: str = "run"
) -> Path:
    """Rank ``rank``'s trace; its clock reads ``offset_us`` ahead of rank 0's."""
    spec = TraceSpec()
    meta = {"rank": rank, "world_size": 2, "host": host, "clock_offset_ns": offset_us * US}
    spec.instants.append((None, "trace_metadata", 0, meta))
    track = f"gpu:{rank} compute"
    for step, (start, end) in FORWARDS[rank].items():
        s, e = (start + offset_us) * US, (end + offset_us) * US
        spec.cpu("prepare_inputs", s - 20 * US, s - 5 * US, step=step)
        spec.slices.append((track, "forward", s, e, {"step": step}))
        for a, b in ALL_REDUCES.get((rank, step), []):
            spec.slices.append(
                (track, "all_reduce", (a + offset_us) * US, (b + offset_us) * US, {})
            )
    return write(spec, tmp / f"{name}.rank{rank}.pftrace")


def test_straggler_and_waits_known_answers(tmp_path: Path) -> None:
    paths = [str(_rank_trace(tmp_path, r)) for r in (0, 1)]
    report = analyze_ranks(paths, window="all", skip_steps=0)
    st = report.tables["stragglers"].set_index("step")
    # step 1: ends 200 vs 230 -> rank 1; step 2: 390 vs 400 -> rank 1; step 3: 640 vs 600 -> 0
    assert st["straggler_rank"].to_dict() == {1: 1, 2: 1, 3: 0}
    assert st["end_spread_ns"].to_dict() == {1: 30 * US, 2: 10 * US, 3: 40 * US}
    assert st["start_spread_ns"].to_dict() == {1: 10 * US, 2: 0, 3: 20 * US}
    assert st["forward_max_ns"].to_dict() == {1: 120 * US, 2: 100 * US, 3: 140 * US}
    coll = report.tables["collectives"].set_index(["rank", "step"])
    assert coll.loc[(0, 1), "collective_ns"] == 40 * US
    assert coll.loc[(0, 1), "num_collectives"] == 2
    assert coll.loc[(1, 3), "collective_ns"] == 40 * US
    assert coll.loc[(0, 2), "collective_ns"] == 0
    # arrival wait: the last start minus own start (rank 0 waits 10 us at step 1, 20 at step 3)
    assert coll["arrival_wait_ns"].groupby(level=0).sum().to_dict() == {0: 30 * US, 1: 0}
    ranks = report.tables["ranks"].set_index("rank")
    assert ranks.loc[0, "all_reduce_wait_ms"] == pytest.approx((40 + 30) / 1e3)
    assert ranks.loc[1, "all_reduce_wait_ms"] == pytest.approx((10 + 40) / 1e3)
    assert ranks["straggler_steps"].to_dict() == {0: 1, 1: 2}
    assert report.headline["straggler_share"][1] == pytest.approx(2 / 3)
    assert "rank 1 is the straggler" in report.verdicts[0]
    # every rank headline key is a registry entry, in the registry's order, and nothing else
    assert list(report.headline) == [m.key for m in RANK_METRICS]
    assert all(m.label and m.definition and m.unit and m.section for m in RANK_METRICS)
    # every per-rank table column has one registry entry (the dashboard's headers and tooltips)
    assert sorted(ranks.reset_index().columns) == sorted(m.key for m in RANK_TABLE_METRICS)
    assert all(m.label and m.definition and m.unit and m.section for m in RANK_TABLE_METRICS)
    share = RANK_TABLE_METRIC_BY_KEY["straggler_share"]
    assert (
        share.unit == "ratio"
        and share.definition[1:] in RANK_METRIC_BY_KEY["straggler_share"].definition
    )
    assert report.headline["all_reduce_wait_us"] == pytest.approx({0: 70.0, 1: 50.0})
    assert report.headline["end_spread_us"]["p50"] == pytest.approx(30.0)


def test_clock_offset_applied_only_across_hosts(tmp_path: Path) -> None:
    """Rank 1 on another host with a clock 5 ms ahead: shifted back, the same answers."""
    a = [str(_rank_trace(tmp_path, 0, "a")), str(_rank_trace(tmp_path, 1, "b", 5000))]
    shifted = analyze_ranks(a, window="all", skip_steps=0)
    assert shifted.ranks.clock_shift_ns == {0: 0, 1: 5000 * US}
    assert shifted.tables["stragglers"]["straggler_rank"].tolist() == [1, 1, 0]
    # The same offset on one host is measurement noise: nothing is shifted.
    b = tmp_path / "same"
    b.mkdir()
    _rank_trace(b, 0, "h")
    _rank_trace(b, 1, "h", 5000)
    same = load_rank_set([str(b)])
    assert same.same_host and same.clock_shift_ns == {0: 0, 1: 0}


def test_directory_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for r in (1, 0):
        _rank_trace(tmp_path, r)
    files = rank_trace_files([str(tmp_path)])
    assert [Path(f).name for f in files] == ["run.rank0.pftrace", "run.rank1.pftrace"]
    assert is_rank_set([str(tmp_path)]) and not is_rank_set([files[0]])
    assert analyze_main([str(tmp_path), "--window", "all", "--skip-steps", "0"]) == 0
    out = capsys.readouterr().out
    assert "stragglers per step" in out and "rank 1 is the straggler" in out
    with pytest.raises(TraceError, match="given twice"):
        load_rank_set([files[0], files[0]])
    _rank_trace(tmp_path, 0, name="other")
    with pytest.raises(TraceError, match="several runs"):
        rank_trace_files([str(tmp_path)])
