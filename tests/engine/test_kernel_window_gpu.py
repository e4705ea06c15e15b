"""``--trace-kernels`` on a CUDA device: kernels on ``gpu:0 kernels``, inside their stage slices,
only for the window's steps, with the clock alignment's error bound in the metadata (H200)."""

from __future__ import annotations

from collections import defaultdict

import pytest

from engine.cli import run_main
from instrument.schema import Arg, parse_device_track_name
from tests.instrument.conftest import read_trace

pytestmark = pytest.mark.gpu


def test_kernel_window_end_to_end(tmp_path, tiny_model_config) -> None:
    trace = tmp_path / "k.pftrace"
    argv = [
        "--model-config", tiny_model_config, "--random-weights", "--device", "cuda",
        "--workload", "synthetic:n=8,in=16-16,out=24-24,vocab=120,seed=0",
        "--trace", str(trace), "--trace-kernels", "4:10", "--no-progress",
    ]  # fmt: skip
    assert run_main(argv) == 0
    read = read_trace(str(trace))
    slices = read.slices()
    stages: dict[tuple[int, str], tuple[int, int]] = {}
    kernels: dict[int, list[tuple[str, int, int, dict]]] = defaultdict(list)
    for track, name, start, end, args in slices:
        parsed = parse_device_track_name(track)
        if parsed is None:
            continue
        if parsed[1] == "kernels":
            kernels[args.get(Arg.STEP.value, -1)].append((name, start, end, args))
        else:
            stages[(args[Arg.STEP.value], name)] = (start, end)
    assert sorted(kernels) == list(range(4, 10))  # whole window, nothing outside it
    meta = {}
    for ev in read.events:
        if ev.name == "trace_metadata":
            meta.update(ev.args)
    assert meta["capture_kernel_steps"] == "4:10"
    error = meta["kernel_clock_error_ns"]
    print("kernel window clock:", {k: v for k, v in meta.items() if k.startswith("kernel_clock")})
    assert 0 <= error < 50_000, meta
    tol = error + 2_000
    for step, ks in kernels.items():
        assert {a[Arg.ACTIVITY.value] for *_, a in ks} <= {"kernel", "memcpy", "memset"}
        assert any(a[Arg.STAGE.value] == "forward" for *_, a in ks)
        for name, start, end, args in ks:
            s, e = stages[(step, args[Arg.STAGE.value])]
            mid = (start + end) // 2
            assert s - tol <= mid <= e + tol, (name, step, args)
