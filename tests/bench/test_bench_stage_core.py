"""bench/bench_stage_core.py: both cores run the runner's stages of a decode step, alternated,
the compiled one recording through the driver pointer; the JSON holds what it printed. And
``stepscope run --trace-core`` reaches the engine's timeline."""

from __future__ import annotations

import json

import pytest

from bench.bench_stage_core import main
from engine.cli import run_main
from instrument.schema import Arg
from tests.engine.conftest import TINY_QWEN3
from tests.instrument.conftest import read_trace


def test_the_micro_bench_times_both_cores(tmp_path, capsys):
    out = tmp_path / "core.json"
    assert main(["--steps", "200", "--rounds", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    printed = capsys.readouterr().out
    for core in ("python", "c"):
        assert len(result[core]["blocks_us"]) == 2
        assert 0 < result[core]["min_us"] <= result[core]["median_us"] <= result[core]["max_us"]
        assert f"  {core:<7} {result[core]['median_us']:7.2f}" in printed
    # Every record of a pooled event (all but each event's first) went through the pointer.
    assert result["direct_records"] > 3 * 200
    assert 0 < result["c_over_python_paired_median"]


@pytest.mark.parametrize("core", ["python", "c"])
def test_run_trace_core_reaches_the_timeline(tmp_path, core):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_QWEN3))
    trace = str(tmp_path / f"{core}.pftrace")
    code = run_main(
        ["--model-config", str(config), "--random-weights", "--workload",
         "synthetic:n=4,in=8-8,out=24-24,vocab=100,seed=0", "--max-num-seqs", "4",
         "--num-kv-blocks", "128", "--no-progress", "--trace", trace, "--trace-core", core]
    )  # fmt: skip
    assert code == 0
    read = read_trace(trace)
    cores = [e.args[Arg.STAGE_CORE.value] for e in read.events if Arg.STAGE_CORE.value in e.args]
    assert cores == [core if core == "c" else "python (asked for)"]
    assert any(e.track.startswith("gpu:") for e in read.events)  # the stages became slices
