"""The child-process writer writes what the in-process writer writes, and survives its parent."""

from __future__ import annotations

import os
import pickle
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from instrument.capture import CaptureConfig
from instrument.events import EV_SLICE_AT, flatten
from instrument.perfetto_writer import PerfettoWriter
from instrument.tracer import Tracer
from instrument.writer_process import PICKLE_CHUNK, ProcessWriter
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
    # Own process group: a Ctrl-C reaches the writer child too, which must ignore it. SIGINT at
    # its default (a shell's Ctrl-C), also when pytest was started in the background (SIG_IGN).
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, path],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
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


def _batch(num: int) -> list[tuple]:
    """``num`` complete slices on one thread track, with args (raw tuples as the tracer's)."""
    tid = threading.get_ident()
    return [
        (EV_SLICE_AT, tid, "forward", 1_000 + 10 * i, 1_005 + 10 * i, {"step": i, "n": 256})
        for i in range(num)
    ]


def test_a_large_batch_is_pickled_in_parts_and_written_as_one(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A flat batch of 3 parts and a remainder: no pickle call sees more than PICKLE_CHUNK items
    (parts end inside events: 6 items an event), and the file is the in-process writer's for the
    same batch."""
    events = _batch((3 * PICKLE_CHUNK + 7 * 6) // 6)
    assert len(flatten(events)) == 3 * PICKLE_CHUNK + 42
    names = {threading.get_ident(): ("engine-core", os.getpid())}
    sent: list[tuple[str, int]] = []
    send = ProcessWriter._send

    def spy(self, message):  # noqa: ANN001, ANN202
        sent.append((message[0], len(message[1]) if message[0] in ("part", "write") else 0))
        return send(self, message)

    monkeypatch.setattr(ProcessWriter, "_send", spy)
    process = ProcessWriter(str(tmp_path / "process.pftrace"))
    process.write(events, names)
    process.finish({}, 10**9)
    thread = PerfettoWriter(str(tmp_path / "thread.pftrace"))
    thread.write(events, names)
    thread.finish({}, 10**9)
    assert [s for s in sent if s[0] != "sync"] == [("part", PICKLE_CHUNK)] * 3 + [
        ("write", 42),
        ("finish", 0),
    ]
    got, want = (read_trace(str(tmp_path / f"{w}.pftrace")) for w in ("process", "thread"))
    assert len(want.slices()) == len(events) and got.slices() == want.slices()


def test_the_flush_pops_the_buffer_a_part_at_a_time(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The tracer's flush with the process writer takes its buffer a part at a time: when each
    part is pickled, the rest of the batch is still in the buffer (no single C call pops the
    whole batch while holding the GIL), and the file is the in-process writer's."""
    num = (3 * PICKLE_CHUNK + 7 * 6) // 6
    left: list[tuple[str, int]] = []
    send = ProcessWriter._send
    traces = {}
    for writer in ("process", "thread"):
        path = str(tmp_path / f"{writer}.pftrace")
        tracer = Tracer(path, writer=writer, flush_interval_s=3600)

        def spy(self, message, tracer=tracer):  # noqa: ANN001, ANN202
            if message[0] in ("part", "write"):
                left.append((message[0], len(tracer._buffer)))
            return send(self, message)

        monkeypatch.setattr(ProcessWriter, "_send", spy)
        threading.current_thread().name = "engine-core"
        for i in range(num):
            tracer.thread_slice("forward", 1_000 + 10 * i, 1_005 + 10 * i, step=i)
        queued = len(tracer._buffer)
        assert queued >= 3 * PICKLE_CHUNK + 42
        tracer.flush()
        assert len(tracer._buffer) == 0
        tracer.close()
        traces[writer] = read_trace(path)
        if writer == "process":
            parts = -(-queued // PICKLE_CHUNK) - 1
            assert left == [("part", queued - (k + 1) * PICKLE_CHUNK) for k in range(parts)] + [
                ("write", 0)
            ]
    got, want = traces["process"], traces["thread"]
    assert len(want.slices()) >= num and got.slices() == want.slices()


def test_parts_received_before_the_parent_died_are_kept(tmp_path: Path) -> None:
    """The child, its stdin closed after three flat parts and no ``write``: the whole events of
    the parts are in the file, the one cut short by the parent's death is left out."""
    path = str(tmp_path / "t.pftrace")
    config = pickle.dumps(
        tuple(getattr(CaptureConfig(), f) for f in CaptureConfig.__dataclass_fields__)
    ).hex()
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "instrument.writer_process", path, config, str(os.getpid())],
        stdin=subprocess.PIPE, env=env,
    )  # fmt: skip
    assert proc.stdin is not None
    cut = flatten(_batch(1))[:4]  # an event whose last fields never came
    for part in (flatten(_batch(5)), flatten(_batch(3)), cut):
        data = pickle.dumps(("part", part))
        proc.stdin.write(struct.pack("<I", len(data)) + data)
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0
    assert len(read_trace(path).slices()) == 8
