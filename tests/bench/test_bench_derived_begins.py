"""bench/bench_derived_begins.py on a ``stepscope run --trace-begins both`` trace of the tiny CPU
engine, and bench_trace_overhead.py's ``--trace-begins`` reaching the traced engine."""

from __future__ import annotations

import json

import numpy as np

from analysis import analyze_trace, load_trace
from bench.bench_derived_begins import main, with_derived_begins
from bench.bench_trace_overhead import main as overhead_main
from engine.cli import run_main
from tests.engine.conftest import TINY_QWEN3


def test_derived_begin_errors_and_metrics_of_a_both_trace(tmp_path, capsys):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_QWEN3))
    trace = str(tmp_path / "both.pftrace")
    code = run_main(
        ["--model-config", str(config), "--random-weights", "--workload",
         "synthetic:n=4,in=8-8,out=48-48,vocab=100,seed=0", "--max-num-seqs", "4",
         "--num-kv-blocks", "128", "--no-progress", "--trace", trace, "--trace-begins", "both"]
    )  # fmt: skip
    assert code == 0
    out_json = tmp_path / "errors.json"
    result = main([trace, "--json", str(out_json)])
    printed = capsys.readouterr().out
    assert json.loads(out_json.read_text()) == result and result["begins"] == "both"
    stages = result["stages"]
    # The stages that are not contiguous in a plain decode step carry a derived begin; forward
    # and sample begin at the previous end (exact: none).
    assert set(stages) == {"h2d_inputs", "input_prep", "d2h_output"}, stages
    # Brute force from the trace: every slice with a derived begin, one count per step.
    frames = load_trace(trace)
    device = frames.slices[frames.slices["track"].str.startswith("gpu:0")]
    for name, e in stages.items():
        named = device[device["name"] == name]
        # the first slice on each stream records its begin in derived mode too: no derived arg
        assert named["derived_begin_ns"].isna().sum() == 1
        mine = named.dropna(subset=["derived_begin_ns"])
        err = (mine["ts_ns"] - mine["derived_begin_ns"].astype("int64")).to_numpy() / 1e3
        assert e["count"] == len(mine) >= 40
        assert e["max_us"] == err.max() and e["min_us"] == err.min()
        assert e["p50_us"] == np.percentile(err, 50) and e["p99_us"] == np.percentile(err, 99)
        # On the CPU a stream's worker stamps an event when it reaches it, after the host's
        # record: the derived begin is a lower bound, early by the worker's wake-up (small).
        assert e["negative"] == 0 and e["min_us"] >= 0
        assert e["p50_us"] < 2_000, e  # well under the ~3 ms a decode step takes here
        assert e["p50_us"] <= e["p90_us"] <= e["p99_us"] <= e["max_us"]
        assert f"{name:<12} {e['count']:>6}" in printed
    # overlap / bubble_ratio: the analysis package's, with recorded and with derived begins.
    head = analyze_trace(trace).headline
    metrics = result["metrics"]
    assert metrics["recorded"] == {"overlap": head["overlap"], "bubble_ratio": head["bubble_ratio"]}
    substituted = with_derived_begins(frames).slices
    moved = substituted["ts_ns"] != frames.slices["ts_ns"]
    assert moved.sum() > 0 and (substituted["ts_ns"] <= frames.slices["ts_ns"]).all()
    assert (substituted["dur_ns"] == substituted["end_ns"] - substituted["ts_ns"]).all()
    # Earlier begins make the slices longer: idle between them can only shrink.
    assert metrics["derived"]["bubble_ratio"] <= metrics["recorded"]["bubble_ratio"]
    # The CPU device's copy workers wake late: its derived begins can be ms early, and overlap
    # has moved by up to 0.08 here (torch on one thread); the H200's moved by < 0.002.
    assert abs(metrics["derived"]["overlap"] - metrics["recorded"]["overlap"]) <= 0.15
    assert "bubble_ratio recorded begins" in printed


def test_overhead_bench_passes_trace_begins_to_the_traced_engine(tmp_path):
    """--interleaved --time-records with --trace-begins derived: a traced steady decode step
    records 5 events (8 with recorded begins), an untraced one the runner's 3."""
    result = overhead_main(
        ["--interleaved", "--modes", "off,trace", "--num-requests", "4", "--max-num-seqs", "4",
         "--in-len", "8", "--out-len", "48", "--block-steps", "16", "--skip-steps", "2",
         "--min-run-s", "0", "--time-records", "--trace-begins", "derived",
         "--out", str(tmp_path / "il.json")]
    )  # fmt: skip
    records = result["interleaved"]["trace"]["event_records"]
    assert records["traced"]["per_step"] == 5.0 and records["untraced"]["per_step"] == 3.0
    trace = f"{result['config']['trace_dir']}/trace.pftrace"
    assert load_trace(trace).metadata["device_begins"] == "derived"
