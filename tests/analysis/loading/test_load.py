"""Loaders on real files: the instrument Tracer, torch.profiler, and broken inputs."""

from __future__ import annotations

import gzip
import json
import threading
import time
from pathlib import Path

import pytest

from analysis import TraceError, analyze_trace, get_profile, load_profile_file, load_trace
from analysis.cli import analyze_main, compare_main
from instrument.tracer import Tracer
from tracekit.perfetto import write
from tracekit.recipes import blocked_trace as _blocked

DATA = Path(__file__).resolve().parents[2] / "data"


def _traced_run(path: Path, steps: int = 4, async_on: bool = True) -> Path:
    threading.current_thread().name = "engine-core"
    tracer = Tracer(path)
    tracer.instant("engine_config", scope="process", model="tiny", async_scheduling=async_on)
    tracer.instant(
        "feature_decision",
        scope="process",
        feature="async_scheduling",
        requested=async_on,
        resolved=async_on,
        reason="requested",
    )
    for step in range(steps):
        with tracer.span("step", step=step):
            with tracer.span(
                "schedule",
                step=step,
                num_reqs=1,
                num_tokens=4,
                num_prefill=0,
                num_decode=1,
                num_spec_tokens=0,
            ):
                time.sleep(0.0005)
            with tracer.span("launch", step=step, flow_out=(1 << 32) + step):
                start = time.monotonic_ns()
            with tracer.span("wait_output", step=step, kind="accepted_count"):
                time.sleep(0.001)
            tracer.slice_at(
                "gpu:0 compute",
                "forward",
                start,
                start + 800_000,
                step=step,
                flow_in=(1 << 32) + step,
            )
    tracer.close()
    return path


def test_tracer_round_trip(tmp_path: Path) -> None:
    frames = load_trace(_traced_run(tmp_path / "run.pftrace"))
    names = frames.slices.groupby("name").size().to_dict()
    assert names == {"step": 4, "schedule": 4, "launch": 4, "wait_output": 4, "forward": 4}
    assert set(frames.slices.loc[frames.slices["name"] == "forward", "role"]) == {"compute"}
    assert (frames.slices.loc[frames.slices["name"] == "schedule", "depth"] == 1).all()
    assert len(frames.flows) == 4 and (frames.flows["dst_slice_id"] >= 0).all()
    src = frames.slices.set_index("slice_id").loc[frames.flows["src_slice_id"], "name"]
    assert set(src) == {"launch"}
    assert frames.config == {"model": "tiny", "async_scheduling": True}
    assert frames.metadata["schema_version"] == 1 and frames.metadata["bytes_dropped"] == 0


def test_truncated_file_loads_its_prefix(tmp_path: Path) -> None:
    data = _traced_run(tmp_path / "run.pftrace").read_bytes()
    cut = tmp_path / "cut.pftrace"
    cut.write_bytes(data[: len(data) - 7])
    frames = load_trace(cut)
    assert 0 < frames.metadata["bytes_dropped"] < 200
    report = analyze_trace(cut)
    assert any("cut off" in v for v in report.verdicts)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty"),
        (b"\x00\x01garbage bytes", "not a trace"),
        (b"\x0a\xff\xff\xff\x7f\x01", "truncated"),
        (b"{}", "traceEvents"),
        (b'{"traceEvents": []}', "no events"),
        (
            b'{"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "x"}}]}',
            "metadata only",
        ),
        (b'{"traceEvents": [{"ph": "X", "na', "not valid JSON"),
    ],
)
def test_malformed_inputs_give_clear_errors(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.trace"
    path.write_bytes(content)
    with pytest.raises(TraceError, match=message):
        load_trace(path)


def test_metadata_only_perfetto(tmp_path: Path) -> None:
    spec = _blocked()
    spec.slices.clear()
    with pytest.raises(TraceError, match="metadata only"):
        load_trace(write(spec, tmp_path / "m.pftrace"))


def test_missing_file_and_cli_error_exit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert analyze_main([str(tmp_path / "nope.pftrace")]) == 2
    assert "no such trace file" in capsys.readouterr().err


def test_cli_json_and_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write(_blocked(), tmp_path / "a.pftrace")
    assert analyze_main([str(a), "--json", "--skip-steps", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["wait_accepted_exposed_us"] == 120.0 and out["tables"]["bubbles"]
    assert analyze_main([str(a)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("* async_scheduling is on but hides only")
    b_spec = _blocked()
    b_spec.instants[0] = (None, "engine_config", 0, {"model": "tiny", "async_scheduling": False})
    b = write(b_spec, tmp_path / "b.pftrace")
    assert compare_main([str(a), str(b)]) == 0
    assert "variable under test: async_scheduling" in capsys.readouterr().out
    c_spec = _blocked()
    c_spec.instants[0] = (None, "engine_config", 0, {"model": "big", "async_scheduling": False})
    assert compare_main([str(a), str(write(c_spec, tmp_path / "c.pftrace"))]) == 1
    assert "BROKEN" in capsys.readouterr().out


def _torch_profile(path: Path) -> Path:
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(32, 32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(3):
            with record_function(f"ProfilerStep#{step}"):
                with record_function("core step: schedule"):
                    time.sleep(0.0005)
                with record_function("gpu_model_runner: preprocess"):
                    y = x + 1
                with record_function("gpu_model_runner: forward"):
                    y = x @ y
                with record_function("gpu_model_runner: bookkeep"):
                    y.sum().item()
    prof.export_chrome_trace(str(path))
    return path


def test_kineto_from_torch_profiler(tmp_path: Path) -> None:
    path = _torch_profile(tmp_path / "k.json")
    gz = tmp_path / "k.json.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    frames = load_trace(gz, "vllm")
    sl = frames.slices
    mapped = sl[sl["raw_name"].str.startswith(("core step", "gpu_model_runner"))]
    assert dict(zip(mapped["raw_name"], mapped["name"], strict=False)) == {
        "core step: schedule": "schedule",
        "gpu_model_runner: preprocess": "prepare_inputs",
        "gpu_model_runner: forward": "launch",
        "gpu_model_runner: bookkeep": "update_from_output",
    }
    assert sorted(mapped.groupby("step").size().index) == [0, 1, 2]
    assert (sl.loc[sl["name"] == "step", "step"].tolist()) == [0, 1, 2]
    assert set(frames.syncs["op"]) >= {"aten::item"}
    report = analyze_trace(gz, "vllm")
    assert report.headline["window"]["num_steps"] == 2
    assert report.verdicts[0].startswith("The trace has no device compute slices")


def test_kineto_device_events_and_waits() -> None:
    frames = load_trace(DATA / "kineto_gpu_small.json")
    sl = frames.slices
    assert set(sl.loc[sl["raw_name"] == "volta_sgemm", "track"]) == {"gpu:0 compute"}
    assert set(sl.loc[sl["raw_name"].str.startswith("Memcpy"), "track"]) == {"gpu:0 copy"}
    waits = sl[sl["name"] == "wait_output"]
    assert dict(zip(waits["raw_name"], waits["kind"], strict=False)) == {
        "cudaStreamSynchronize": "sync",
        "cudaMemcpy": "d2h_copy",
    }
    kernel_steps = sl.loc[sl["role"] == "compute", "step"].tolist()
    assert kernel_steps == [0, 1]
    report = analyze_trace(DATA / "kineto_gpu_small.json", skip_steps=0)
    assert report.headline["top_blame"]["label"] == "wait_output(sync)"


def test_user_profile_file(tmp_path: Path) -> None:
    p = tmp_path / "mine.toml"
    p.write_text(
        'name = "mine"\n[[rules]]\npattern = "^my_sched$"\nname = "schedule"\n'
        '[[rules]]\npattern = "wait_acc"\nname = "wait_output"\nkind = "accepted_count"\n'
    )
    prof = load_profile_file(p)
    assert prof.map_name("my_sched") == ("schedule", "", -1)
    assert prof.map_name("x wait_acc y") == ("wait_output", "accepted_count", -1)
    assert get_profile(str(p)).name == "mine"
    bad = tmp_path / "bad.json"
    bad.write_text('{"rules": [{"pattern": "x", "name": "not_a_slice"}]}')
    with pytest.raises(TraceError, match="not a canonical"):
        load_profile_file(bad)
    with pytest.raises(TraceError, match="unknown profile"):
        get_profile("nonesuch")


@pytest.mark.parametrize(
    ("name", "profile", "num_steps"),
    [("stepscope_small.pftrace", None, 5), ("torch_cpu_small.json", "vllm", 2)],
)
def test_stored_real_traces(name: str, profile: str | None, num_steps: int) -> None:
    report = analyze_trace(DATA / name, profile)
    assert report.headline["window"]["num_steps"] == num_steps
    assert set(report.headline) >= {"overlap", "bubbles", "window", "tpot_ms"}
    json.dumps(report.to_dict(), allow_nan=False)
