"""What the device timeline's stages cost the engine thread, Python core against compiled core.

No device: one process runs the runner's five stages of a plain decode step as the runner opens
them (``_StageSites``: h2d inputs, input prep after them, forward and sample contiguous, the d2h
output after the sample; the three sync events after h2d, sample and d2h; the output's event
given back a step later; the two poll hooks), on two timelines of one tracer, one per core
(``instrument/native.py``), alternated block by block. The events are stand-ins
(:class:`~instrument.device_events.StandInCudaEvent`) recorded through a driver whose
``cuEventRecord`` is a C function that does nothing (``_stagecore.NULL_RECORD_ADDR``): the
Python core reaches it through ``ctypes`` as it reaches libcuda, the compiled core calls it
directly. So the numbers are the stage path's own cost, without the driver's time (which is the
same for both). The polls run on the timeline's poller thread; the engine thread's CPU time
(``time.thread_time_ns``) is what is reported, per step: median over blocks, the spread, and the
ratio. Run on a 2-core machine and on the H200's hosts (bench/h200_session.sh ``stage-core``).

    python bench/bench_stage_core.py --steps 2000 --rounds 7
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from instrument import native  # noqa: E402
from instrument.cuda_driver import CUDA_SUCCESS, CudaDriver  # noqa: E402
from instrument.device_events import StandInCudaEvent, StandInStream  # noqa: E402
from instrument.device_timeline import DeviceTimeline  # noqa: E402
from instrument.tracer import Tracer  # noqa: E402

CORES = ("python", "c")


def _driver(null_addr: int) -> CudaDriver:
    """Records reach a C no-op (ctypes for the Python core, directly for the compiled one);
    queries and elapsed times read the stand-ins (the poller's, off the measured thread)."""
    from instrument.device_events import STAND_IN_HANDLES as objects

    record_fn = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(null_addr)

    def query_fn(handle: int) -> int:
        return CUDA_SUCCESS

    def elapsed_fn(ms: Any, start: int, end: int) -> int:
        ms._obj.value = (objects[end].ns - objects[start].ns) / 1e6
        return CUDA_SUCCESS

    def torch_record(event: Any, stream: Any) -> None:
        event.record(stream)

    return CudaDriver(record_fn, query_fn, elapsed_fn, torch_record, "null", record_addr=null_addr)


class _Loop:
    """One timeline and the runner's stage sites on it."""

    def __init__(self, tracer: Tracer, core: str, driver: CudaDriver) -> None:
        self.timeline = DeviceTimeline(
            tracer, 0, StandInCudaEvent.clock(driver=driver), background=True,
            begins="derived", core=core,
        )  # fmt: skip
        assert self.timeline.core == core, (core, self.timeline.core_reason)
        self.streams = {name: StandInStream(auto=True) for name in ("h2d", "compute", "d2h")}
        site = self.timeline.site
        self.h2d = site("h2d_inputs", lane="copy", stream=self.streams["h2d"])
        self.prep = site("input_prep", stream=self.streams["compute"])
        self.forward = site("forward", stream=self.streams["compute"])
        self.sample = site("sample", stream=self.streams["compute"])
        self.d2h = site("d2h_output", lane="copy", stream=self.streams["d2h"])
        self.ready: list[Any] = []
        self.step = 0

    def run(self, steps: int) -> int:
        """``steps`` decode steps' stage calls; the engine thread's CPU ns."""
        tl, s = self.timeline, self.streams
        h2d, prep, forward, sample, d2h = self.h2d, self.prep, self.forward, self.sample, self.d2h
        args = {"graph": True}
        total = 0
        for _ in range(steps):
            step = self.step
            self.step += 1
            start = time.thread_time_ns()
            tl.poll_if_due()
            with h2d.stage(step) as copied_in:
                pass
            tl.event_after_stage(s["h2d"], StandInCudaEvent, wait_only=True)
            with prep.stage(step, after=copied_in):
                pass
            with forward.stage(step, contiguous=True, args=args):
                pass
            with sample.stage(step, contiguous=True) as sampled:
                pass
            tl.event_after_stage(s["compute"], StandInCudaEvent, wait_only=True)
            with d2h.stage(step, after=sampled):
                pass
            self.ready.append(tl.event_after_stage(s["d2h"], StandInCudaEvent))
            tl.poll_while_waiting(lambda: False)
            if len(self.ready) > 1:
                tl.give_back(self.ready.pop(0))
            total += time.thread_time_ns() - start
            time.sleep(0)  # the engine's wait: the poller thread may run
        return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="steps per block (default 2000)")
    parser.add_argument("--rounds", type=int, default=7, help="blocks per core, alternated")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)
    module, reason = native.load()
    if module is None:
        print(f"the compiled stage core is {reason}", file=sys.stderr)
        return 2
    per_step: dict[str, list[float]] = {core: [] for core in CORES}
    with tempfile.TemporaryDirectory() as tmp:
        tracer = Tracer(Path(tmp) / "stage_core.pftrace")
        loops = {core: _Loop(tracer, core, _driver(module.NULL_RECORD_ADDR)) for core in CORES}
        for loop in loops.values():  # warm: the pools fill, the poller starts
            loop.run(args.steps)
        for _ in range(args.rounds):
            for core in CORES:
                per_step[core].append(loops[core].run(args.steps) / args.steps / 1e3)
        for loop in loops.values():
            loop.timeline.drain()
        direct = loops["c"].timeline.direct_records  # type: ignore[attr-defined]
        tracer.close()
    result: dict[str, Any] = {"steps_per_block": args.steps, "rounds": args.rounds}
    print(f"engine-thread CPU µs a decode step's stage calls ({args.rounds} alternated blocks of "
          f"{args.steps} steps; median, min..max):")  # fmt: skip
    for core in CORES:
        values = per_step[core]
        med = statistics.median(values)
        result[core] = {"median_us": med, "min_us": min(values), "max_us": max(values),
                        "blocks_us": values}  # fmt: skip
        print(f"  {core:<7} {med:7.2f}  ({min(values):.2f}..{max(values):.2f})")
    ratios = [c / p for p, c in zip(per_step["python"], per_step["c"], strict=True)]
    result["c_over_python_paired_median"] = statistics.median(ratios)
    result["direct_records"] = direct
    print(f"  compiled / python, paired median: {statistics.median(ratios):.3f}; "
          f"the compiled core's records made directly: {direct}")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
