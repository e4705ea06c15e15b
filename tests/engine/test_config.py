"""Feature decisions: explicit True that cannot be honoured fails; auto resolves with a reason."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import ConfigError, EngineConfig, default_max_num_seqs, resolve_features
from engine.scheduler.scheduler import check_limits


def _cfg(**kw):
    return EngineConfig.from_flat(model_config="cfg.json", random_weights=True, **kw)


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
        EngineConfig.from_flat()
    with pytest.raises(ConfigError, match="random_weights"):
        EngineConfig.from_flat(model_config="x.json")


def test_flat_config_is_scalar():
    flat = _cfg().flat()
    assert "cuda_graph_sizes" not in flat  # dead (capture sizes follow max_num_seqs): removed
    assert all(isinstance(v, (str, int, float, bool, type(None))) for v in flat.values())


# The keys of the trace's engine_config instant before the config became a tree (the trace
# contract: extend, never rename), with those added since (KV sizing, warm-up, mixed graphs).
ENGINE_CONFIG_KEYS = {
    "model", "model_config", "random_weights", "tokenizer", "seed", "dtype", "device",
    "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_kv_blocks",
    "enable_prefix_caching", "enable_chunked_prefill", "async_scheduling", "cuda_graphs",
    "triton_kernels", "pinned_memory", "deferred_sampling", "spec_method", "spec_model",
    "num_spec_tokens", "spec_sync_accepted", "debug_invariants", "tensor_parallel_size",
    "trace_kernel_steps", "gpu_memory_utilization", "mixed_graph_max_tokens", "warmup",
    "spec_cuda_graphs", "trace_begins", "graph_stamps", "trace_core", "batch_invariant",
}  # fmt: skip


def test_tree_of_frozen_parts_keeps_the_trace_keys():
    config = _cfg(max_num_seqs=8, block_size=4, spec_method="ngram", num_spec_tokens=2)
    assert set(config.flat()) == ENGINE_CONFIG_KEYS
    # each flat field went to the part that owns it, and the parts are frozen
    assert config.scheduler.max_num_seqs == 8 and config.cache.block_size == 4
    assert config.spec.num_spec_tokens == 2 and config.source.model_config == "cfg.json"
    for part in config.parts():
        with pytest.raises(dataclasses.FrozenInstanceError):
            part.__setattr__(dataclasses.fields(part)[0].name, None)
    # flat() and from_flat() are inverse (the tuple field is written "a,b" in the trace)
    flat = config.flat()
    assert EngineConfig.from_flat(**flat) == config
    resolved = config.resolved(48, 96)
    assert resolved.scheduler.max_model_len == 48 and config.scheduler.max_model_len is None
    assert resolved.cache.num_kv_blocks == 96 and config.cache.num_kv_blocks is None
    assert resolved.spec is config.spec  # the other parts are passed on as they are


def test_unknown_flat_field_is_refused():
    with pytest.raises(TypeError, match="unknown engine config field 'num_gpu_blocks'"):
        _cfg(num_gpu_blocks=4)


@pytest.mark.parametrize(
    ("total_gib", "seqs", "why"),
    [
        (None, 64, "auto: CPU device"),
        (141, 1024, "auto: CUDA device of 141 GiB (>= 70)"),  # H200
        (80, 1024, "auto: CUDA device of 80 GiB (>= 70)"),
        (24, 256, "auto: CUDA device of 24 GiB (< 70)"),
    ],
)
def test_max_num_seqs_follows_the_device_unless_given(total_gib, seqs, why):
    total = None if total_gib is None else total_gib * 2**30
    assert default_max_num_seqs(total) == (seqs, why)
    config, source = _cfg().with_batch_limits(total)
    assert (config.scheduler.max_num_seqs, source) == (seqs, why)
    given, source = _cfg(max_num_seqs=8).with_batch_limits(total)
    assert (given.scheduler.max_num_seqs, source) == (8, "max_num_seqs")


def test_unresolved_max_num_seqs_is_refused_before_it_reaches_a_part():
    config = _cfg()
    assert config.scheduler.max_num_seqs is None  # asked: sized at start-up
    with pytest.raises(ConfigError, match="max_num_seqs is not resolved"):
        config.resolved(512, 64)
    with pytest.raises(ConfigError, match="max_num_seqs is not resolved"):
        check_limits(config.scheduler, config.cache, 0)
