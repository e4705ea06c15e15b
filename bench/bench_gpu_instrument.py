"""On a CUDA device: a loop of small kernels traced with the device timeline.

Checks (and prints) that the traced loop makes no hot syncs, and that the device slices line up
with the kernels CUPTI sees (torch.profiler): after aligning the two clocks by their median offset,
the fraction of kernels that fall inside their step's slice, and the slice-vs-kernel duration gap.

Usage: python bench/bench_gpu_instrument.py [--steps 1000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch

from engine.device import CudaDevice
from instrument.device_timeline import DeviceTimeline
from instrument.readback import read_packets
from instrument.sync_detect import SyncDetector, hot_region
from instrument.tracer import Tracer


def _device_slices(path: str) -> list[tuple[int, int, int]]:
    """(step, start_ns, end_ns) of the forward slices, from the written trace."""
    packets = read_packets(path).packets
    begins: dict[int, tuple[int, int]] = {}
    out = []
    for p in packets:
        if not p.HasField("track_event"):
            continue
        te = p.track_event
        if te.type == te.TYPE_SLICE_BEGIN and te.name == "forward":
            step = next(a.int_value for a in te.debug_annotations if a.name == "step")
            begins[te.track_uuid] = (step, p.timestamp)
        elif te.type == te.TYPE_SLICE_END and te.track_uuid in begins:
            step, start = begins.pop(te.track_uuid)
            out.append((step, start, p.timestamp))
    return sorted(out)


def run(steps: int, numel: int) -> dict[str, float]:
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "gpu.pftrace")
    tracer = Tracer(path)
    device = CudaDevice(0)
    timeline = DeviceTimeline(tracer, 0, device.timed_event_factory())
    x = torch.randn(numel, device="cuda")
    stream = device.compute_stream

    def body() -> None:
        x.mul_(1.0001).add_(1e-6)  # two small kernels per step

    for _ in range(20):  # warm-up, untraced
        device.submit(stream, body)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        with SyncDetector(tracer) as detector, hot_region():
            for step in range(steps):
                with timeline.stage("forward", step=step, stream=stream):
                    device.submit(stream, body)
                timeline.poll()
        torch.cuda.synchronize()
    timeline.drain()
    tracer.close()
    hot = [h for h in detector.hits if h.hot]
    slices = _device_slices(path)
    cuda = torch.autograd.DeviceType.CUDA
    kernels = sorted(
        (int(e.time_range.start * 1000), int(e.time_range.end * 1000))  # us -> ns
        for e in prof.events()
        if e.device_type == cuda
    )
    # Two kernels per step, in order: pair them with their step's slice. The end event runs right
    # after the step's last kernel on the same stream, so slice ends align the two clocks; the
    # begin event may run earlier (the device idles while the CPU launches the kernels).
    pairs = list(zip(slices, zip(kernels[0::2], kernels[1::2], strict=False), strict=False))
    offsets = [s[2] - k[1][1] for s, k in pairs]
    offset = statistics.median(offsets)
    tol_ns = 2_000
    inside = sum(
        1
        for s, k in pairs
        if s[1] - tol_ns <= k[0][0] + offset and k[1][1] + offset <= s[2] + tol_ns
    )
    end_gaps = sorted(abs(s[2] - (k[1][1] + offset)) for s, k in pairs)
    gaps = [(s[2] - s[1]) - (k[1][1] - k[0][0]) for s, k in pairs]
    return {
        "steps": steps,
        "numel": numel,
        "device_slices": len(slices),
        "kernels_seen": len(kernels),
        "hot_syncs": len(hot),
        "all_syncs": len(detector.hits),
        "kernel_pairs_inside_slice_frac": inside / max(len(pairs), 1),
        "slice_minus_kernel_dur_ns_median": statistics.median(gaps) if gaps else float("nan"),
        "slice_minus_kernel_dur_ns_p95": sorted(gaps)[int(0.95 * (len(gaps) - 1))]
        if gaps
        else float("nan"),
        "end_misalignment_ns_p50": end_gaps[len(end_gaps) // 2] if end_gaps else float("nan"),
        "end_misalignment_ns_p99": end_gaps[int(0.99 * (len(end_gaps) - 1))]
        if end_gaps
        else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument(
        "--sizes",
        default="65536,16777216",
        help="elements per kernel: small (device starved) and larger (queued)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = [run(args.steps, int(n)) for n in args.sizes.split(",")]
    for key in results[0]:
        print(f"{key:<36} " + "  ".join(f"{r[key]:>12}" for r in results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
