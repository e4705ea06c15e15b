"""The diagnosis on the 22 public Kineto traces in tests/data/real (HTA, TraceLens; sources in
its README): the headline idle against an interval union written here from the raw JSON (exact
decimal µs), the step count, the top-blame label, the phases partition, and no traceback.

Expected labels were chosen by reading each trace (which thread runs what during the largest
gaps between kernels), not by copying the output:

* HTA amd_trace (MI250 training): the 6.6 ms gap (78% of idle) is the autograd thread launching
  ``AccumulateGrad > aten::add_ > hipLaunchKernel`` while the main thread only sits in its step.
* HTA cuda_event_sync: ``if x.sum() > 0``-style host syncs; the host runs ``aten::is_nonzero``
  (item → D2H copy) through most of the idle, the copy itself is a shorter ``wait_output``.
* HTA trace_compare base/test: the gaps hold only the ``ProfilerStep`` envelope: nothing ran.
* HTA sampled_rank-0/1, nccl_data (training): most idle falls inside the main thread's
  ``## backward ##`` range while the autograd thread is between ops.
* TraceLens b200 eager vLLM: the GPU waits while vLLM's ``_model_forward`` launches eagerly
  (``launch``); vLLM decode/piecewise graph replays: the host stopped before the device work
  (nothing ran); mi210 gpu_only: only the profiler's own span (nothing ran).
* TraceLens h100 Qwen (HF generate): ``cudaDeviceSynchronize`` (wait_output(sync)) holds the
  largest share; the tqdm monitor thread waits throughout and must never be named.
* TraceLens mi300 Qwen: the same model on ROCm, whose syncs are HIP calls: ``aten::addmm``.
* TraceLens sglang decode: a 0.46 s blocking device-to-host ``hipMemcpyWithStream`` (CUDA-graph
  ``replay_prepare``) inside ``forward_batch_generation``: ``wait_output(d2h_copy)``, as the
  loader maps blocking HIP copies; prefill-decode: a 0.49 s blocking host-to-device one inside
  ``ForwardBatch.init_new`` (``prepare_inputs``).
* TraceLens torch_compile_triton: ``hipDeviceSynchronize`` (``wait_output(sync)``: HIP
  syncs are waits).
* HTA mtia_inference: the largest gaps between MTIA kernels (9.1, 5.6, 2.6 ms) fall while the
  predictor's merge stage runs (``Stage::runMerge`` on the launching thread); its deepest op
  is the host-side concat ``FastCat-inl::fastCatOutDim0``.
"""

from __future__ import annotations

import gzip
import json
from decimal import Decimal
from pathlib import Path

import pytest

from analysis import analyze_trace
from analysis.bubbles import NO_CPU, is_profiler_span, is_wait_frame

REAL = Path(__file__).resolve().parents[1] / "data" / "real"
HIP_D2H = "wait_output(d2h_copy)"  # hipMemcpyWithStream, once the loader maps HIP copies
HIP_SYNC = "wait_output(sync)"

# path: (profile, num_steps, top-blame labels accepted; None = no device idle to blame)
CASES: dict[str, tuple[str | None, int, set[str | None]]] = {
    "hta/amd_trace/mi250_minitoy_train_ROCm6_2_kineto.json.gz": (None, 2, {"hipLaunchKernel"}),
    "hta/cpu_only/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz": (None, 1, {None}),
    "hta/critical_path/cuda_event_sync/event_sync_trace.json.gz": (None, 1, {"aten::is_nonzero"}),
    "hta/cupti_profiler/benchmark_result_924719_1679055439_trace.json.gz": (None, 0, {None}),
    "hta/distributed_info_unavailable/distributed_info_not_found.json.gz": (None, 1, {None}),
    "hta/mtia_inference_trace/mtia_inference_rank_0.json.gz": (
        None,
        0,
        {"FastCat-inl::fastCatOutDim0"},
    ),
    "hta/nccl_parser_config/nccl_data.json.gz": (None, 2, {"## backward ##"}),
    "hta/rank_non_gpu/rank_non_gpu.json.gz": (None, 1, {None}),
    "hta/trace_compare/base/base.json.gz": (None, 2, {NO_CPU}),
    "hta/trace_compare/test/test.json.gz": (None, 2, {NO_CPU}),
    "hta/trace_filter/sampled_rank-0.json.gz": (None, 2, {"## backward ##"}),
    "hta/trace_filter/sampled_rank-1.json.gz": (None, 2, {"## backward ##"}),
    "hta/triton_example/triton_example.json.gz": (None, 1, {None}),
    "tracelens/b200/eager_trace.json.gz": ("vllm", 1, {"launch"}),
    "tracelens/h100/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz": (None, 1, {"wait_output(sync)"}),
    "tracelens/mi300/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz": (None, 1, {"aten::addmm"}),
    "tracelens/inference/sglang_decode/sglang_Qwen3-8B_decode.json.gz": (
        "sglang",
        0,
        {HIP_D2H},
    ),
    "tracelens/inference/sglang_prefilldecode/sglang_Qwen3-8B_prefilldecode.json.gz": (
        "sglang",
        0,
        {"prepare_inputs"},
    ),
    "tracelens/inference/vllm_decode_full/graph_execution.json.gz": ("vllm", 1, {NO_CPU}),
    "tracelens/inference/vllm_prefilldecode_piecewise/graph_execution.json.gz": (
        "vllm",
        1,
        {NO_CPU},
    ),
    "tracelens/mi210/gpu_only_trace/gpu_only_trace.json.gz": (None, 0, {NO_CPU}),
    "tracelens/torch_compile_triton/trace.json.gz": (None, 0, {HIP_SYNC}),
}
COMPUTE_CATS = {"kernel", "gpu_memset", "mtia_ccp_events"}
MARKERS = {"event_record", "event_wait"}  # MTIA stream markers, not work
COPY_CATS = {"gpu_memcpy"}


def _device_intervals(path: Path, cats: set[str]) -> list[tuple[int, int]]:
    """Device events of ``cats`` as exact integer ns (decimal µs, rounded half-even). MTIA
    ``dma_*`` events are copies (in ``COPY_CATS``' set only), its stream markers no work."""
    doc = json.loads(gzip.decompress(path.read_bytes()), parse_float=Decimal)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    copies = cats == COPY_CATS
    out = []
    for e in events:
        cat, name = str(e.get("cat", "")).lower(), str(e.get("name", ""))
        if cat == "mtia_ccp_events" and name not in MARKERS:
            wanted = name.startswith("dma") == copies
        else:
            wanted = cat in cats and name not in MARKERS
        if e.get("ph") == "X" and wanted and "ts" in e:
            start = round(Decimal(e["ts"]) * 1000)
            out.append((start, start + round(max(Decimal(e.get("dur", 0)), Decimal(0)) * 1000)))
    return out


def _idle_ns(intervals: list[tuple[int, int]], lo: int, hi: int) -> int:
    """|[lo, hi) minus the union of ``intervals``|, by a plain sort-and-sweep."""
    busy, reach = 0, lo
    for s, e in sorted(intervals):
        s, e = max(s, reach), min(e, hi)
        if e > s:
            busy += e - s
            reach = e
    return (hi - lo) - busy


def test_every_stored_trace_is_in_the_table() -> None:
    stored = {str(p.relative_to(REAL)) for p in REAL.rglob("*.json.gz")}
    assert stored == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_real_trace_diagnosis(name: str) -> None:
    profile, num_steps, labels = CASES[name]
    path = REAL / name
    report = analyze_trace(path, profile)
    h = report.headline
    w = h["window"]
    assert w["num_steps"] == num_steps
    top = h["top_blame"]["label"] if h["top_blame"] else None
    assert top in labels, top
    # Never a profiler span or a waiting frame, on any bubble.
    blamed = report.tables["blame"]["label"]
    assert not (is_profiler_span(blamed) | is_wait_frame(blamed)).any()
    assert h["bubbles"]["count"] == len(report.tables["bubbles"])
    compute = _device_intervals(path, COMPUTE_CATS)
    if h["bubble_ratio"] is None:
        assert w["duration_ms"] == 0
        if compute:  # device work outside the window: the verdict says how to widen it
            assert "widen it" in report.verdicts[0]
        return
    lo, hi = w["start_ns"], w["end_ns"]
    # The window runs from a kernel's start to a kernel's end (1 µs: float µs in the loader).
    assert min(abs(s - lo) for s, _ in compute) <= 1000
    assert min(abs(e - hi) for _, e in compute) <= 1000
    ratio = _idle_ns(compute, lo, hi) / (hi - lo)
    assert h["bubble_ratio"] == pytest.approx(ratio, abs=2e-4)
    device = _idle_ns(compute + _device_intervals(path, COPY_CATS), lo, hi) / (hi - lo)
    assert h["device_idle_ratio"] == pytest.approx(device, abs=2e-4)
    assert h["device_idle_ratio"] <= h["bubble_ratio"] + 1e-12
    # The phases partition the window; their idle is the headline idle.
    phases = report.tables["phases"]
    assert phases["span_ns"].sum() == hi - lo
    assert phases["idle_ns"].sum() == report.tables["bubbles"]["dur_ns"].sum()
    assert any(v.startswith("Compute idle (no compute kernel running)") for v in report.verdicts)
