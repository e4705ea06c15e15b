"""A CUDA-graph capture that fails at start-up: auto falls back to eager and the trace's
``feature_decision`` says so; explicit True is a start-up error (docs/design.md §2.1).

The CPU has no CUDA graphs, so the decision is forced to "capture" and the capture itself is
made to fail (the rest of the engine runs for real)."""

from __future__ import annotations

import dataclasses

import pytest

import engine.core
from analysis import load_trace
from engine.config import ConfigError, FeatureDecision, ResolvedFeatures, resolve_features
from engine.llm import LLM
from engine.runner.cuda_graphs import CudaGraphRunner
from engine.sampling_params import SamplingParams
from instrument.tracer import Tracer


def _force_capture(monkeypatch: pytest.MonkeyPatch, requested: bool | None) -> None:
    """Resolve cuda_graphs as a CUDA device would (on), and make every capture fail."""

    def resolve(config, cuda_available=None) -> ResolvedFeatures:
        features = resolve_features(config, cuda_available)
        features.decisions = tuple(
            FeatureDecision("cuda_graphs", requested, True, "forced on for the test")
            if d.feature == "cuda_graphs"
            else d
            for d in features.decisions
        )
        return features

    def fail(self, device, body, prepare) -> None:
        raise RuntimeError("simulated capture failure\nsecond line")

    monkeypatch.setattr(engine.core, "resolve_features", resolve)
    monkeypatch.setattr(CudaGraphRunner, "capture", fail)


def _llm(tiny_model_config: str, tracer: Tracer | None = None) -> LLM:
    return LLM(
        tracer=tracer,
        model_config=tiny_model_config,
        random_weights=True,
        num_kv_blocks=64,
        max_num_seqs=4,
    )


def test_auto_capture_failure_falls_back_and_is_traced(tmp_path, tiny_model_config, monkeypatch):
    _force_capture(monkeypatch, requested=None)
    path = str(tmp_path / "fallback.pftrace")
    tracer = Tracer(path)
    llm = _llm(tiny_model_config, tracer)
    decision = {d.feature: d for d in llm.engine.features.decisions}["cuda_graphs"]
    assert decision.requested is None and decision.resolved is False
    assert decision.reason == "auto: off, capture failed: RuntimeError: simulated capture failure"
    assert not llm.engine.features.cuda_graphs
    out = llm.generate(
        [[3, 4, 5, 6]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )
    assert len(out[0].output_token_ids) == 4  # it runs, eagerly
    assert llm.engine.runner.graphs.num_replays == 0
    llm.close()
    tracer.close()
    rows = load_trace(path).decisions
    row = rows[rows["feature"] == "cuda_graphs"].iloc[0]
    assert row["resolved"] in (False, "False", 0)
    assert "capture failed: RuntimeError: simulated capture failure" in row["reason"]


def test_explicit_capture_failure_is_a_startup_error(tiny_model_config, monkeypatch):
    _force_capture(monkeypatch, requested=True)
    with pytest.raises(ConfigError, match="cuda_graphs=True cannot be honoured: capture failed"):
        _llm(tiny_model_config)


def test_fall_back_replaces_only_that_decision():
    d = FeatureDecision("cuda_graphs", None, True, "auto: on")
    other = FeatureDecision("pinned_memory", None, True, "auto: on")
    features = ResolvedFeatures((d, other))
    features.fall_back("cuda_graphs", "capture failed: X")
    assert features.decisions == (
        dataclasses.replace(d, resolved=False, reason="auto: off, capture failed: X"),
        other,
    )
    with pytest.raises(KeyError):
        features.fall_back("nope", "x")
    explicit = ResolvedFeatures((dataclasses.replace(d, requested=True),))
    with pytest.raises(ConfigError, match="cuda_graphs=True cannot be honoured: boom"):
        explicit.fall_back("cuda_graphs", "boom")
