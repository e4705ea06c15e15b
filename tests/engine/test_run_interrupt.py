"""``stepscope run`` interrupted by signals, as a user's shell does it (real subprocesses).

Each test starts ``python -m stepscope.cli run`` on the sample model, waits until the first
requests have finished (their lines are in ``--output``), sends signals, and checks the exit code,
the outputs (finished ones whole, the ones in flight partial as ``"abort"``) and that the trace
loads. About 10-30 s each on a 2-core CPU (most of it importing torch and loading the model).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from analysis import analyze_frames, load_trace

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "samples/models/pycoder-14m"

# Two short requests finish early; two long ones are in flight when the signal comes; one arrives
# long after the signal and never runs.
_WORKLOAD = [
    {"id": "short0", "prompt_token_ids": [5, 6, 7], "max_tokens": 2},
    {"id": "short1", "prompt_token_ids": [8, 9], "max_tokens": 3},
    {"id": "long0", "prompt_token_ids": [10, 11, 12], "max_tokens": 2000},
    {"id": "long1", "prompt_token_ids": [13, 14], "max_tokens": 2000},
    {"id": "late", "prompt_token_ids": [15, 16], "max_tokens": 4, "arrival_time_s": 600},
]


def _start(tmp_path: Path, ignore_sigint: bool = False) -> tuple[subprocess.Popen[str], Path]:
    workload = tmp_path / "w.jsonl"
    rows = [{**r, "ignore_eos": True, "temperature": 0} for r in _WORKLOAD]
    workload.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    cmd = [
        sys.executable, "-m", "stepscope.cli", "run", "--model", str(MODEL),
        "--workload", str(workload), "--output", str(out), "--trace", str(tmp_path / "t.pftrace"),
        "--trace-requests", "--async", "on", "--no-progress", "--num-kv-blocks", "512",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def preexec() -> None:
        # SIG_IGN: what `nohup` / `cmd &` do to SIGINT. SIG_DFL: an interactive shell's Ctrl-C,
        # also when pytest itself was started in the background (it would inherit SIG_IGN).
        signal.signal(signal.SIGINT, signal.SIG_IGN if ignore_sigint else signal.SIG_DFL)

    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=preexec,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_text().count("\n") >= 2):  # both short ones done
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"run ended or stalled before its first outputs: {proc.stderr}")
        time.sleep(0.05)
    return proc, out


def _outputs(path: Path) -> dict[str, dict]:
    return {o["id"]: o for o in map(json.loads, path.read_text().splitlines())}


def _check_partial(outs: dict[str, dict]) -> None:
    assert set(outs) == {"short0", "short1", "long0", "long1"}  # "late" never arrived
    assert (
        len(outs["short0"]["output_token_ids"]) == 2 and outs["short0"]["finish_reason"] == "length"
    )
    for rid in ("long0", "long1"):
        assert outs[rid]["finish_reason"] == "abort"
        assert 0 < len(outs[rid]["output_token_ids"]) < 2000


def test_first_sigint_stops_in_order(tmp_path):
    """SIGTERM (143) is covered by test_ignored_sigint_is_respected."""
    signum, code = signal.SIGINT, 130
    proc, out = _start(tmp_path)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr and "terminate called" not in stderr
    assert f"interrupted       by {signal.Signals(signum).name}" in stdout
    _check_partial(_outputs(out))
    frames = load_trace(tmp_path / "t.pftrace")
    assert frames.metadata.get("interrupted") == signal.Signals(signum).name
    assert frames.metadata.get("bytes_dropped", 0) == 0  # closed properly
    verdicts = analyze_frames(frames).verdicts
    assert any(v.startswith("The run was interrupted by SIGINT") for v in verdicts)


def test_second_sigint_exits_at_once(tmp_path):
    proc, out = _start(tmp_path)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    start = time.monotonic()
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    assert time.monotonic() - start < 10
    assert "Traceback" not in stderr and "terminate called" not in stderr
    outs = _outputs(out)  # the finished requests were written as they finished
    assert {"short0", "short1"} <= set(outs)
    frames = load_trace(tmp_path / "t.pftrace")
    assert (frames.slices["name"] == "schedule").sum() > 0


def test_ignored_sigint_is_respected(tmp_path):
    """SIGINT ignored by the parent: the run and its trace go on; SIGTERM still stops it."""
    proc, out = _start(tmp_path, ignore_sigint=True)
    sigint_ns = time.monotonic_ns()  # the trace's clock (CLOCK_MONOTONIC, system-wide)
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)
    assert proc.poll() is None  # still running
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    _check_partial(_outputs(out))
    frames = load_trace(tmp_path / "t.pftrace")
    assert frames.metadata.get("interrupted") == "SIGTERM"
    # The trace kept recording after the ignored SIGINT: steps all the way to the end.
    steps = frames.slices.loc[frames.slices["name"] == "schedule"]
    assert steps["ts_ns"].max() > sigint_ns + 500_000_000
    assert frames.metadata.get("bytes_dropped", 0) == 0
    assert "interrupted       by SIGTERM" in stdout
