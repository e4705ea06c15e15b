"""How fast is `stepscope analyze` on big traces? (issue 7 targets: 1M slices <= 10 s, 70k Kineto
events <= 1.5 s; issue 9: a 100k-step trace loads in `stepscope analyze` in <= 10 s).

Generates a stepscope Perfetto trace of ``--steps`` engine steps written by the real Tracer (10
slices per step as the engine emits them: 5 CPU, 3 compute, 2 copy, plus 6 counters; interned
encoding; see ``bench/_trace_steps.py``), optionally the same steps in the plain (non-interned)
encoding of ``tracekit/perfetto.py`` (``--plain``), and a Kineto JSON trace of ~70k events.
Each is loaded and analysed (default steady window) in a fresh subprocess, which reports wall
time, CPU time and peak RSS. Prints a table and writes JSON (``--out``).

    python bench/bench_analysis.py [--steps 100000] [--kineto-steps 1400] [--plain]

``--real`` instead measures public real Kineto traces (tests/data/real) and a ~193k-event vLLM
trace built from one of them: `stepscope analyze --json` against stdlib ``json.load`` of the same
file and against HTA (HolisticTraceAnalysis) run by ``--hta-python`` (a separate venv with
pandas 2.x; see bench/README.md). See ``bench/_kineto_vs_hta.py``.

    python bench/bench_analysis.py --real --hta-python /path/to/hta-venv/bin/python [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._trace_steps import StepPattern, emit_steps  # noqa: E402
from instrument.tracer import Tracer  # noqa: E402
from tracekit.perfetto import TraceSpec, encode  # noqa: E402

_CHUNK = 5000


def _step_slices(t: TraceSpec, step: int) -> None:
    base = step * 1_000_000  # 1 ms per step; device runs ahead by half a step
    t.cpu("step", base, base + 1_000_000, step=step)
    t.cpu(
        "schedule",
        base + 10_000,
        base + 200_000,
        step=step,
        num_reqs=8,
        num_tokens=64,
        num_prefill=1,
        num_decode=7,
        num_spec_tokens=0,
    )
    t.cpu("prepare_inputs", base + 200_000, base + 300_000, step=step)
    t.cpu("launch", base + 300_000, base + 350_000, step=step)
    t.cpu("wait_output", base + 350_000, base + 800_000, step=step, kind="accepted_count")
    t.cpu(
        "update_from_output",
        base + 800_000,
        base + 950_000,
        step=step,
        num_accepted=7,
        num_rejected=0,
        num_finished=0,
    )
    t.gpu("input_prep", base + 360_000, base + 400_000, step=step)
    t.gpu("forward", base + 400_000, base + 1_200_000, step=step)
    t.gpu("sample", base + 1_200_000, base + 1_300_000, step=step)
    t.slices.append(
        ("gpu:0 copy", "d2h_output", base + 1_300_000, base + 1_320_000, {"step": step})
    )


def make_tracer_trace(path: Path, steps: int) -> int:
    """``steps`` engine steps through the real Tracer (batch 256, no request tracks)."""
    tracer = Tracer(path, flush_interval_s=0.5)
    for first in range(0, steps, _CHUNK):
        emit_steps(tracer, first, min(_CHUNK, steps - first), StepPattern(batch=256))
    tracer.close()
    return steps * 10


def make_stepscope(path: Path, steps: int) -> int:
    """Plain encoding, written in chunks (concatenated Trace messages are one Trace)."""
    with path.open("wb") as f:
        for first in range(0, steps, _CHUNK):
            t = TraceSpec()
            for step in range(first, min(first + _CHUNK, steps)):
                _step_slices(t, step)
            data = encode(t)
            if first:  # drop the repeated descriptors: keep only event packets
                trace = pb.Trace.FromString(data)
                kept = pb.Trace()
                kept.packet.extend(p for p in trace.packet if not p.HasField("track_descriptor"))
                data = kept.SerializeToString()
            f.write(data)
    return steps * 10


def make_kineto(path: Path, steps: int) -> int:
    events: list[dict[str, object]] = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "python"}}
    ]
    corr = 0
    for step in range(steps):
        t0 = step * 1000.0
        cpu = {"ph": "X", "pid": 1, "tid": 1}
        events.append(
            {
                **cpu,
                "cat": "user_annotation",
                "name": f"ProfilerStep#{step}",
                "ts": t0,
                "dur": 990.0,
            }
        )
        events.append(
            {
                **cpu,
                "cat": "user_annotation",
                "name": "core step: schedule",
                "ts": t0 + 1,
                "dur": 100.0,
            }
        )
        events.append(
            {
                **cpu,
                "cat": "user_annotation",
                "name": "gpu_model_runner: preprocess",
                "ts": t0 + 110,
                "dur": 50.0,
            }
        )
        events.append(
            {
                **cpu,
                "cat": "user_annotation",
                "name": "gpu_model_runner: forward",
                "ts": t0 + 170,
                "dur": 500.0,
            }
        )
        for k in range(15):
            corr += 1
            ts = t0 + 171 + k * 30
            events.append({**cpu, "cat": "cpu_op", "name": "aten::mm", "ts": ts, "dur": 25.0})
            events.append(
                {
                    **cpu,
                    "cat": "cuda_runtime",
                    "name": "cudaLaunchKernel",
                    "ts": ts + 1,
                    "dur": 5.0,
                    "args": {"correlation": corr},
                }
            )
            events.append(
                {
                    "ph": "X",
                    "pid": 0,
                    "tid": 7,
                    "cat": "kernel",
                    "name": "sm90_gemm",
                    "ts": ts + 20,
                    "dur": 28.0,
                    "args": {"device": 0, "stream": 7, "correlation": corr},
                }
            )
        events.append(
            {
                **cpu,
                "cat": "cuda_runtime",
                "name": "cudaStreamSynchronize",
                "ts": t0 + 700,
                "dur": 150.0,
                "args": {"correlation": -1},
            }
        )
        events.append(
            {
                **cpu,
                "cat": "user_annotation",
                "name": "gpu_model_runner: bookkeep",
                "ts": t0 + 860,
                "dur": 100.0,
            }
        )
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    return len(events)


_CHILD = """
import json, sys, time
def peak_mb():  # VmHWM: this address space's peak (ru_maxrss is inherited from the forking parent)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")
sys.path.insert(0, {root!r})
from analysis import analyze_frames, load_trace
c0 = time.process_time(); t0 = time.perf_counter(); frames = load_trace({path!r}, {profile!r})
t1 = time.perf_counter(); c1 = time.process_time()
report = analyze_frames(frames, {profile!r}); t2 = time.perf_counter()
print(json.dumps({{"load_s": t1 - t0, "analyze_s": t2 - t1, "total_s": t2 - t0, "cpu_s": time.process_time() - c0,
    "load_cpu_s": c1 - c0, "analyze_cpu_s": time.process_time() - c1,
    "peak_rss_mb": peak_mb(),
    "slices": len(frames.slices), "overlap": report.headline["overlap"],
    "bubble_ratio": report.headline["bubble_ratio"]}}))
"""


def measure(path: Path, profile: str) -> dict[str, float]:
    code = _CHILD.format(root=str(ROOT), path=str(path), profile=profile)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_cli(path: Path) -> dict[str, float]:
    """Wall and CPU time of ``stepscope analyze PATH`` as a user runs it (imports included)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "stepscope.cli", "analyze", str(path)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"cli_wall_s": wall, "cli_cpu_s": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=100_000, help="engine steps (10 slices each)")
    parser.add_argument(
        "--plain", action="store_true", help="also time the plain (non-interned) encoding"
    )
    parser.add_argument(
        "--kineto-steps", type=int, default=1_400, help="Kineto steps (51 events each)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "bench_analysis.json")
    parser.add_argument(
        "--real", action="store_true", help="public real Kineto traces vs json.load and HTA"
    )
    parser.add_argument("--hta-python", default=None, help="with --real: the HTA venv's python")
    parser.add_argument(
        "--repeat", type=int, default=1, help="with --real: N interleaved rounds (median)"
    )
    parser.add_argument(
        "--large-only", action="store_true", help="with --real: only the 193k-event vLLM trace"
    )
    parser.add_argument("--real-dir", type=Path, default=ROOT / "tests" / "data" / "real")
    args = parser.parse_args()
    if args.real:
        from bench._kineto_vs_hta import run

        with tempfile.TemporaryDirectory() as tmp:
            rows = run(args.real_dir, args.hta_python, args.repeat, Path(tmp), args.large_only)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_name("bench_analysis_real.json").write_text(json.dumps(rows, indent=2))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        pf, pp, kj = Path(tmp) / "big.pftrace", Path(tmp) / "plain.pftrace", Path(tmp) / "big.json"
        traces = [("stepscope (Tracer)", pf, make_tracer_trace(pf, args.steps), "stepscope", 10.0)]
        if args.plain:
            traces.append(
                ("stepscope (plain)", pp, make_stepscope(pp, args.steps), "stepscope", 10.0)
            )
        traces.append(("kineto json", kj, make_kineto(kj, args.kineto_steps), "vllm", 1.5))
        for label, path, n, profile, target in traces:
            r = measure(path, profile)
            if label == "stepscope (Tracer)":
                r |= measure_cli(path)
            rows.append(
                {"trace": label, "events": n, "bytes": path.stat().st_size, "target_s": target, **r}
            )
    print(
        f"{'trace':<20}{'events':>10}{'MB':>8}{'load s':>9}{'analyze s':>11}{'total s':>9}{'cpu s':>8}{'target':>8}{'peak MB':>9}"
    )
    for r in rows:
        print(
            f"{r['trace']:<20}{r['events']:>10}{r['bytes'] / 1e6:>8.1f}{r['load_s']:>9.2f}{r['analyze_s']:>11.2f}"
            f"{r['total_s']:>9.2f}{r['cpu_s']:>8.2f}{r['target_s']:>8.1f}{r['peak_rss_mb']:>9.0f}"
        )
    for r in rows:
        if "cli_wall_s" in r:
            print(
                f"`stepscope analyze` on the {r['events'] // 10}-step trace: "
                f"{r['cli_wall_s']:.2f} s wall, {r['cli_cpu_s']:.2f} s CPU (target <= 10 s)"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
