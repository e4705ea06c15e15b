"""What one CUDA event call costs the calling thread: torch's C methods vs the driver's calls.

The device timeline makes, per engine step, 5 records on the engine thread, and about 8
conversions and 1-2 queries on its poller thread (``bench_trace_overhead.py`` counts them). This
times each kind of call alone, on this host and device, in the thread's CPU time and wall time
per call (minimum over batches: other processes only ever add): ``record`` of a timing event
through ``torch.cuda.Event.record``'s C method and through ``cuEventRecord`` on its handle
(``instrument.cuda_driver.CudaDriver``), a non-timing record for comparison (the runner's sync
events when tracing is off), ``query`` and ``elapsed_time`` both ways, and ``record`` while
another thread converts events in a loop (the poller at work: driver lock and GIL contention).

Then ``record`` behind a queue (:func:`queue_depth_costs`): inside the engine a record costs
~7 µs against ~1.7 µs here, for the runner's own untraced records too, while the host runs a
step or more ahead of the device. So the device is first kept busy (``torch.cuda._sleep``),
``depth`` small kernels are queued behind it, and records are timed with that queue in front of
them (mean and max wall per call, and the mean enqueue of the small kernels): a record that
waits for room in the queue is the device holding the host back, not work the host does.

    python bench/_event_cost.py            # CUDA only; prints a table, --json writes it
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["event_call_costs"]


def _per_call(fn: Callable[[], Any], n: int, batches: int) -> tuple[float, float]:
    """(CPU µs, wall µs) per call of ``fn``: minimum over ``batches`` batches of ``n`` calls."""
    cpu_best = wall_best = float("inf")
    cpu, wall = time.thread_time_ns, time.perf_counter_ns
    for _ in range(batches):
        c0, w0 = cpu(), wall()
        for _ in range(n):
            fn()
        c1, w1 = cpu(), wall()
        cpu_best = min(cpu_best, (c1 - c0) / n / 1e3)
        wall_best = min(wall_best, (w1 - w0) / n / 1e3)
    return cpu_best, wall_best


def event_call_costs(n: int = 2000, batches: int = 5) -> dict[str, dict[str, float]]:
    """Per kind of call: ``{"cpu_us": ..., "wall_us": ...}`` per call (see the module doc)."""
    import torch

    from instrument.cuda_driver import CudaDriver
    from instrument.device_events import c_method

    stream = torch.cuda.Stream()
    timing = [torch.cuda.Event(enable_timing=True) for _ in range(64)]
    plain = [torch.cuda.Event() for _ in range(64)]
    for event in timing + plain:  # created (torch creates CUDA events at their first record)
        event.record(stream)
    torch.cuda.synchronize()
    record = c_method(torch.cuda.Event, "record")
    query = c_method(torch.cuda.Event, "query")
    elapsed = c_method(torch.cuda.Event, "elapsed_time")
    driver = CudaDriver.load()
    ref = timing[0]
    cycle = iter(range(1 << 62))

    def nth(events: list[Any]) -> Any:
        return events[next(cycle) % len(events)]

    calls: dict[str, Callable[[], Any]] = {
        "record timing (torch)": lambda: record(nth(timing), stream),
        "record no timing (torch)": lambda: record(nth(plain), stream),
        "query (torch)": lambda: query(nth(timing)),
        "elapsed_time (torch)": lambda: elapsed(ref, nth(timing)),
    }
    if driver is not None:
        d = driver
        calls |= {
            "record timing (driver)": lambda: d.record(nth(timing), stream),
            "query (driver)": lambda: d.query(nth(timing)),
            "elapsed_time (driver)": lambda: d.elapsed_ms(ref, nth(timing)),
        }
    out: dict[str, dict[str, float]] = {}
    for name, fn in calls.items():
        torch.cuda.synchronize()
        cpu_us, wall_us = _per_call(fn, n, batches)
        out[name] = {"cpu_us": cpu_us, "wall_us": wall_us}
    # Records while another thread converts events nonstop (the poller at work). The converted
    # events are their own, completed and never recorded again: the records below re-record
    # ``timing``, and converting an event that is pending again fails (CUDA_ERROR_NOT_READY).
    done = [torch.cuda.Event(enable_timing=True) for _ in range(64)]
    for event in done:
        event.record(stream)
    torch.cuda.synchronize()
    done_ref, turn = done[0], iter(range(1 << 62))

    def convert() -> Any:
        event = done[next(turn) % len(done)]
        return d.elapsed_ms(done_ref, event) if driver else elapsed(done_ref, event)

    stop = threading.Event()

    device = torch.cuda.current_device()
    errors: list[str] = []

    def poller() -> None:
        torch.cuda.set_device(device)  # the timeline's poller binds its thread the same way
        try:
            while not stop.is_set():
                convert()
        except Exception as exc:  # noqa: BLE001 -- reported with the table
            errors.append(f"{type(exc).__name__}: {exc}")

    for name in [k for k in calls if k.startswith("record timing")]:
        thread = threading.Thread(target=poller, daemon=True)
        thread.start()
        torch.cuda.synchronize()
        cpu_us, wall_us = _per_call(calls[name], n, batches)
        stop.set()
        thread.join()
        stop.clear()
        if errors:
            raise RuntimeError(f"the converting thread failed: {errors[0]}")
        out[f"{name}, poller converting"] = {"cpu_us": cpu_us, "wall_us": wall_us}
    return out


def queue_depth_costs(
    depths: tuple[int, ...] = (0, 64, 256, 1024, 4096), records: int = 200
) -> list[dict[str, float]]:
    """Per queue depth: mean/max wall µs of a driver (or torch) record of a timing event made
    while the device works through a long kernel and ``depth`` small kernels queued behind it,
    and the mean µs to enqueue one of those small kernels."""
    import torch

    from instrument.cuda_driver import CudaDriver

    stream = torch.cuda.current_stream()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(records)]
    for event in events:
        event.record(stream)
    driver = CudaDriver.load()
    record = driver.record if driver is not None else (lambda e, s: e.record(s))
    x = torch.zeros(16, device="cuda")
    wall = time.perf_counter_ns
    out = []
    for depth in depths:
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of device time in front of everything below
        t0 = wall()
        for _ in range(depth):
            x.add_(1.0)
        enqueue_us = (wall() - t0) / max(depth, 1) / 1e3
        times = []
        for event in events:
            a = wall()
            record(event, stream)
            times.append((wall() - a) / 1e3)
        busy = not events[-1].query()  # the records really sat behind the queue
        torch.cuda.synchronize()
        out.append({"depth": depth, "record_mean_us": statistics.fmean(times),
                    "record_max_us": max(times), "enqueue_mean_us": enqueue_us,
                    "device_still_busy": float(busy)})  # fmt: skip
    return out


def print_costs(costs: dict[str, dict[str, float]]) -> None:
    print("CUDA event calls, per call on the calling thread (min over batches):")
    print(f"  {'call':<46} {'CPU us':>7} {'wall us':>8}")
    for name, c in costs.items():
        print(f"  {name:<46} {c['cpu_us']:>7.2f} {c['wall_us']:>8.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, default=2000, help="calls per batch")
    p.add_argument("--json", default=None, help="write the table here")
    args = p.parse_args()
    costs = event_call_costs(args.n)
    print_costs(costs)
    queue = queue_depth_costs()
    print("record behind a busy device and DEPTH small kernels queued (wall µs per call):")
    print(f"  {'depth':>6} {'record mean':>12} {'record max':>11} {'enqueue mean':>13} busy")
    for q in queue:
        print(f"  {q['depth']:>6} {q['record_mean_us']:>12.2f} {q['record_max_us']:>11.1f} "
              f"{q['enqueue_mean_us']:>13.2f} {bool(q['device_still_busy'])}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(costs | {"queue_depth": queue}, f, indent=2)


if __name__ == "__main__":
    main()
