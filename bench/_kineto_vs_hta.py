"""Real Kineto traces: `stepscope analyze --json` vs stdlib `json.load` vs HTA (``bench_analysis.py
--real``). Every measurement runs in a fresh subprocess; peak memory is the larger of the
process's own high-water mark (VmHWM) and its children's (HTA parses in a forked pool worker).

The large input (~193k events) is built from a public vLLM trace because no public vLLM serving
trace of that size could be obtained here: the events of TraceLens'
``inference/vllm_prefilldecode_piecewise/graph_execution.json.gz`` (vLLM V1, MI300X, one
prefill+decode step of a real run, 19,289 events; committed under tests/data/real) repeated 10
times, each copy shifted in time past the previous one and its correlation/Python ids offset so
they stay unique. The events are real; their repetition is not.
"""

from __future__ import annotations

import compileall
import gzip
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "tracelens/inference/vllm_prefilldecode_piecewise/graph_execution.json.gz"
PUBLIC = (
    "tracelens/inference/sglang_prefilldecode/sglang_Qwen3-8B_prefilldecode.json.gz",
    "tracelens/b200/eager_trace.json.gz",
    "hta/nccl_parser_config/nccl_data.json.gz",
    "tracelens/mi300/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz",
)
_ID_KEYS = ("correlation", "External id", "Python id", "Python parent id", "Ev Idx")

_PEAK = """
import resource
def peak_mb():
    own = 0.0
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            own = int(line.split()[1]) / 1024
    return max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
"""
_JSON = (
    _PEAK
    + """
import gzip, json, sys, time
t0 = time.perf_counter()
with gzip.open(sys.argv[1]) as f:
    doc = json.load(f)
print(json.dumps({"s": time.perf_counter() - t0, "peak_mb": peak_mb()}))
"""
)
_STEPSCOPE = (
    _PEAK
    + """
import json, sys, time
sys.path.insert(0, sys.argv[2])
from analysis import analyze_frames, load_trace
import analysis.report, analysis.loading.load_kineto  # imported lazily: not timed, as before
t0 = time.perf_counter()
frames = load_trace(sys.argv[1])
t1 = time.perf_counter()
report = analyze_frames(frames)
json.dumps(report.to_dict(), default=str)
t2 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "s": t2 - t0, "peak_mb": peak_mb(),
                  "events": frames.metadata["num_events"]}))
"""
)
_HTA = (
    _PEAK
    + """
import json, logging, sys, time
logging.disable(logging.WARNING)
t0 = time.perf_counter()
from hta.trace_analysis import TraceAnalysis
t1 = time.perf_counter()
ta = TraceAnalysis(trace_files={0: sys.argv[1]}, trace_dir="")
t2 = time.perf_counter()
ta.get_temporal_breakdown(visualize=False)
ta.get_gpu_kernel_breakdown(visualize=False)
ta.get_idle_time_breakdown(visualize=False)
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "s": t3 - t1, "peak_mb": peak_mb()}))
"""
)


def build_large(source: Path, out: Path, copies: int = 10) -> int:
    """Write ``copies`` time-shifted copies of ``source``'s events to ``out``; returns the count."""
    doc = json.loads(gzip.decompress(source.read_bytes()))
    events = doc["traceEvents"]
    stamps = [e["ts"] for e in events if isinstance(e.get("ts"), (int, float))]
    span = max(stamps) - min(stamps) + 1000.0
    merged: list[dict[str, Any]] = []
    for k in range(copies):
        for e in events:
            if k and e.get("ph") == "M":
                continue
            e = dict(e)
            if isinstance(e.get("ts"), (int, float)):
                e["ts"] += k * span
            if k and isinstance(e.get("id"), int):
                e["id"] += k * 10_000_000
            if k and isinstance(e.get("args"), dict):
                e["args"] = {
                    key: v + k * 10_000_000
                    if key in _ID_KEYS and isinstance(v, int) and v >= 0
                    else v
                    for key, v in e["args"].items()
                }
            merged.append(e)
    doc["traceEvents"] = merged
    with gzip.open(out, "wt") as f:
        json.dump(doc, f)
    return len(merged)


def _child(python: str, code: str, *args: str) -> dict[str, float]:
    out = subprocess.run(
        [python, "-c", code, *args], check=True, capture_output=True, text=True, cwd=ROOT
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _tree_mb(pid: int) -> float:
    """Memory of ``pid`` and its descendants now, in MB: ``pid``'s resident set (as RSS is
    measured for the other tools) plus each descendant's private pages (Linux ``smaps_rollup``),
    so pages a forked child still shares with its parent count once."""
    total_kb, todo = 0, [(pid, "VmRSS:", "status")]
    while todo:
        p, key, name = todo.pop()
        try:
            for line in Path(f"/proc/{p}/{name}").read_text().splitlines():
                if line.startswith(key) or (key == "Private" and line.startswith("Private_")):
                    total_kb += int(line.split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                for c in (task / "children").read_text().split():
                    todo.append((int(c), "Private", "smaps_rollup"))
        except (FileNotFoundError, ProcessLookupError, ValueError):
            pass  # exited meanwhile
    return total_kb / 1024


def _cli(path: Path) -> dict[str, float]:
    """Wall seconds of ``stepscope analyze --json PATH`` as a user runs it (imports included),
    and, from a second, untimed run, the peak of its process tree's memory (:func:`_tree_mb`;
    the CLI forks helpers) sampled every 5 ms: reading ``smaps_rollup`` walks the target's page
    tables, which slowed the timed run by ~40% when done in it."""
    cmd = [sys.executable, "-m", "stepscope.cli", "analyze", "--json", str(path)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    wall = time.perf_counter() - t0
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, cwd=ROOT)
    peak = 0.0
    while proc.poll() is None:
        peak = max(peak, _tree_mb(proc.pid))
        time.sleep(0.005)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return {"s": wall, "peak_mb": peak}


def measure(path: Path, hta_python: str | None, repeat: int) -> dict[str, Any]:
    """Each tool's run with the median time of ``repeat`` interleaved runs on ``path``."""
    runs: dict[str, list[dict[str, float]]] = {"json": [], "stepscope": [], "cli": [], "hta": []}
    for _ in range(repeat):
        runs["json"].append(_child(sys.executable, _JSON, str(path)))
        runs["stepscope"].append(_child(sys.executable, _STEPSCOPE, str(path), str(ROOT)))
        runs["cli"].append(_cli(path))
        if hta_python:
            runs["hta"].append(_child(hta_python, _HTA, str(path)))
    med = {k: sorted(v, key=lambda r: r["s"])[(len(v) - 1) // 2] for k, v in runs.items() if v}
    ratios = sorted(c["s"] / j["s"] for c, j in zip(runs["cli"], runs["json"], strict=True))
    return {
        "trace": str(path),
        "bytes": path.stat().st_size,
        **med,
        "cli_over_json": ratios[(len(ratios) - 1) // 2],  # median of the per-round ratios
    }


def run(
    real_dir: Path, hta_python: str | None, repeat: int, work: Path, large_only: bool = False
) -> list[dict[str, Any]]:
    """Measure the large vLLM trace and (unless ``large_only``) the public traces; print the
    table with ratios."""
    # Bytecode for stepscope's own modules, as `pip install` writes it (a source checkout run
    # with PYTHONDONTWRITEBYTECODE=1 would otherwise compile every module on every start).
    for package in ("analysis", "instrument", "stepscope"):
        compileall.compile_dir(ROOT / package, quiet=1)
    large = work / "vllm_x10.json.gz"
    n = build_large(real_dir / SOURCE, large)
    rows = [measure(large, hta_python, repeat) | {"label": f"vLLM x10 ({n} events)"}]
    for rel in () if large_only else PUBLIC:
        rows.append(measure(real_dir / rel, hta_python, repeat) | {"label": rel.split("/")[-1]})
    _print(rows)
    return rows


def _print(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'trace':<44}{'events':>8}{'json.load s':>12}{'ss s':>7}{'ss cli s':>9}{'HTA s':>8}"
        f"{'ss/json':>8}{'cli/json':>9}{'HTA/cli':>8}{'ss MB':>7}{'cli MB':>7}{'HTA MB':>7}"
    )
    for r in rows:
        js, ss, cli = r["json"]["s"], r["stepscope"]["s"], r["cli"]["s"]
        hta = r.get("hta")
        print(
            f"{r['label'][:43]:<44}{r['stepscope']['events']:>8}{js:>12.2f}{ss:>7.2f}{cli:>9.2f}"
            f"{hta['s'] if hta else float('nan'):>8.2f}{ss / js:>8.2f}{r['cli_over_json']:>9.2f}"
            f"{hta['s'] / cli if hta else float('nan'):>8.1f}{r['stepscope']['peak_mb']:>7.0f}"
            f"{r['cli']['peak_mb']:>7.0f}{hta['peak_mb'] if hta else float('nan'):>7.0f}"
        )
    print(
        "Each column: the run with the median time of the interleaved rounds; cli/json: the median "
        "of the rounds' ratios. ss s: stepscope load + full report in one process (imports "
        "excluded, as for json.load and HTA s); ss cli s: `stepscope analyze --json` wall time, "
        "interpreter start and imports included; HTA s: TraceAnalysis + temporal, kernel and "
        "idle-time breakdowns (imports excluded); MB: peak RSS (cli MB: the CLI's RSS plus its "
        "forked helpers' private memory, peak of samples every 5 ms)."
    )
