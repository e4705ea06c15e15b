"""The page parts carry the analysis' numbers unchanged, and the trace route refuses escapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from analysis import analyze_trace, compare_reports
from dashboard.app import create_app
from dashboard.config import DashboardConfig
from dashboard.store import TraceRef, TraceStore, UploadError
from dashboard.views import _cards, decision_rows, sync_rows
from tests.dashboard.conftest import TraceSet


def test_cards_hold_the_headline_values(traces: TraceSet) -> None:
    report = analyze_trace(traces.sync)
    cards = {c.key: c.value for c in _cards(report)}
    h = report.headline
    assert cards["overlap"] == h["overlap"]
    assert cards["bubble_ratio"] == h["bubble_ratio"]
    assert cards["wait_accepted_exposed_us"] == h["wait_accepted_exposed_us"]
    assert cards["hot_syncs"] == h["hot_syncs"] == 2
    assert cards["silent_fallbacks"] == len(h["silent_fallbacks"])
    assert cards["top_blame"] == h["top_blame"]["label"]


def test_grammar_card_only_for_structured_traces(traces: TraceSet, tmp_path: Path) -> None:
    """A structured run (the engine on the CPU, async on) gets a grammar card holding the
    headline's numbers; a trace without grammar slices gets none."""
    pytest.importorskip("xgrammar")
    from engine.llm import LLM
    from engine.workload import load_workload
    from instrument.tracer import Tracer

    root = Path(__file__).resolve().parents[2]
    path = tmp_path / "structured.pftrace"
    tracer = Tracer(str(path))
    llm = LLM(model=str(root / "samples/models/pycoder-14m"), tracer=tracer, async_scheduling=True)
    llm.run_workload(load_workload(str(root / "samples/workloads/structured.jsonl"))[:4])
    llm.close()
    tracer.close()
    report = analyze_trace(path)
    card = {c.key: c for c in _cards(report)}["grammar_hidden_frac"]
    h = report.headline
    assert h["grammar_mask_ms"] > 0
    assert card.value == h["grammar_hidden_frac"]
    assert f"{h['grammar_mask_ms']:,.2f} ms of masks" in card.sub
    assert "grammar_hidden_frac" not in {c.key for c in _cards(analyze_trace(traces.sync))}


def test_decision_rows_flag_exactly_the_silent_fallbacks(traces: TraceSet) -> None:
    report = analyze_trace(traces.sync)
    rows = decision_rows(report)
    flagged = {r["feature"] for r in rows if r["silent"]}
    assert (
        flagged
        == set(report.tables["silent_fallbacks"]["feature"])
        == {"cuda_graphs", "async_scheduling"}
    )
    assert len(rows) == len(report.tables["decisions"])


def test_sync_rows_equal_the_summary(traces: TraceSet) -> None:
    report = analyze_trace(traces.sync)
    rows = sync_rows(report)
    summary = report.tables["syncs"]
    assert [(r["op"], r["where"], r["count"], r["hot_after_warmup"]) for r in rows] == [
        (r.op, r.where, r.count, r.hot_after_warmup) for r in summary.itertuples()
    ]
    assert all("model_runner.py:212" in r["stack"] for r in rows)


def test_compare_uses_the_analysis_contract(traces: TraceSet) -> None:
    store = TraceStore(traces.root, max_cached=4, max_upload_bytes=1 << 20)
    _, _, ok = store.compare(
        TraceRef("traces", "sync.pftrace"), TraceRef("traces", "async.pftrace")
    )
    assert ok.contract_ok and list(ok.differences) == ["async_scheduling"]
    _, _, bad = store.compare(
        TraceRef("traces", "sync.pftrace"), TraceRef("traces", "nested/other_model.pftrace")
    )
    ref = compare_reports(analyze_trace(traces.sync), analyze_trace(traces.other_model))
    assert not bad.contract_ok and bad.violations == ref.violations


def test_upload_cap_and_names(tmp_path: Path) -> None:
    store = TraceStore(tmp_path, max_cached=1, max_upload_bytes=1000)
    with pytest.raises(UploadError, match="over the upload limit"):
        store.save_upload("big.pftrace", b"x" * 1001)
    with pytest.raises(UploadError, match="empty"):
        store.save_upload("e.pftrace", b"")
    ref = store.save_upload("../../evil name.pftrace", b"abc")
    assert ref.source == "uploads" and "/" not in ref.name and ".." not in ref.name
    assert store.resolve(ref).read_bytes() == b"abc"


@pytest.mark.parametrize(
    "url",
    [
        "/stepscope/trace/traces/..%2Fsecret.pftrace",
        "/stepscope/trace/traces/%2E%2E/secret.pftrace",
        "/stepscope/trace/traces/nested/..%2F..%2Fsecret.pftrace",
        "/stepscope/trace/traces/escape.pftrace",
        "/stepscope/trace/traces//etc/passwd",
        "/stepscope/trace/traces/%2Fetc%2Fpasswd",
        "/stepscope/trace/elsewhere/sync.pftrace",
        "/stepscope/trace/uploads/..%2Ftraces%2Fsync.pftrace",
        "/stepscope/trace/traces/nested",
    ],
)
def test_trace_route_refuses_escapes(traces: TraceSet, url: str) -> None:
    client = create_app(DashboardConfig(traces_dir=traces.root)).server.test_client()
    response = client.get(url)
    assert response.status_code == 404
    assert b"not for the browser" not in response.data


def test_trace_route_serves_exact_bytes(traces: TraceSet) -> None:
    client = create_app(DashboardConfig(traces_dir=traces.root)).server.test_client()
    plain = client.get("/stepscope/trace/traces/nested/other_model.pftrace")
    assert plain.status_code == 200 and plain.data == traces.other_model.read_bytes()
    download = client.get("/stepscope/trace/traces/sync.pftrace?download=1")
    assert "attachment" in download.headers["Content-Disposition"]
    assert download.data == traces.sync.read_bytes()


def test_config_validation(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        DashboardConfig(traces_dir=tmp_path / "missing")
    with pytest.raises(ValueError, match="max-upload-mb"):
        DashboardConfig(traces_dir=tmp_path, max_upload_mb=0)
    assert DashboardConfig(traces_dir=tmp_path).host == "127.0.0.1"
