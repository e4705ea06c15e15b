"""Feature decisions: explicit True that cannot be honoured fails; auto resolves with a reason."""

from __future__ import annotations

import pytest

from engine.config import ConfigError, EngineConfig, resolve_features


def _cfg(**kw):
    return EngineConfig(model_config="cfg.json", random_weights=True, **kw)


@pytest.mark.parametrize(
    ("kw", "cuda", "feature", "resolved", "reason_part"),
    [
        ({}, False, "cuda_graphs", False, "no CUDA device"),
        ({}, False, "pinned_memory", False, "no CUDA device"),
        ({}, False, "async_scheduling", True, "GIL"),
        ({"device": "cuda"}, True, "cuda_graphs", True, "auto"),
        ({"async_scheduling": False}, False, "deferred_sampling", False, "async scheduling is off"),
        ({"async_scheduling": False}, False, "async_scheduling", False, "off as requested"),
        ({"spec_method": "ngram", "num_spec_tokens": 3}, False, "spec_method", "ngram", "3 tokens"),
    ],
)
def test_resolution(kw, cuda, feature, resolved, reason_part):
    config = _cfg(**kw)
    decisions = {d.feature: d for d in resolve_features(config, cuda_available=cuda).decisions}
    d = decisions[feature]
    assert d.resolved == resolved and reason_part in d.reason
    assert all(d.reason for d in decisions.values())  # never silent
    # the user's request is kept as given
    assert d.requested == kw.get(
        feature, None if feature != "spec_method" else kw.get("spec_method")
    )


@pytest.mark.parametrize(
    ("kw", "cuda", "message"),
    [
        ({"cuda_graphs": True}, False, "cuda_graphs=True cannot be honoured: no CUDA device"),
        ({"pinned_memory": True}, False, "pinned_memory=True cannot be honoured"),
        ({"device": "cuda"}, False, "torch sees no CUDA device"),
        ({"async_scheduling": False, "deferred_sampling": True}, False, "deferred_sampling=True"),
    ],
)
def test_impossible_requests_fail_at_startup(kw, cuda, message):
    with pytest.raises(ConfigError, match=message):
        resolve_features(_cfg(**kw), cuda_available=cuda)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"block_size": 12}, "power of two"),
        ({"spec_method": "medusa", "num_spec_tokens": 2}, "spec_method must be one of"),
        ({"spec_method": "ngram"}, "num_spec_tokens >= 1"),
        ({"num_spec_tokens": 2}, "without a spec_method"),
        ({"spec_method": "draft", "num_spec_tokens": 2}, "needs spec_model"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
        ({"device": "tpu"}, "device must be"),
    ],
)
def test_invalid_config(kw, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(**kw)


def test_model_source_required():
    with pytest.raises(ConfigError, match="exactly one of model"):
        EngineConfig()
    with pytest.raises(ConfigError, match="random_weights"):
        EngineConfig(model_config="x.json")


def test_flat_config_is_scalar():
    flat = _cfg().flat()
    assert "cuda_graph_sizes" not in flat  # dead (capture sizes follow max_num_seqs): removed
    assert all(isinstance(v, (str, int, float, bool, type(None))) for v in flat.values())
