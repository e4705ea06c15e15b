"""CpuDevice: enqueue order, events, cross-stream waits, error propagation, real concurrency."""

from __future__ import annotations

import threading
import time
import traceback

import pytest
import torch

from engine.device import CpuDevice, CpuEvent, create_device


@pytest.fixture
def device():
    dev = CpuDevice()
    yield dev
    dev.close()


def test_work_runs_in_enqueue_order_off_the_caller_thread(device: CpuDevice) -> None:
    seen: list[tuple[int, str]] = []
    for i in range(50):
        device.submit(
            device.compute_stream, lambda i=i: seen.append((i, threading.current_thread().name))
        )
    done = CpuEvent()
    done.record(device.compute_stream)
    done.synchronize()
    assert [i for i, _ in seen] == list(range(50))
    assert {name for _, name in seen} == {"cpu-stream-compute"}


def test_submit_returns_before_work_runs(device: CpuDevice) -> None:
    gate = threading.Event()
    ran = threading.Event()
    device.submit(device.compute_stream, gate.wait)
    device.submit(device.compute_stream, ran.set)
    event = device.new_event()
    event.record(device.compute_stream)
    assert not ran.is_set() and not event.query()
    gate.set()
    event.synchronize()
    assert ran.is_set() and event.query()


def test_event_host_ns_is_stamped_when_reached(device: CpuDevice) -> None:
    start, end = CpuEvent(), CpuEvent()
    start.record(device.compute_stream)
    device.submit(device.compute_stream, lambda: time.sleep(0.02))
    end.record(device.compute_stream)
    end.synchronize()
    assert start.query()
    assert end.host_ns() - start.host_ns() >= 15_000_000
    assert CpuEvent().query()  # never recorded: complete, as in CUDA
    with pytest.raises(RuntimeError):
        CpuEvent().host_ns()


def test_wait_event_orders_two_streams(device: CpuDevice) -> None:
    log: list[str] = []
    gate = threading.Event()
    device.submit(device.compute_stream, gate.wait)
    device.submit(device.compute_stream, lambda: log.append("compute"))
    produced = device.new_event()
    produced.record(device.compute_stream)
    device.wait_event(device.d2h_stream, produced)
    device.submit(device.d2h_stream, lambda: log.append("copy"))
    copied = device.new_event()
    copied.record(device.d2h_stream)
    time.sleep(0.02)
    assert log == [] and not copied.query()
    gate.set()
    copied.synchronize()
    assert log == ["compute", "copy"]


def test_error_is_reraised_with_original_traceback_and_poisons_dependents(
    device: CpuDevice,
) -> None:
    def bad_kernel() -> None:
        raise ValueError("boom in kernel")

    ran_after = threading.Event()
    device.submit(device.compute_stream, bad_kernel)
    device.submit(device.compute_stream, ran_after.set)
    produced = device.new_event()
    produced.record(device.compute_stream)
    device.wait_event(device.d2h_stream, produced)
    copied = device.new_event()
    copied.record(device.d2h_stream)
    with pytest.raises(ValueError, match="boom in kernel") as info:
        copied.synchronize()
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "bad_kernel" in frames
    assert not ran_after.is_set()  # later work on a poisoned stream is skipped
    with pytest.raises(ValueError):
        produced.synchronize()


def test_streams_overlap_for_real(device: CpuDevice) -> None:
    # Two sleeps on two streams finish in about one sleep: the workers are real threads.
    t0 = time.monotonic()
    for stream in (device.compute_stream, device.d2h_stream):
        device.submit(stream, lambda: time.sleep(0.1))
    device.synchronize()
    assert time.monotonic() - t0 < 0.18


def test_worker_runs_without_autograd(device: CpuDevice) -> None:
    w = torch.ones(3, requires_grad=True)
    out: list[torch.Tensor] = []
    device.submit(device.compute_stream, lambda: out.append(w * 2))
    device.synchronize()
    assert not out[0].requires_grad


def test_close_is_clean_and_final() -> None:
    dev = create_device("cpu")
    dev.submit(dev.compute_stream, lambda: None)
    dev.close()
    with pytest.raises(RuntimeError, match="closed"):
        dev.submit(dev.compute_stream, lambda: None)


def test_create_device_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError):
        create_device("tpu")


def test_a_timeline_record_of_a_cpu_event_is_one_python_frame(device: CpuDevice) -> None:
    """The device timeline records five CpuEvents per traced step on the engine thread: through
    its EventOps each record enters exactly one Python function (CpuEvent.record, which builds and
    enqueues the stamp inline), and the event behaves as before (docs/design.md §4.3)."""
    import sys

    from instrument.device_events import as_ops

    ops = as_ops(device.timed_event_factory())
    event = ops.new()
    calls: list[str] = []

    def profile(frame, what, arg):  # noqa: ANN001 -- sys.setprofile's signature
        if what == "call":
            calls.append(frame.f_code.co_qualname)

    sys.setprofile(profile)
    try:
        ops.record(event, device.compute_stream)
    finally:
        sys.setprofile(None)
    assert calls == ["CpuEvent.record"]
    event.synchronize()
    assert ops.query(event) and event.host_ns() > 0
    with pytest.raises(TypeError, match="needs a CpuStream"):
        ops.record(event, None)
    closed = CpuDevice()
    closed.close()
    with pytest.raises(RuntimeError, match="is closed"):
        ops.record(event, closed.compute_stream)
