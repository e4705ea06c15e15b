"""The diagnosis on minimal traces, one per defect class of issue 14: blame that names the real
culprit (a sync does not hide CPU work, never the profiler's span or a waiting thread), a stepless
window, short traces, an edge outlier step, vLLM/SGLang names, percentages, compare X X."""

from __future__ import annotations

from pathlib import Path

import pytest

from analysis import analyze_trace
from analysis.bubbles import CPU_WAITING, NO_CPU
from analysis.cli import compare_main
from analysis.profiles import get_profile
from analysis.verdicts import pct
from tests.analysis.kinetogen import kernel, launch, profiler_span, thread, write_kineto, x
from tests.analysis.tracegen import TraceSpec, write

US = 1_000  # ns per µs


def _blame(report) -> dict[str, int]:
    table = report.tables["blame"]
    return dict(zip(table["label"], table["idle_ns"], strict=True))


def test_a_short_sync_does_not_hide_the_cpu_work_of_a_long_bubble(tmp_path: Path) -> None:
    """Bubble [100, 900) µs: a 10 µs cudaStreamSynchronize (canonical wait_output) inside a
    780 µs aten::copy_ on the launching thread. The copy names the bubble."""
    events = [
        thread(1, "python"),
        x("user_annotation", "ProfilerStep#0", 0, 1000),
        launch(5, 1),
        kernel("k0", 10, 90, 1),
        x("cpu_op", "aten::copy_", 100, 780),
        x("cuda_runtime", "cudaStreamSynchronize", 100, 10),
        launch(880, 2),
        kernel("k1", 900, 100, 2),
    ]
    report = analyze_trace(write_kineto(events, tmp_path / "k.json"), window="all", skip_steps=0)
    (bubble,) = report.tables["bubbles"].itertuples()
    assert (bubble.start_ns, bubble.end_ns) == (100 * US, 900 * US)
    assert bubble.blame == "aten::copy_"
    assert bubble.blame_share == pytest.approx(770 / 800)
    # The step envelope is never blamed: its last 15 µs count as no CPU slice.
    assert _blame(report) == {
        "aten::copy_": 770 * US,
        "wait_output(sync)": 10 * US,
        "cudaLaunchKernel": 5 * US,
        NO_CPU: 15 * US,
    }
    assert report.headline["top_blame"]["label"] == "aten::copy_"


def test_profiler_span_and_waiting_threads_are_never_blamed(tmp_path: Path) -> None:
    """Three bubbles: the launching thread works (aten::index), nothing runs but the profiler's
    span and a tqdm monitor's wait, the launching thread waits on a queue."""
    events = [
        thread(1, "python"),
        thread(2, "tqdm monitor"),
        profiler_span(0, 4000),
        x("python_function", "tqdm/_monitor.py(60): run", 0, 4000, tid=2),
        x("python_function", "threading.py(359): wait", 50, 3900, tid=2),
        launch(0, 1),
        kernel("k0", 10, 90, 1),
        x("cpu_op", "aten::index", 150, 800),  # bubble 0: [100, 1000)
        launch(990, 2),
        kernel("k1", 1000, 100, 2),  # bubble 1: [1100, 2000), nothing on the launcher
        launch(1990, 3),
        kernel("k2", 2000, 100, 3),  # bubble 2: [2100, 3000), the launcher waits
        x("python_function", "queue.py(171): get", 2100, 880),
        x("python_function", "<built-in method acquire of _thread.lock object>", 2110, 860),
        launch(2990, 4),
        kernel("k3", 3000, 100, 4),
    ]
    report = analyze_trace(write_kineto(events, tmp_path / "k.json"), window="all", skip_steps=0)
    bubbles = report.tables["bubbles"]
    assert bubbles["blame"].tolist() == ["aten::index", NO_CPU, CPU_WAITING]
    assert bubbles["blame_share"].tolist() == pytest.approx([800 / 900, 895 / 900, 880 / 900])
    labels = set(report.tables["blame"]["label"])
    assert not labels & {
        "PyTorch Profiler (0)",
        "threading.py(359): wait",
        "tqdm/_monitor.py(60): run",
    }


def test_stepless_window_partitions_into_a_no_step_row(tmp_path: Path) -> None:
    """Six events: two steps, two kernels that no launch ties to a step (HTA's
    trace_compare/test.json.gz has the same shape); this raised IndexError in phases."""
    events = [
        thread(1, "python"),
        x("user_annotation", "ProfilerStep#0", 0, 1000),
        x("user_annotation", "ProfilerStep#1", 1000, 1000),
        x("cpu_op", "aten::mm", 400, 1000),
        kernel("k0", 100, 200),
        kernel("k1", 1500, 200),
    ]
    report = analyze_trace(write_kineto(events, tmp_path / "k.json"))
    h = report.headline
    assert h["window"]["num_steps"] == 2 and "not skipped" in h["window"]["note"]
    assert h["bubble_ratio"] == pytest.approx(1200 / 1600)
    assert h["top_blame"]["label"] == "aten::mm"
    phases = report.tables["phases"].set_index("phase")
    assert phases.loc["no_step", "span_ns"] == 1600 * US
    assert phases["span_ns"].sum() == 1600 * US
    assert phases["idle_ns"].sum() == 1200 * US


def _two_steps(work_in_step_1: bool) -> TraceSpec:
    t = TraceSpec()
    t.cpu("schedule", 0, 100 * US, step=0, num_reqs=4)
    t.gpu("forward", 100 * US, 500 * US, step=0)
    t.gpu("sample", 700 * US, 1000 * US, step=0)
    t.cpu("schedule", 1000 * US, 1100 * US, step=1, num_reqs=4)
    if work_in_step_1:
        t.gpu("forward", 1100 * US, 1200 * US, step=1)
    return t


def test_two_step_trace_keeps_the_step_holding_the_work(tmp_path: Path) -> None:
    report = analyze_trace(write(_two_steps(False), tmp_path / "t.pftrace"))
    w = report.headline["window"]
    assert (w["first_step"], w["last_step"], w["skipped_steps"]) == (0, 1, 0)
    assert "not skipped" in w["note"]
    assert report.headline["bubble_ratio"] == pytest.approx(200 / 900)
    assert not any("no device compute" in v for v in report.verdicts)


def test_warmup_holding_the_only_work_is_kept_and_an_empty_window_says_how_to_widen(
    tmp_path: Path,
) -> None:
    spec = _two_steps(False)
    spec.cpu("schedule", 2000 * US, 2100 * US, step=2, num_reqs=4)
    path = write(spec, tmp_path / "t.pftrace")
    report = analyze_trace(path)
    assert report.headline["window"]["first_step"] == 0
    assert "hold the only device compute" in report.headline["window"]["note"]
    narrow = analyze_trace(path, window="1:3")
    assert narrow.verdicts[0] == (
        "The measured window (steps 1..2) holds none of the trace's 2 device compute slices: "
        "overlap and bubbles cannot be measured; widen it with --window all --skip-steps 0 "
        "(or --window A:B)."
    )


def test_steady_window_leaves_a_slow_first_step_out(tmp_path: Path) -> None:
    """Step 0 takes 5 ms, steps 1..11 take 1 ms: the centred median alone would smooth step 0
    into the window."""
    t = TraceSpec()
    start = 0
    for step in range(12):
        length = (5000 if step == 0 else 1000) * US
        t.cpu("schedule", start, start + 100 * US, step=step, num_reqs=8)
        t.gpu("forward", start + 100 * US, start + length, step=step)
        start += length
    report = analyze_trace(write(t, tmp_path / "t.pftrace"))
    w = report.headline["window"]
    assert (w["rule"], w["first_step"], w["last_step"]) == ("steady", 1, 11)


VLLM_NAMES = {
    "core step: schedule": "schedule",
    "gpu_model_runner: preprocess": "prepare_inputs",
    "gpu_model_runner: sample": "launch",
    "gpu_model_runner: postprocess": "update_from_output",
    "/usr/lib/python3/site-packages/vllm/v1/core/sched/scheduler.py(301): schedule": "schedule",
    "vllm/v1/core/sched/async_scheduler.py(40): schedule": "schedule",
    "vllm/v1/worker/gpu_model_runner.py(1518): _prepare_inputs": "prepare_inputs",
    "vllm/v1/worker/gpu_model_runner.py(931): _update_states": "prepare_inputs",
    "vllm/v1/worker/gpu_model_runner.py(3102): _model_forward": "launch",
    "vllm/v1/sample/sampler.py(64): forward": "launch",
    "vllm/v1/worker/gpu_model_runner.py(2333): _bookkeeping_sync": "update_from_output",
    "vllm/v1/core/sched/scheduler.py(880): update_from_output": "update_from_output",
    "vllm/v1/worker/gpu_model_runner.py(4012): _get_valid_sampled_token_count": "wait_output",
    "vllm/v1/structured_output/__init__.py(210): grammar_bitmask": "grammar_mask",
    # Not vLLM's step work: kept as they are.
    "vllm/v1/worker/gpu_model_runner.py(3380): execute_model": None,
    "vllm/v1/core/sched/scheduler.py(1020): get_grammar_bitmask": None,
    "vllm/v1/worker/gpu_input_batch.py(64): num_tokens": None,
}
SGLANG_NAMES = {
    "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py(1800): get_next_batch_to_run": "schedule",
    "sglang/srt/managers/schedule_batch.py(1500): prepare_for_decode": "prepare_inputs",
    "sglang/srt/model_executor/forward_batch_info.py(443): init_new": "prepare_inputs",
    "sglang/srt/managers/scheduler.py(2900): run_batch": "launch",
    "sglang/srt/managers/tp_worker.py(445): forward_batch_generation": "launch",
    "sglang/srt/managers/scheduler_output_processor_mixin.py(300): process_batch_result_decode": "update_from_output",
    "sglang/srt/constrained/xgrammar_backend.py(120): fill_vocab_mask": "grammar_mask",
    # Every step, grammar or not / time-stat setters: kept as they are.
    "sglang/srt/sampling/sampling_batch_info.py(208): update_regex_vocab_mask": None,
    "sglang/srt/managers/scheduler.py(2919): _run_batch_inner": None,
    "sglang/srt/metrics/req_time_stats.py(647): set_run_batch_cpu_start_time": None,
}


@pytest.mark.parametrize(
    ("profile", "raw", "want"),
    [("vllm", r, w) for r, w in VLLM_NAMES.items()]
    + [("sglang", r, w) for r, w in SGLANG_NAMES.items()],
)
def test_profile_names(profile: str, raw: str, want: str | None) -> None:
    name, _, _ = get_profile(profile).map_name(raw)
    assert name == (want or raw)


def _vllm_default(path: Path, envelope: str) -> Path:
    """Three vLLM steps with default (Python-stack) names; ``envelope``: ``profiler`` (with
    ``ProfilerStep#``), ``engine`` (the engine core's ``step`` around each iteration) or
    ``runner`` (only the worker's ``execute_model``)."""
    runner = "vllm/v1/worker/gpu_model_runner.py"
    events = [thread(1, "python")]
    for i in range(3):
        base = i * 1000
        if envelope == "profiler":
            events.append(x("user_annotation", f"ProfilerStep#{i + 7}", base, 1000))
        if envelope in ("profiler", "engine"):
            events.append(x("python_function", "vllm/v1/engine/core.py(390): step", base, 990))
        events += [
            x("python_function", "vllm/v1/core/sched/scheduler.py(301): schedule", base, 100),
            x("python_function", f"{runner}(3380): execute_model", base + 100, 800),
            x("python_function", f"{runner}(1518): _prepare_inputs", base + 110, 100),
            x("python_function", f"{runner}(3102): _model_forward", base + 300, 100),
            launch(base + 310, i),
            kernel("gemm", base + 320, 500, i),
        ]
    return write_kineto(events, path)


@pytest.mark.parametrize(
    ("envelope", "raw_prefix", "schedule_in_step"),
    [
        ("profiler", "ProfilerStep#", True),
        ("engine", "vllm/v1/engine/core.py", True),
        ("runner", "vllm/v1/worker/gpu_model_runner.py", False),
    ],
)
def test_vllm_step_envelopes_without_profiler_steps(
    tmp_path: Path, envelope: str, raw_prefix: str, schedule_in_step: bool
) -> None:
    path = _vllm_default(tmp_path / "v.json", envelope)
    report = analyze_trace(path, window="all", skip_steps=0)
    steps = report.tables["steps"]
    assert len(steps) == 3
    if envelope == "profiler":
        assert steps["step"].tolist() == [7, 8, 9]
    assert steps["schedule_ns"].tolist() == [100 * US if schedule_in_step else 0] * 3
    assert steps["prepare_inputs_ns"].tolist() == [100 * US] * 3
    sl = report.frames.slices
    envelopes = sl.loc[sl["name"] == "step", "raw_name"].astype(str)
    assert len(envelopes) == 3 and envelopes.str.startswith(raw_prefix).all()
    assert set(sl["name"]) >= {"schedule", "prepare_inputs", "launch"}


def test_grammarless_sglang_trace_gets_no_grammar_verdict(tmp_path: Path) -> None:
    srt = "sglang/srt/"
    events = [thread(1, "scheduler")]
    for i in range(3):
        base = i * 1000
        events += [
            x("python_function", f"{srt}managers/scheduler.py(1800): get_next_batch_to_run", base, 100),
            x("python_function", f"{srt}managers/scheduler.py(2900): run_batch", base + 100, 300),
            x("python_function", f"{srt}sampling/sampling_batch_info.py(208): update_regex_vocab_mask", base + 110, 20),
            x("python_function", f"{srt}metrics/req_time_stats.py(647): set_run_batch_cpu_start_time", base + 140, 5),
            launch(base + 200, i),
            kernel("gemm", base + 210, 600, i),
        ]  # fmt: skip
    report = analyze_trace(write_kineto(events, tmp_path / "s.json"), "sglang", window="all")
    sl = report.frames.slices
    assert (sl["name"] == "launch").sum() == 3
    assert report.headline["grammar_mask_ms"] == 0.0
    assert not any(v.startswith("Grammar work") for v in report.verdicts)


@pytest.mark.parametrize(
    ("x_", "text"),
    [(0.0, "0%"), (1.0, "100%"), (0.37, "37%"), (0.0024, "0.24%"), (0.99962, "99.96%"), (1e-5, "0.001%")],
)  # fmt: skip
def test_percentages_show_small_values(x_: float, text: str) -> None:
    assert pct(x_) == text


def test_compare_of_identical_kineto_traces_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _vllm_default(tmp_path / "v.json", "profiler")
    assert compare_main([str(path), str(path)]) == 0
    out = capsys.readouterr().out
    assert "BROKEN" not in out and "cannot be checked" in out
