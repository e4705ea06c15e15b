"""Rank sets in the dashboard: listed as one entry, analysed through the store (cached, errors as
messages), and drawn with exactly the numbers of ``analyze_ranks`` on a real TP=2 engine run."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from analysis import TraceError
from analysis.metrics_registry import METRIC_BY_KEY, RANK_TABLE_METRIC_BY_KEY
from analysis.ranks.report import RankReport, analyze_ranks
from dashboard.app import create_app
from dashboard.config import DashboardConfig
from dashboard.paths import UnsafePathError
from dashboard.ranks.callbacks import picker_options, trace_options
from dashboard.ranks.figures import collective_wait_figure, straggler_figure
from dashboard.ranks.sets import LoadedRankSet, RankSetRef, find_rank_sets
from dashboard.ranks.view import (
    RANK_COLUMNS,
    RANK_DEFINITIONS,
    rank_columns,
    rank_overview,
    rank_rows,
)
from dashboard.store import TraceRef, TraceStore
from tests.dashboard.conftest import TraceSet
from tracekit.engine_loop import TraceRecipe, write_engine_trace

TP = RankSetRef("tp")


@pytest.fixture(scope="module")
def store(traces: TraceSet) -> TraceStore:
    return TraceStore(traces.root, max_cached=4, max_upload_bytes=1 << 20)


@pytest.fixture(scope="module")
def loaded(store: TraceStore) -> LoadedRankSet:
    return store.load_rank_set(TP)


@pytest.fixture(scope="module")
def reference(traces: TraceSet) -> RankReport:
    """The analysis API's own report of the same files, computed apart from the store."""
    return analyze_ranks([str(p) for p in traces.ranks])


@pytest.mark.parametrize(
    "names,expected",
    [
        (["tp.rank0.pftrace", "tp.rank1.pftrace"], {"tp": ["tp.rank0.pftrace", "tp.rank1.pftrace"]}),
        (["run.rank10.pftrace", "run.rank2.pftrace"], {"run": ["run.rank2.pftrace", "run.rank10.pftrace"]}),
        (["a/x.rank0.pftrace", "b/x.rank1.pftrace"], {}),  # other directories: other runs
        (["solo.rank0.pftrace", "plain.pftrace"], {}),  # one rank alone stays a single trace
        (["n/x.rank1.json.gz", "n/x.rank0.json.gz"], {}),  # not rank names to the analysis either
    ],
)  # fmt: skip
def test_find_rank_sets(names: list[str], expected: dict[str, list[str]]) -> None:
    assert find_rank_sets(names) == expected


def test_a_folder_with_a_rank_set_lists_it(store: TraceStore, traces: TraceSet) -> None:
    sets = store.list_rank_sets()
    assert sets[TP] == [
        TraceRef("traces", "tp.rank0.pftrace"),
        TraceRef("traces", "tp.rank1.pftrace"),
    ]
    options = picker_options(store)
    values = [o["value"] for o in options]
    at = values.index("ranks/tp")
    assert options[at]["label"] == "tp (2 ranks)"
    assert values[at + 1 : at + 3] == ["traces/tp.rank0.pftrace", "traces/tp.rank1.pftrace"]
    assert {"traces/sync.pftrace", "traces/nested/other_model.pftrace"} <= set(values)
    assert sorted(values) == sorted(
        ["ranks/tp", "ranks/broken", *(o["value"] for o in trace_options(store))]
    )
    assert not any(v.startswith("ranks/") for v in (o["value"] for o in trace_options(store)))


def test_rank_table_holds_the_report_numbers(loaded: LoadedRankSet, reference: RankReport) -> None:
    summary = reference.tables["ranks"]
    rows = rank_rows(loaded.report)
    assert len(rows) == len(summary) == 2
    for row, expected in zip(rows, summary.to_dict("records"), strict=True):
        for key, value in expected.items():
            if isinstance(value, float) and math.isnan(value):
                assert row[key] is None
            else:
                assert row[key] == value, key
    shown = [c["id"] for c in rank_columns(loaded.report)]
    assert shown == [c for c, _, _ in RANK_COLUMNS if c != "clock_offset_us"]  # one host
    assert set(shown) <= set(summary.columns)
    # headers and tooltips are the registry's (one definition per column)
    for col in rank_columns(loaded.report):
        m = RANK_TABLE_METRIC_BY_KEY[col["id"]]
        assert col["name"] == m.label and RANK_DEFINITIONS[col["id"]] == m.definition
        assert (col.get("type") == "numeric") == (m.unit not in ("id", "text"))
    assert RANK_DEFINITIONS["overlap"].endswith(METRIC_BY_KEY["overlap"].definition)
    assert loaded.report.verdicts == reference.verdicts
    assert loaded.members == {
        0: TraceRef("traces", "tp.rank0.pftrace"),
        1: TraceRef("traces", "tp.rank1.pftrace"),
    }


def test_straggler_figure_holds_the_table(loaded: LoadedRankSet, reference: RankReport) -> None:
    table = reference.tables["stragglers"]
    assert len(table) >= 3
    fig = {t.name: t for t in straggler_figure(loaded.report).data}
    rank = fig["straggler rank (its forward ends last)"]
    assert list(rank.x) == table["step"].tolist()
    assert list(rank.y) == table["straggler_rank"].tolist()
    for name, column in (
        ("forward-end spread", "end_spread_ns"),
        ("forward-start spread", "start_spread_ns"),
    ):
        assert list(fig[name].x) == table["step"].tolist()
        np.testing.assert_array_equal(fig[name].y, table[column].to_numpy(float) / 1e3)


def test_collective_heat_map_holds_the_table(loaded: LoadedRankSet, reference: RankReport) -> None:
    table = reference.tables["collectives"]
    heat = collective_wait_figure(loaded.report).data[0]
    assert heat.type == "heatmap" and list(heat.y) == [0, 1]
    steps = sorted(set(table["step"]))
    assert list(heat.x) == steps
    z, parts = np.asarray(heat.z), np.asarray(heat.customdata)
    for row in table.itertuples():
        i, j = list(heat.y).index(row.rank), steps.index(row.step)
        assert z[i, j] == (row.collective_ns + row.arrival_wait_ns) / 1e3
        assert tuple(parts[i, j]) == (row.collective_ns / 1e3, row.arrival_wait_ns / 1e3)
    # wider than the budget: each column is the maximum of its bucket of steps
    thin = collective_wait_figure(loaded.report, max_columns=2).data[0]
    starts = np.linspace(0, len(steps), 3).astype(int)[:-1]
    assert list(thin.x) == [steps[s] for s in starts]
    np.testing.assert_array_equal(np.asarray(thin.z)[:, 0], z[:, : starts[1]].max(axis=1))


def test_rank_set_is_cached_and_feeds_each_rank_page(
    store: TraceStore, loaded: LoadedRankSet
) -> None:
    assert store.load_rank_set(TP) is loaded
    rank1 = store.load(TraceRef("traces", "tp.rank1.pftrace"))
    assert rank1.report is loaded.report.reports[1]  # no second analysis of the same file


def _touch(path: Path) -> None:
    later = os.stat(path).st_mtime_ns + 10**9
    os.utime(path, ns=(later, later))


def test_a_changed_rank_file_is_analysed_again(tmp_path: Path, traces: TraceSet) -> None:
    for p in traces.ranks:
        shutil.copy(p, tmp_path / p.name)
    store = TraceStore(tmp_path, max_cached=4, max_upload_bytes=1)
    first = store.load_rank_set(TP)
    _touch(tmp_path / "tp.rank1.pftrace")
    second = store.load_rank_set(TP)
    assert second is not first
    rank0 = TraceRef("traces", "tp.rank0.pftrace")
    reports = (first.report.reports[0], second.report.reports[0])  # both read rank 0 unchanged
    assert any(store.load(rank0).report is r for r in reports)
    _touch(tmp_path / "tp.rank0.pftrace")  # no cached set read this version of the file
    assert not any(store.load(rank0).report is r for r in reports)


def test_a_corrupt_rank_file_is_an_error_message(store: TraceStore, traces: TraceSet) -> None:
    with pytest.raises(TraceError) as info:
        store.load_rank_set(RankSetRef("broken"))
    message = str(info.value)
    assert message.startswith("broken.rank1.pftrace: not a trace stepscope can read")
    assert str(traces.root) not in message  # no server paths in what the browser sees
    assert store.load_rank_set(TP).report.ranks.ranks == [0, 1]  # the store still works


def test_mixed_world_sizes_and_missing_ranks(tmp_path: Path) -> None:
    recipe = TraceRecipe(num_steps=12, async_scheduling=True)
    for name, rank, world in (("mixed", 0, 2), ("mixed", 1, 4), ("gap", 0, 4), ("gap", 2, 4)):
        write_engine_trace(
            tmp_path / f"{name}.rank{rank}.pftrace", recipe, {"rank": rank, "world_size": world}
        )
    store = TraceStore(tmp_path, max_cached=4, max_upload_bytes=1)
    with pytest.raises(TraceError, match=r"traces of different runs: world sizes \[2, 4\]"):
        store.load_rank_set(RankSetRef("mixed"))
    gap = store.load_rank_set(RankSetRef("gap"))
    assert gap.report.ranks.notes == ["ranks [1, 3] of 4 missing: the tables cover the others"]
    page = str(rank_overview(gap))
    assert "ranks [1, 3] of 4 missing" in page and "2 of 4 ranks" in page
    assert [r["rank"] for r in rank_rows(gap.report)] == [0, 2]


@pytest.mark.parametrize(
    "ref_id", ["ranks/../secret", "ranks/nested", "ranks/sync", "ranks/tp.rank0"]
)
def test_unknown_rank_set_names_are_refused(store: TraceStore, ref_id: str) -> None:
    with pytest.raises(UnsafePathError):
        store.load_rank_set(RankSetRef.parse(ref_id))


def test_the_trace_route_serves_no_rank_set(traces: TraceSet) -> None:
    client = create_app(DashboardConfig(traces_dir=traces.root)).server.test_client()
    assert client.get("/stepscope/trace/ranks/tp").status_code == 404
    assert (
        client.get("/stepscope/trace/traces/tp.rank1.pftrace").data == traces.ranks[1].read_bytes()
    )
