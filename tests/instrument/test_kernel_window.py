"""Kernel windows: stage attribution against a brute-force reference, and ``--trace-kernels`` on
the CPU (a clear start-up error, never a silent no-op)."""

from __future__ import annotations

import random

import pytest

from engine.cli import build_parser, config_from_args, run_main
from engine.config import ConfigError, EngineConfig, resolve_features
from instrument.kernel_window import (
    KernelRecord,
    StageSpan,
    activity_kind,
    attribute_kernels,
    combine_brackets,
    kind_from_name,
)

MODEL = "samples/models/pycoder-14m"


def _brute(k: KernelRecord, stages: list[StageSpan], tol: int) -> set[StageSpan]:
    """Every slice containing the kernel's midpoint, or else the nearest within tol."""
    mid = (k.start_ns + k.end_ns) // 2
    inside = {s for s in stages if s.start_ns <= mid <= s.end_ns}
    if inside:
        return inside
    dist = {s: max(s.start_ns - mid, mid - s.end_ns) for s in stages}
    near = [s for s in stages if dist[s] <= tol]
    return {min(near, key=lambda s: dist[s])} if near else set()


def _pipeline(num_steps: int, rng: random.Random) -> tuple[list[StageSpan], list[KernelRecord]]:
    """Async-like steps: compute stages back to back on stream 7; h2d of step N+1 (stream 9)
    overlaps the forward of step N; a kernel or two per stage."""
    stages, kernels, t = [], [], 0
    for step in range(num_steps):
        for name in ("input_prep", "forward", "sample"):
            dur = rng.randint(20_000, 200_000)
            stages.append(StageSpan("compute", name, step, t, t + dur))
            for _ in range(rng.randint(1, 3)):
                a = rng.randint(t, t + dur - 2000)
                kernels.append(KernelRecord(f"k_{name}", "kernel", 7, a, a + 1000))
            if name == "forward":  # next step's inputs copy while this forward runs
                h = t + dur // 3
                stages.append(StageSpan("copy", "h2d_inputs", step + 1, h, h + 5000))
                kernels.append(KernelRecord("Memcpy HtoD", "memcpy", 9, h + 1000, h + 3000))
            t += dur + rng.randint(0, 30_000)
    return stages, sorted(kernels, key=lambda k: k.start_ns)


def test_attribution_matches_brute_force_and_resolves_overlaps_by_stream() -> None:
    rng = random.Random(3)
    stages, kernels = _pipeline(30, rng)
    stray = KernelRecord("late", "kernel", 7, stages[-1].end_ns + 5_000, stages[-1].end_ns + 6_000)
    lost = KernelRecord("lost", "kernel", 7, stages[-1].end_ns + 90_000, stages[-1].end_ns + 91_000)
    kernels += [stray, lost]
    got = attribute_kernels(kernels, stages, tolerance_ns=20_000)
    for k, stage in zip(kernels, got, strict=True):
        candidates = _brute(k, stages, 20_000)
        if not candidates:
            assert stage is None, k
            continue
        assert stage in candidates, k
        if k.stream == 9:  # inside a forward and an h2d_inputs slice: its stream copies
            assert stage.name == "h2d_inputs", k
        else:
            assert stage.lane == "compute" and k.name == "late" or k.name == f"k_{stage.name}"
    assert got[-1] is None and got[-2] is not None and got[-2].name == "sample"


@pytest.mark.parametrize(
    ("kineto", "ours"),
    [("kernel", "kernel"), ("gpu_memcpy", "memcpy"), ("gpu_memset", "memset"),
     ("cuda_runtime", None), ("gpu_user_annotation", None), ("cpu_op", None)],
)  # fmt: skip
def test_activity_kinds(kineto: str, ours: str | None) -> None:
    assert activity_kind(kineto) == ours


def test_trace_kernels_on_the_cpu_is_a_start_up_error() -> None:
    config = EngineConfig.from_flat(model=MODEL, trace_kernel_steps=(2, 6))
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        resolve_features(config, cuda_available=False)
    off = resolve_features(EngineConfig.from_flat(model=MODEL), cuda_available=False)
    decision = next(d for d in off.decisions if d.feature == "trace_kernels")
    assert (decision.requested, decision.resolved) == (False, False)
    on = resolve_features(
        EngineConfig.from_flat(model=MODEL, device="cuda", trace_kernel_steps=(2, 6)),
        cuda_available=True,
    )
    assert on.trace_kernels


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--trace-kernels", "2:6"], "give --trace PATH too"),
        (["--trace", "{tmp}/t.pftrace", "--trace-kernels", "4:"], "bounded window"),
        (["--trace", "{tmp}/t.pftrace", "--trace-kernels", "6:2"], "empty or negative"),
        (["--trace", "{tmp}/t.pftrace", "--trace-kernels", "2:6"], "needs a CUDA device"),
    ],
)
def test_trace_kernels_flag_errors(tmp_path, capsys, flags: list[str], message: str) -> None:
    argv = ["--model", MODEL, "--workload", "synthetic:n=2,in=4-4,out=2-2", "--no-progress"]
    argv += [f.format(tmp=tmp_path) for f in flags]
    assert run_main(argv) == 2
    assert message in capsys.readouterr().err


def test_trace_kernels_flag_parses_into_the_config(tmp_path) -> None:
    args = build_parser().parse_args(
        [
            "--model",
            MODEL,
            "--workload",
            "x.jsonl",
            "--trace",
            "t.pftrace",
            "--trace-kernels",
            "3:9",
        ]
    )
    assert config_from_args(args).tracing.trace_kernel_steps == (3, 9)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("Memcpy DtoH (Device -> Pinned)", "memcpy"),
        ("Memset (Device)", "memset"),
        ("void at::native::vectorized_elementwise_kernel<4>", "kernel"),
        ("_attention_decode_kernel", "kernel"),
        ("Event Sync", None),
        ("Stream Wait Event", None),
    ],
)
def test_kind_from_name_for_torch_without_activity_type(name: str, kind: str | None) -> None:
    assert kind_from_name(name) == kind


def test_marker_brackets_intersect_so_the_tight_one_wins() -> None:
    # The H200's start marker (a first launch after the profiler starts: 8.7 ms wide) and its
    # end marker (3 us wide), relative to the end marker's bracket.
    offset, error = combine_brackets([(-6_535_132 - 2_150_139, 82_000), (0, 2_853)])
    assert (offset, error) == (1_426, 1_427)
    # Brackets that do not meet (drift): the midpoints' mean, bounded by both spreads.
    offset, error = combine_brackets([(0, 10), (100, 110)])
    assert offset == 55 and error == 5 + 50


# Each test runs with both cores of the stages (tests/instrument/conftest.py).
pytestmark = pytest.mark.usefixtures("stage_core")
