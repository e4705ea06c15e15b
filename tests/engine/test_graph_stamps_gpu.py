"""Graph stamps on CUDA (docs/design.md §4.3): ``%globaltimer`` written by the captured graph
lands between CUDA events recorded around the replay, over seconds (the calibrated offset does
not drift away), and a traced engine run with stamps gives the same tokens and the same slice
structure as one with events (H200)."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import pytest
import torch

from engine.cli import run_main
from instrument.device_events import CudaClock
from instrument.graph_stamps import GraphStamps
from instrument.schema import Arg, parse_device_track_name
from tests.instrument.conftest import read_trace

pytestmark = pytest.mark.gpu


def test_stamps_lie_between_the_events_around_the_replay() -> None:
    device = torch.device("cuda")
    ops = CudaClock.calibrate(device)
    stream = torch.cuda.Stream()
    stamps = GraphStamps(device)
    stamps.calibrate(ops, stream)
    print("graph stamp offset error ns:", stamps.offset_error_ns)
    assert 0 <= stamps.offset_error_ns < 20_000
    x = torch.randn(2048, 2048, device=device)

    def body(_: object) -> torch.Tensor:
        return x @ x

    with torch.cuda.stream(stream):
        body(None)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        stamps.wrap(body)(None)
    stamps.reset_device_counter()
    rows = []
    for _ in range(40):  # ~2 s: a drifting offset would leave the bracket
        a, b = ops.new(), ops.new()
        with torch.cuda.stream(stream):
            ops.record(a, stream)
            begin, end = stamps.take()
            graph.replay()
            ops.record(b, stream)
        stream.synchronize()
        assert end.done()
        host_a, host_b = ops.host_ns_many([a, b])
        rows.append((host_a, begin.host_ns(), end.host_ns(), host_b))
        time.sleep(0.05)
    tol = stamps.offset_error_ns + 3_000
    for host_a, stamp_begin, stamp_end, host_b in rows:
        assert host_a - tol <= stamp_begin <= stamp_end <= host_b + tol, rows
    inside = [(e - s) / (b - a) for a, s, e, b in rows]
    print("stamped share of the event bracket, median:", statistics.median(inside))
    assert statistics.median(inside) > 0.5  # the matmul, not the launch gaps, between stamps


def _run(tmp_path, model_config: str, stamps: str) -> tuple[dict, dict]:
    trace = tmp_path / f"{stamps}.pftrace"
    argv = [
        "--model-config", model_config, "--random-weights", "--device", "cuda",
        "--workload", "synthetic:n=8,in=16-16,out=48-48,vocab=120,seed=0",
        "--trace", str(trace), "--trace-graph-stamps", stamps, "--no-progress",
    ]  # fmt: skip
    assert run_main(argv) == 0
    read = read_trace(str(trace))
    meta: dict = {}
    for ev in read.events:
        if ev.name == "trace_metadata":
            meta.update(ev.args)
    stages: dict = defaultdict(dict)
    for track, name, start, end, args in read.slices():
        parsed = parse_device_track_name(track)
        if parsed is not None and parsed[1] == "compute":
            stages[args[Arg.STEP.value]][name] = (start, end, args)
    return meta, stages


def test_an_engine_run_with_stamps_matches_one_with_events(tmp_path, tiny_model_config) -> None:
    meta_on, on = _run(tmp_path, tiny_model_config, "on")
    meta_off, off = _run(tmp_path, tiny_model_config, "off")
    assert meta_on[Arg.OUTPUT_DIGEST.value] == meta_off[Arg.OUTPUT_DIGEST.value]
    assert meta_on[Arg.GRAPH_STAMPS.value] == "globaltimer"
    assert Arg.GRAPH_STAMPS.value not in meta_off
    assert "dropped_device_slices" not in meta_on
    replayed = [s for s, st in on.items() if st.get("forward", (0, 0, {}))[2].get("graph_replay")]
    assert len(replayed) >= 30
    for step in replayed:
        prep, fwd, sample = on[step]["input_prep"], on[step]["forward"], on[step]["sample"]
        assert prep[1] == fwd[0] and fwd[1] == sample[0], step
        assert fwd[1] > fwd[0], step
    durations = {}
    for name, stages in (("on", on), ("off", off)):
        durations[name] = statistics.median(
            st["forward"][1] - st["forward"][0]
            for st in stages.values()
            if st.get("forward", (0, 0, {}))[2].get("graph_replay")
        )
    print("forward slice p50 ns, stamps vs events:", durations)
    # the stamps bracket the graph's kernels; the events also the replay's launch latency
    assert 0.3 * durations["off"] <= durations["on"] <= 1.2 * durations["off"], durations
