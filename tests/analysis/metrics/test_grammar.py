"""Grammar work under device work (analysis.metrics.grammar): hand-worked and random synthetic traces
checked against a brute-force interval computation, a Kineto trace, and absent grammar work."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis import HEADLINE_KEYS, analyze_trace
from analysis.metrics.grammar import GRAMMAR_COLUMNS, GRAMMAR_HEADLINE_KEYS, grammar_by_step
from tracekit.perfetto import TraceSpec, write
from tracekit.recipes import blocked_trace as _blocked

S = 1000  # 1 µs: every boundary below is a multiple of S


def _worked() -> TraceSpec:
    """Device: forward 1 [100,200), sample 1 [200,220), forward 2 [240,340), sample 2 [350,370),
    forward 3 [410,450); window [100,450), idle [220,240) + [340,350) + [370,410).

    Step 1: grammar wait on output 1 [120,230): hidden [120,220), exposed [220,230).
    Step 2 (deferred): grammar_mask [235,300), forward 2 began at 240 < 300; hidden [240,300).
    Step 3 (masked before launch): grammar_mask [380,400), all idle; forward 3 began at 410.
    """
    t = TraceSpec()
    t.gpu("forward", 100 * S, 200 * S, step=1)
    t.gpu("sample", 200 * S, 220 * S, step=1)
    t.cpu("wait_output", 120 * S, 230 * S, step=1, kind="grammar")
    t.cpu("grammar_mask", 235 * S, 300 * S, step=2)
    t.gpu("forward", 240 * S, 340 * S, step=2)
    t.cpu("wait_output", 300 * S, 370 * S, step=2, kind="sampled")
    t.gpu("sample", 350 * S, 370 * S, step=2)
    t.cpu("grammar_mask", 380 * S, 400 * S, step=3)
    t.gpu("forward", 410 * S, 450 * S, step=3)
    return t


def test_worked_example(tmp_path: Path) -> None:
    report = analyze_trace(write(_worked(), tmp_path / "g.pftrace"), window="all", skip_steps=0)
    h = report.headline
    assert h["grammar_mask_ms"] == pytest.approx(0.085)
    assert h["grammar_hidden_frac"] == pytest.approx(60 / 85)
    assert h["grammar_wait_total_us"] == 110.0
    assert h["grammar_wait_exposed_us"] == 10.0
    assert h["grammar_overlap_steps_frac"] == 0.5
    table = report.tables["grammar"]
    assert table.dtypes.astype(str).to_dict() == GRAMMAR_COLUMNS
    assert table.drop(columns="device_before_mask_end").values.tolist() == [
        [1, 0, 0, 110 * S, 10 * S],
        [2, 65 * S, 60 * S, 0, 0],
        [3, 20 * S, 0, 0, 0],
    ]
    assert table["device_before_mask_end"].tolist() == [pd.NA, True, False]
    (sentence,) = [v for v in report.verdicts if v.startswith("Grammar work")]
    assert sentence == (
        "Grammar work: 71% of 0.09 ms hidden under device work; device work began before the "
        "step's mask was built in 50% of masked steps; 0.01 ms of 0.11 ms grammar wait exposed."
    )
    out = report.to_dict()
    assert set(GRAMMAR_HEADLINE_KEYS) <= set(HEADLINE_KEYS) <= set(out)
    assert out["tables"]["grammar"][0]["device_before_mask_end"] is None
    json.dumps(out, allow_nan=False)


def test_window_restricts_grammar_metrics(tmp_path: Path) -> None:
    report = analyze_trace(write(_worked(), tmp_path / "g.pftrace"), window="2:4")
    assert report.tables["grammar"]["step"].tolist() == [2, 3]
    h = report.headline
    assert (h["grammar_mask_ms"], h["grammar_wait_total_us"]) == (0.085, 0.0)
    assert h["grammar_hidden_frac"] == pytest.approx(60 / 85)


def test_no_grammar_work_is_cleanly_absent(tmp_path: Path) -> None:
    report = analyze_trace(write(_blocked(), tmp_path / "b.pftrace"), skip_steps=0)
    assert {k: report.headline[k] for k in GRAMMAR_HEADLINE_KEYS} == {
        "grammar_mask_ms": 0.0,
        "grammar_hidden_frac": None,
        "grammar_wait_total_us": 0.0,
        "grammar_wait_exposed_us": 0.0,
        "grammar_overlap_steps_frac": None,
    }
    table = report.tables["grammar"]
    assert table.empty and table.dtypes.astype(str).to_dict() == GRAMMAR_COLUMNS
    assert not any(v.startswith("Grammar work") for v in report.verdicts)


def _random_trace(seed: int) -> TraceSpec:
    """Steps on one CPU thread and one device stream, each with random gaps; a step may have a
    grammar wait, a grammar mask, both or neither, and its device work may start before, inside
    or after its mask."""
    rng = random.Random(seed)
    t = TraceSpec()
    cpu, dev = 0, rng.randint(0, 30)
    for step in range(1, 9):
        if rng.random() < 0.7:
            cpu += rng.randint(0, 20)
            end = cpu + rng.randint(1, 60)
            t.cpu("wait_output", cpu * S, end * S, step=step, kind="grammar")
            cpu = end
        if rng.random() < 0.2:
            cpu += rng.randint(0, 20)
            end = cpu + rng.randint(1, 40)
            t.cpu("wait_output", cpu * S, end * S, step=step, kind="sampled")
            cpu = end
        anchor = cpu
        if rng.random() < 0.8:
            cpu += rng.randint(0, 20)
            anchor, end = cpu, cpu + rng.randint(1, 40)
            t.cpu("grammar_mask", cpu * S, end * S, step=step)
            cpu = end
        dev = max(dev, anchor + rng.randint(-40, 40))
        for name in ("input_prep", "forward", "sample"):
            end = dev + rng.randint(1, 20)
            t.gpu(name, dev * S, end * S, step=step)
            dev = end + rng.randint(0, 10)
    return t


def _brute_force(t: TraceSpec) -> dict[str, object]:
    """The same numbers from one boolean per µs: B, idle, G_s, W_s, first device start."""
    horizon = max(end for _, _, _, end, _ in t.slices) // S + 1
    busy = np.zeros(horizon, bool)
    first_dev: dict[int, int] = {}
    for track, _, start, end, args in t.slices:
        if track.endswith("compute"):
            busy[start // S : end // S] = True
            step = int(args["step"])  # type: ignore[call-overload]
            first_dev[step] = min(first_dev.get(step, 1 << 62), start)
    dev_starts = [s for tr, _, s, _, _ in t.slices if tr.endswith("compute")]
    dev_ends = [e for tr, _, _, e, _ in t.slices if tr.endswith("compute")]
    idle = np.zeros(horizon, bool)
    idle[min(dev_starts) // S : max(dev_ends) // S] = True
    idle &= ~busy
    masks: dict[int, np.ndarray] = {}
    waits: dict[int, np.ndarray] = {}
    mask_end: dict[int, int] = {}
    for _, name, start, end, args in t.slices:
        step = int(args.get("step", -1))  # type: ignore[call-overload]
        if name == "grammar_mask":
            masks.setdefault(step, np.zeros(horizon, bool))[start // S : end // S] = True
            mask_end[step] = max(mask_end.get(step, 0), end)
        elif name == "wait_output" and args.get("kind") == "grammar":
            waits.setdefault(step, np.zeros(horizon, bool))[start // S : end // S] = True
    mask_ns = sum(int(m.sum()) for m in masks.values()) * S
    hidden_ns = sum(int((m & busy).sum()) for m in masks.values()) * S
    flags = [first_dev[s] < mask_end[s] for s in masks if s in first_dev]
    return {
        "grammar_mask_ms": mask_ns / 1e6,
        "grammar_hidden_frac": hidden_ns / mask_ns if mask_ns else None,
        "grammar_wait_total_us": sum(int(w.sum()) for w in waits.values()) * S / 1e3,
        "grammar_wait_exposed_us": sum(int((w & idle).sum()) for w in waits.values()) * S / 1e3,
        "grammar_overlap_steps_frac": float(np.mean(flags)) if flags else None,
    }


@pytest.mark.parametrize("seed", range(12))
def test_random_traces_match_brute_force(tmp_path: Path, seed: int) -> None:
    spec = _random_trace(seed)
    report = analyze_trace(write(spec, tmp_path / "r.pftrace"), window="all", skip_steps=0)
    got = {k: report.headline[k] for k in GRAMMAR_HEADLINE_KEYS}
    want = _brute_force(spec)
    assert got == pytest.approx(want), seed


def _kineto(path: Path) -> Path:
    """vLLM-style Kineto trace (µs): step 0 builds its bitmask while its kernel runs; step 1
    builds it before launching. A device-side annotation named like a grammar range is not CPU
    grammar work and must be ignored."""

    def x(cat: str, name: str, ts: float, dur: float, pid: int = 1, tid: int = 1, **args):
        return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts,
                "dur": dur, "args": args}  # fmt: skip

    events = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "python"}},
        x("user_annotation", "ProfilerStep#0", 0, 100),
        x("cuda_runtime", "cudaLaunchKernel", 5, 5, correlation=1),
        x("kernel", "gemm", 20, 60, pid=0, tid=7, device=0, stream=7, correlation=1),
        x("user_annotation", "structured_output: grammar_bitmask", 30, 20),
        x("gpu_user_annotation", "grammar_bitmask", 20, 60, pid=0, tid=7, device=0, stream=7),
        x("user_annotation", "ProfilerStep#1", 100, 100),
        x("user_annotation", "structured_output: grammar_bitmask", 105, 10),
        x("cuda_runtime", "cudaLaunchKernel", 120, 5, correlation=3),
        x("kernel", "gemm", 130, 50, pid=0, tid=7, device=0, stream=7, correlation=3),
    ]
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    return path


def test_kineto_grammar_ranges(tmp_path: Path) -> None:
    report = analyze_trace(_kineto(tmp_path / "k.json"), "vllm", skip_steps=0, window="all")
    assert {k: report.headline[k] for k in GRAMMAR_HEADLINE_KEYS} == pytest.approx(
        {
            "grammar_mask_ms": 0.030,
            "grammar_hidden_frac": 20 / 30,
            "grammar_wait_total_us": 0.0,
            "grammar_wait_exposed_us": 0.0,
            "grammar_overlap_steps_frac": 0.5,
        }
    )
    assert report.tables["grammar"]["device_before_mask_end"].tolist() == [True, False]


def test_kineto_without_grammar_ranges() -> None:
    data = Path(__file__).resolve().parents[2] / "data" / "kineto_gpu_small.json"
    h = analyze_trace(data, skip_steps=0).headline
    assert (h["grammar_mask_ms"], h["grammar_hidden_frac"], h["grammar_overlap_steps_frac"]) == (
        0.0,
        None,
        None,
    )


@pytest.mark.parametrize(("device_start", "before"), [(1, True), (2, False)])
def test_overlap_flag_is_exact_on_large_clocks(device_start: int, before: bool) -> None:
    """Host-clock ns near 2**60 lose their last bits as floats; the flag must not."""
    big = 1 << 60
    sl = pd.DataFrame(
        {
            "name": ["wait_output", "grammar_mask", "forward"],
            "kind": ["grammar", "", ""],
            "role": ["cpu", "cpu", "compute"],
            "step": [2, 3, 3],  # step 2: a wait and no mask (a missing value in the outer join)
            "ts_ns": [big - 9, big, big + device_start],
            "end_ns": [big - 1, big + 2, big + 5],
        }
    )
    busy = (np.array([big + device_start]), np.array([big + 5]))
    table = grammar_by_step(sl, busy, (np.zeros(0, np.int64),) * 2)
    assert table["device_before_mask_end"].tolist() == [pd.NA, before]
    assert table["mask_hidden_ns"].tolist() == [0, 2 - device_start]
