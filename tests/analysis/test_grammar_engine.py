"""End to end: the engine on the CPU runs the structured sample workload with async off and on;
``analyze_trace`` reports the grammar work, and deferred sampling hides more of it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("xgrammar")

from analysis import Report, analyze_trace, compare_reports  # noqa: E402
from analysis.metrics.grammar import GRAMMAR_HEADLINE_KEYS  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.workload import load_workload  # noqa: E402
from instrument.tracer import Tracer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "samples" / "models" / "pycoder-14m"
WORKLOAD = ROOT / "samples" / "workloads" / "structured.jsonl"


def _report(tmp_path: Path, async_on: bool) -> Report:
    path = tmp_path / f"structured_{async_on}.pftrace"
    tracer = Tracer(str(path))
    llm = LLM(
        model=str(MODEL),
        tracer=tracer,
        trace_requests=False,
        device="cpu",
        dtype="float32",
        async_scheduling=async_on,
    )
    llm.run_workload(load_workload(str(WORKLOAD)))
    llm.close()
    tracer.close()
    return analyze_trace(path, window="all")


def test_async_hides_more_grammar_work(tmp_path: Path) -> None:
    reports = _report(tmp_path, False), _report(tmp_path, True)
    off, on = (r.headline for r in reports)
    # `stepscope compare` carries the grammar numbers as A/B deltas.
    deltas = compare_reports(*reports).deltas
    for key in ("grammar_hidden_frac", "grammar_wait_exposed_us"):
        assert deltas[key]["a"] == off[key] and deltas[key]["b"] == on[key]
    for h in (off, on):
        assert set(GRAMMAR_HEADLINE_KEYS) <= set(h)
        assert h["grammar_mask_ms"] > 0
    # Without deferred sampling the mask is built before its step is launched: nothing to hide
    # it under, and no step waits for the grammar.
    assert off["grammar_wait_total_us"] == 0.0 and off["grammar_overlap_steps_frac"] == 0.0
    assert on["grammar_wait_total_us"] > 0
    assert on["grammar_overlap_steps_frac"] > 0.8
    assert on["grammar_hidden_frac"] > off["grammar_hidden_frac"] + 0.3
