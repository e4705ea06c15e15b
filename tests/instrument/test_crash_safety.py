"""A killed or signalled process leaves a trace that loads up to its last flush."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from instrument.readback import scan_packets
from tests.instrument.conftest import read_trace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent(
    """
    import sys, threading, time
    from instrument.tracer import Tracer
    threading.current_thread().name = "engine-core"
    tracer = Tracer(sys.argv[1], flush_interval_s=0.02, install_signal_handlers=True)
    step = 0
    while True:
        with tracer.span("schedule", step=step, num_reqs=1, num_tokens=1, num_prefill=0,
                         num_decode=1, num_spec_tokens=0):
            time.sleep(0.001)
        step += 1
        if step == 50:
            print("ready", flush=True)
    """
)


def _run_child(path: str, ignore_sigint: bool = False) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=ROOT)

    def preexec() -> None:  # what `nohup` / `cmd &` do to SIGINT
        if ignore_sigint:
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, path],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=preexec,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)  # several flushes
    return proc


def test_sigkill_leaves_loadable_prefix(tmp_path):
    path = str(tmp_path / "killed.pftrace")
    proc = _run_child(path)
    proc.kill()
    proc.wait()
    slices = read_trace(path).slices()
    assert len(slices) >= 50
    assert all(s[1] == "schedule" for s in slices)


def test_sigterm_flushes_and_closes(tmp_path):
    path = str(tmp_path / "term.pftrace")
    proc = _run_child(path)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGTERM
    trace = read_trace(path)
    closing = [e for e in trace.events if e.name == "trace_metadata" and "closed" in e.args]
    assert closing, "the SIGTERM handler did not close the trace"


def test_ignored_sigint_neither_stops_nor_closes(tmp_path):
    """Issue 18: with SIGINT ignored by the parent, the tracer closed the trace on SIGINT while
    the run went on. It must install no handler for an ignored signal."""
    path = str(tmp_path / "bg.pftrace")
    proc = _run_child(path, ignore_sigint=True)
    proc.send_signal(signal.SIGINT)
    before = len(read_trace(path).slices())
    time.sleep(0.5)
    assert proc.poll() is None  # still running
    proc.send_signal(signal.SIGTERM)  # not ignored: handled, closes the trace
    proc.wait(timeout=10)
    trace = read_trace(path)
    assert len(trace.slices()) > before  # kept recording after the SIGINT
    closing = [e for e in trace.events if e.name == "trace_metadata" and "closed" in e.args]
    assert len(closing) == 1


def test_cut_anywhere_loads_whole_packets(tmp_path):
    path = str(tmp_path / "t.pftrace")
    proc = _run_child(path)
    proc.kill()
    proc.wait()
    data = open(path, "rb").read()
    full = scan_packets(data)
    for cut in (len(data) - 1, len(data) * 2 // 3, len(data) // 3, 7):
        scan = scan_packets(data[:cut])
        assert len(scan.packets) <= len(full.packets)
        assert scan.packets == full.packets[: len(scan.packets)]
        framed = sum(_framed_size(p) for p in scan.packets)
        assert framed + scan.truncated_bytes == cut


def _framed_size(packet) -> int:
    body = len(packet.SerializeToString())
    varint_len = max(1, (body.bit_length() + 6) // 7)
    return 1 + varint_len + body
