"""The child-process writer writes what the in-process writer writes, and survives its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from instrument.capture import CaptureConfig
from instrument.tracer import Tracer
from tests.instrument.conftest import read_trace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _emit(tracer: Tracer, num_steps: int) -> None:
    """Engine-like events with fixed times: spans' clocks differ between runs, these do not."""
    threading.current_thread().name = "engine-core"
    tracer.instant("engine_config", scope="process", model="tiny", sizes="1,2")
    for step in range(num_steps):
        base = 1_000_000 + step * 1_000_000
        tracer.thread_slice("schedule", base, base + 100_000, step=step, num_reqs=np.int64(4))
        tracer.thread_slice("wait_output", base + 100_000, base + 900_000, step=step, kind="x")
        tracer.slice_at("gpu:0 compute", "forward", base + 200_000, base + 950_000, step=step,
                        host_end_ns=base + 150_000, flow_in=(1 << 32) + step)  # fmt: skip
        tracer.slice_at("request r1", "decode", base, base + 10, request_id="r1", ratio=0.25)
        tracer.count_dropped("device_slices", step % 2)


@pytest.mark.parametrize(
    "capture",
    [CaptureConfig(), CaptureConfig(every=3, run_length=4, warmup_steps=2),
     CaptureConfig(max_bytes=64 * 1024)],
    ids=["all", "sampled", "budget"],
)  # fmt: skip
def test_process_writer_writes_what_the_thread_writer_writes(
    tmp_path: Path, capture: CaptureConfig
) -> None:
    traces = {}
    for writer in ("thread", "process"):
        path = tmp_path / f"{writer}.pftrace"
        with Tracer(path, capture=capture, writer=writer, flush_interval_s=0.01) as tracer:
            _emit(tracer, 1500)
        traces[writer] = read_trace(str(path))

    def content(t):  # noqa: ANN001, ANN202
        # Process instants take the real clock, and the metadata's wall time and pid differ.
        skip = {"wall_time_ns", "pid"}
        events = [
            (e.track, e.type, e.name, 0 if e.track.startswith("process:") else e.ts, {k: v for k, v in e.args.items() if k not in skip},
             e.flow_ids, e.terminating_flow_ids)
            for e in t.events
            if e.name != "trace_metadata" or e.args.get("closed") is None
        ]  # fmt: skip
        return sorted(events, key=repr), t.slices()

    thread_events, thread_slices = content(traces["thread"])
    process_events, process_slices = content(traces["process"])
    assert process_slices == thread_slices and len(thread_slices) > 0
    assert process_events == thread_events


CHILD = textwrap.dedent(
    """
    import sys, threading, time
    from instrument.tracer import Tracer
    threading.current_thread().name = "engine-core"
    tracer = Tracer(sys.argv[1], flush_interval_s=0.02, install_signal_handlers=True,
                    writer="process")
    step = 0
    while True:
        with tracer.span("schedule", step=step, num_reqs=1):
            time.sleep(0.001)
        step += 1
        if step == 50:
            print("ready", flush=True)
    """
)


@pytest.mark.parametrize("how", ["kill", "term", "int"])
def test_parent_killed_or_signalled_leaves_a_loadable_trace(tmp_path: Path, how: str) -> None:
    path = str(tmp_path / f"{how}.pftrace")
    env = dict(os.environ, PYTHONPATH=ROOT)
    # Own process group: a Ctrl-C reaches the writer child too, which must ignore it.
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, path],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    if how == "kill":
        proc.kill()
    else:
        sig = signal.SIGTERM if how == "term" else signal.SIGINT
        os.killpg(proc.pid, sig)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30  # the writer child finishes on its own after the parent
    trace = None
    while time.monotonic() < deadline:
        trace = read_trace(path)
        closed = any(e.args.get("closed") for e in trace.events)
        if (how == "kill" and len(trace.slices()) >= 50) or closed:
            break
        time.sleep(0.1)
    assert trace is not None
    slices = trace.slices()
    assert len(slices) >= 50 and all(s[1] == "schedule" for s in slices)
    if how != "kill":  # the parent's handler closed the trace: metadata and all
        assert any(e.args.get("closed") for e in trace.events)
        assert any("steps_seen" in e.args for e in trace.events)


def test_bad_writer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="writer must be one of"):
        Tracer(tmp_path / "t.pftrace", writer="fork")
