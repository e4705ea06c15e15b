"""The forked trace prefetch of ``stepscope analyze`` (analysis.loading.prefetch): the frames and
every error are those of the plain in-process ``load_trace``, which is the reference here."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest

from analysis import TraceError, load_trace
from analysis.cli import analyze_main
from analysis.loading.prefetch import TracePrefetch

ROOT = Path(__file__).resolve().parents[3]
REAL = ROOT / "tests" / "data" / "real"
VLLM = REAL / "tracelens" / "inference" / "vllm_prefilldecode_piecewise" / "graph_execution.json.gz"
can_fork = pytest.mark.skipif(
    not hasattr(os, "fork") or threading.active_count() > 1, reason="needs fork, no other threads"
)


def _same_frames(a: object, b: object) -> None:
    for name in ("slices", "instants", "counters", "flows", "tracks", "decisions", "syncs"):
        pd.testing.assert_frame_equal(getattr(a, name), getattr(b, name), obj=name)
    assert a.metadata == b.metadata  # type: ignore[attr-defined]
    assert a.config == b.config  # type: ignore[attr-defined]


@can_fork
@pytest.mark.parametrize(
    "path",
    [
        VLLM,
        REAL / "hta" / "nccl_parser_config" / "nccl_data.json.gz",  # distributedInfo, NCCL
        ROOT / "tests" / "data" / "kineto_gpu_small.json",  # plain JSON, not gzip
        ROOT / "tests" / "data" / "stepscope_small.pftrace",  # not Kineto: loaded in place
    ],
    ids=lambda p: p.name,
)
def test_prefetched_frames_equal_load_trace(path: Path) -> None:
    prefetch = TracePrefetch(str(path), 2048.0)
    assert prefetch.forked
    _same_frames(prefetch.load(None), load_trace(path))


def _counter_trace(tmp_path: Path) -> Path:
    doc = json.loads(gzip.decompress(VLLM.read_bytes()))
    doc["traceEvents"].append({"ph": "C", "name": "mem", "ts": 1.0, "pid": 1, "args": {"a": 3}})
    path = tmp_path / "counters.json"
    path.write_text(json.dumps(doc))
    return path


@can_fork
def test_prefetched_counters_and_lenient_shapes(tmp_path: Path) -> None:
    path = _counter_trace(tmp_path)
    _same_frames(TracePrefetch(str(path), 2048.0).load(None), load_trace(path))
    odd = tmp_path / "odd.json"  # a string timestamp: the typed decoder refuses, lenient loads
    odd.write_text(json.dumps([{"ph": "X", "cat": "kernel", "name": "k", "ts": "5", "dur": 2}]))
    _same_frames(TracePrefetch(str(odd), 2048.0).load(None), load_trace(odd))


@can_fork
@pytest.mark.parametrize(
    ("content", "limit_mb"),
    [
        (b"", 2048.0),
        (b"{}", 2048.0),
        (b'{"traceEvents": []}', 2048.0),
        (b'{"traceEvents": [{"ph": "X", "na', 2048.0),
        (b"[" * 200_000 + b"]" * 200_000, 2048.0),  # nested too deeply
        (gzip.compress(b"[" + b" " * (3 * 2**20) + b"]"), 1.0),  # over the gunzip limit
        (gzip.compress(b"[]"), -1.0),  # a bad limit
    ],
    ids=["empty", "no-events-key", "no-events", "cut-json", "deep", "bomb", "bad-limit"],
)
def test_prefetch_errors_are_load_trace_errors(
    tmp_path: Path, content: bytes, limit_mb: float
) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(TraceError) as plain:
        load_trace(path, max_decompressed_mb=limit_mb)
    prefetch = TracePrefetch(str(path), limit_mb)
    with pytest.raises(TraceError) as forked:
        prefetch.load(None)
    assert str(forked.value) == str(plain.value)
    missing = TracePrefetch(str(tmp_path / "nope.json"), 2048.0)
    with pytest.raises(TraceError, match="no such trace file"):
        missing.load(None)


def test_cli_in_a_fresh_process_prints_what_the_library_reports(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A fresh interpreter has not imported pandas, so the CLI forks the decoder; its JSON must
    equal the in-process CLI's (which loads in place: pandas is already imported here)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = "import sys, analysis.cli; print('pandas' in sys.modules)"
    lazy = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert lazy.stdout.strip() == "False", lazy.stderr  # `import analysis.cli` stays light
    cmd = [sys.executable, "-m", "stepscope.cli", "analyze", str(VLLM), "--json"]
    fresh = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    assert fresh.returncode == 0, fresh.stderr
    assert analyze_main([str(VLLM), "--json"]) == 0
    assert fresh.stdout == capsys.readouterr().out


def test_prefetch_without_fork_loads_in_place() -> None:
    prefetch = TracePrefetch(str(VLLM), 2048.0, fork=False)
    assert not prefetch.forked
    _same_frames(prefetch.load(None), load_trace(VLLM))


def test_cli_pauses_the_cycle_collector_and_restores_it_in_process(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``stepscope analyze`` runs with the cyclic GC paused (stepscope/cli.py); called in-process
    it leaves the collector as it found it (enabled, nothing frozen) and prints the same JSON."""
    import gc

    import analysis.cli
    from stepscope.cli import main

    seen: list[bool] = []

    def spy(argv: list[str]) -> int:
        seen.append(gc.isenabled())
        return analyze_main(argv)

    monkeypatch.setattr(analysis.cli, "analyze_main", spy)
    frozen = gc.get_freeze_count()
    assert gc.isenabled()
    assert main(["analyze", str(VLLM), "--json"]) == 0
    assert seen == [False]
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    via_main = capsys.readouterr().out
    assert analyze_main([str(VLLM), "--json"]) == 0
    assert via_main == capsys.readouterr().out


_SPY = """
import sys
import analysis.forked as forked
joined = []
result = forked.Forked.result
def spy(self):
    joined.append(("pandas" in sys.modules, "analysis.report" in sys.modules))
    return result(self)
forked.Forked.result = spy
import atexit
atexit.register(lambda: print("joined", joined, file=sys.stderr))
from stepscope.cli import main
sys.exit(main())
"""


@can_fork
def test_cli_imports_the_analysis_while_the_child_decodes_and_exits_cleanly(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The decode child is joined only after pandas and the metrics are imported (the overlap
    the fork is for); the whole-process CLI ends with os._exit after its output and the atexit
    handlers (stepscope/cli.py): same JSON as in-process, same exit codes and messages."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", _SPY, "analyze", str(VLLM), "--json"]
    fresh = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    assert fresh.returncode == 0, fresh.stderr
    assert "joined [(True, True)" in fresh.stderr  # the first join, the decoder's: imported
    assert analyze_main([str(VLLM), "--json"]) == 0
    assert fresh.stdout == capsys.readouterr().out
    bad = tmp_path / "cut.json"
    bad.write_text('{"traceEvents": [')
    failed = subprocess.run(
        [sys.executable, "-c", _SPY, "analyze", str(bad)], capture_output=True, text=True, env=env
    )
    assert failed.returncode == 2
    assert failed.stderr.startswith("stepscope analyze: not valid JSON")
    assert "joined" in failed.stderr  # atexit handlers ran on the error path too
