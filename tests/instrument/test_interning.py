"""Interned encoding: names and keys written once, sequence flags right, readers agree on round trips."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from analysis import TraceError, load_trace
from instrument.readback import read_packets, scan_packets
from instrument.schema import device_track_name
from instrument.tracer import Tracer

CLEARED = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
NEEDS = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE

# (arg value written, value read back by analysis)
ARG_CASES = {
    "small_int": (7, 7),
    "big_int": (1 << 40, 1 << 40),
    "negative": (-3, -3),
    "float": (0.25, 0.25),
    "flag": (True, True),
    "text": ("accepted_count", "accepted_count"),
    "unicode": ("naïve ✓", "naïve ✓"),
    "none": (None, "None"),
    "long": ("x" * 300, "x" * 300),
}


def _write(path: Path, steps: int = 20) -> None:
    threading.current_thread().name = "engine-core"
    with Tracer(path, flush_interval_s=0.01) as tracer:
        for step in range(steps):
            base = 1_000_000 * (step + 1)
            args = {k: v for k, (v, _) in ARG_CASES.items()}
            tracer.thread_slice("schedule", base, base + 500, step=step, **args)
            tracer.slice_at(device_track_name(0, "compute"), "forward", base, base + 900, step=step)
            tracer.instant("sync", op="item", where="x.py:1")
            tracer.counter("running_requests", step)
            tracer.counter("kv_usage", step / 8)


def test_names_are_interned_once(tmp_path: Path) -> None:
    path = tmp_path / "t.pftrace"
    _write(path)
    packets = scan_packets(path.read_bytes()).packets
    events = [p for p in packets if p.HasField("track_event")]
    named = [p.track_event for p in events if p.track_event.type != pb.TrackEvent.TYPE_SLICE_END]
    plain = [te for te in named if te.name]  # only process-scoped instants keep plain names
    assert all(te.type == pb.TrackEvent.TYPE_INSTANT for te in plain)
    slices = [te for te in named if te.type == pb.TrackEvent.TYPE_SLICE_BEGIN]
    assert slices and all(te.HasField("name_iid") and not te.name for te in slices)
    assert all(a.HasField("name_iid") and not a.name for te in slices for a in te.debug_annotations)
    interned = [p.interned_data for p in packets if p.HasField("interned_data")]
    names = [e.name for d in interned for e in d.event_names]
    keys = [e.name for d in interned for e in d.debug_annotation_names]
    assert sorted(names) == sorted(set(names)) and {"schedule", "forward", "sync"} <= set(names)
    assert sorted(keys) == sorted(set(keys)) and "step" in keys


def test_sequence_flags(tmp_path: Path) -> None:
    path = tmp_path / "t.pftrace"
    _write(path)
    packets = scan_packets(path.read_bytes()).packets
    first_clear = next(i for i, p in enumerate(packets) if p.sequence_flags & CLEARED)
    for i, p in enumerate(packets):
        te = p.track_event
        uses_interning = p.HasField("track_event") and (
            te.HasField("name_iid") or any(a.HasField("name_iid") for a in te.debug_annotations)
        )
        if uses_interning:
            assert i > first_clear and p.sequence_flags & NEEDS
    assert len({p.trusted_packet_sequence_id for p in packets}) == 1


def test_round_trip_through_both_readers(tmp_path: Path) -> None:
    path = tmp_path / "t.pftrace"
    _write(path)
    # instrument.readback resolves interning in place (what the tests' reader uses) ...
    begins = [
        p.track_event
        for p in read_packets(str(path)).packets
        if p.track_event.type == pb.TrackEvent.TYPE_SLICE_BEGIN and p.track_event.name == "schedule"
    ]
    assert len(begins) == 20
    ann = {a.name: a for a in begins[3].debug_annotations}
    assert ann["text"].string_value == "accepted_count" and ann["small_int"].int_value == 7
    # ... and analysis' vectorised loader reads the same values.
    frames = load_trace(path)
    sched = frames.slices[frames.slices["name"] == "schedule"].sort_values("step")
    assert sched["step"].tolist() == list(range(20))
    for key, (_, expected) in ARG_CASES.items():
        assert sched[key].tolist() == [expected] * 20, key
    assert set(frames.slices["name"]) == {"schedule", "forward"}
    assert frames.counters.groupby("name").size().to_dict() == {
        "running_requests": 20,
        "kv_usage": 20,
    }
    assert (frames.syncs["op"] == "item").sum() == 20


def test_a_trace_cut_anywhere_loads_its_whole_packets(tmp_path: Path) -> None:
    path = tmp_path / "t.pftrace"
    _write(path, steps=200)
    data = path.read_bytes()
    full = load_trace(path)
    previous = -1
    for frac in (0.2, 0.35, 0.5, 0.77, 0.9, 0.999):
        cut = tmp_path / f"cut{frac}.pftrace"
        cut.write_bytes(data[: int(len(data) * frac)])
        frames = load_trace(cut)
        n = len(frames.slices)
        assert previous <= n <= len(full.slices)
        assert frames.metadata["bytes_dropped"] >= 0
        kept = frames.slices[frames.slices["name"] == "schedule"]
        assert (kept["text"] == "accepted_count").all()  # interning survives the cut
        previous = n
    tiny = tmp_path / "tiny.pftrace"
    tiny.write_bytes(data[:5])
    with pytest.raises(TraceError):
        load_trace(tiny)
