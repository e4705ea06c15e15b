"""``stepscope run``'s engine flags are generated from the field metadata of ``EngineConfig``'s
parts: every flagged field has its flag, its default is the part's, and the parsed flags build the
config tree."""

from __future__ import annotations

import dataclasses

import pytest

from engine.cli import build_parser, config_from_args
from engine.config import CLI, ConfigError, EngineConfig

# Every flag name `stepscope run --help` listed before the flags were generated.
FLAGS_BEFORE = {
    "--model", "--model-config", "--random-weights", "--tokenizer", "--workload", "--trace",
    "--nvtx", "--trace-requests", "--trace-steps", "--trace-every", "--trace-run-length",
    "--trace-max-mb", "--trace-mode", "--trace-warmup", "--trace-warmup-steps",
    "--trace-writer", "--trace-kernels", "--detect-syncs", "--output", "--async",
    "--cuda-graphs", "--triton", "--pinned-memory", "--dtype", "--device", "--max-num-seqs",
    "--max-num-batched-tokens", "--max-model-len", "--block-size", "--num-kv-blocks",
    "--no-prefix-caching", "--no-chunked-prefill", "--spec-method", "--spec-model",
    "--num-spec-tokens", "--spec-sync-accepted", "--seed", "--tensor-parallel-size",
    "--no-progress", "--help",
}  # fmt: skip
# Added since (issue 17): the KV pool sized from device memory, warm-up before the workload.
FLAGS_ADDED = {"--gpu-memory-utilization", "--warmup"}
BASE = ["--model-config", "cfg.json", "--random-weights", "--workload", "w.jsonl"]


def _flags() -> set[str]:
    return {s for a in build_parser()._actions for s in a.option_strings if s.startswith("--")}


def test_every_flag_kept_and_every_flagged_field_has_one():
    # issues 17, 19, 15 (derived device begins)
    added_later = {
        "--mixed-graph-max-tokens",
        "--spec-cuda-graphs",
        "--trace-begins",
        "--batch-invariant",  # issue 19
        "--trace-graph-stamps",  # issue 15: forward graphs write their own device times
        "--trace-core",  # issue 15: the compiled stage core or the Python one
    }
    assert _flags() == FLAGS_BEFORE | FLAGS_ADDED | added_later
    parser = build_parser()
    dests = {a.dest for a in parser._actions}
    every = [f for part in EngineConfig.part_types().values() for f in dataclasses.fields(part)]
    flagged = {f.name for f in every if CLI in f.metadata}
    assert flagged <= dests
    assert len(flagged) == 28  # every field of the parts but seven with no flag
    assert {f.name for f in every} - flagged == {
        "deferred_sampling",
        "debug_invariants",
        "trace_kernel_steps",
        "trace_begins",
        "graph_stamps",
        "trace_core",
        "long_prefill_token_threshold",
    }


def test_defaults_live_in_the_config():
    config = config_from_args(build_parser().parse_args(BASE))
    assert config == EngineConfig.from_flat(model_config="cfg.json", random_weights=True)


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        (["--async", "off"], "async_scheduling", False),
        (["--cuda-graphs", "on"], "cuda_graphs", True),
        (["--triton", "auto"], "triton_kernels", None),
        (["--no-prefix-caching"], "enable_prefix_caching", False),
        (["--no-chunked-prefill"], "enable_chunked_prefill", False),
        (["--max-model-len", "64"], "max_model_len", 64),
        (["--num-kv-blocks", "300"], "num_kv_blocks", 300),
        ([], "num_kv_blocks", None),
        (["--gpu-memory-utilization", "0.5"], "gpu_memory_utilization", 0.5),
        (["--warmup", "off"], "warmup", False),
        ([], "warmup", None),
        (["--dtype", "bfloat16"], "dtype", "bfloat16"),
        (["--spec-method", "ngram", "--num-spec-tokens", "3"], "num_spec_tokens", 3),
        (["--tensor-parallel-size", "2"], "tensor_parallel_size", 2),
        (["--trace-begins", "recorded"], "trace_begins", "recorded"),
        ([], "trace_begins", "derived"),
        (["--trace-graph-stamps", "off"], "graph_stamps", False),
        ([], "graph_stamps", True),
    ],
)
def test_flags_set_their_field(argv, field, value):
    config = config_from_args(build_parser().parse_args(BASE + argv))
    assert config.flat()[field] == value


def test_bad_values_are_refused():
    with pytest.raises(SystemExit):
        build_parser().parse_args(BASE + ["--async", "maybe"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(BASE + ["--dtype", "int8"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(BASE + ["--trace-begins", "guessed"])
    with pytest.raises(ConfigError, match="trace_begins"):
        EngineConfig.from_flat(model="m", trace_begins="guessed")
    with pytest.raises(SystemExit):  # --model and --model-config are exclusive
        build_parser().parse_args(BASE + ["--model", "m"])
    with pytest.raises(ConfigError, match="power of two"):
        config_from_args(build_parser().parse_args(BASE + ["--block-size", "12"]))
