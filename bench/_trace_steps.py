"""Engine steps written through the real Tracer, with the slices, args and counters the engine emits.

Per step (``engine/core.py``, ``engine/runner/model_runner.py``, ``engine/request_timeline.py``):
CPU ``schedule`` (six args), ``prepare_inputs``, ``launch``, ``wait_output`` (``kind``),
``update_from_output`` (three args); device ``h2d_inputs`` / ``d2h_output`` on the copy lane and
``input_prep`` / ``forward`` / ``sample`` on the compute lane (each with ``step``); the six
counters; and, with request tracks, ``queued`` / ``prefill`` / ``decode`` on ``request <id>`` for
every request that finishes (``batch / output_len`` per step on average).

Timestamps are synthetic and deterministic (1 ms per step, the device half a step behind), so a
trace's size and its analysis do not depend on the machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from instrument.schema import (
    Arg,
    CopySlice,
    Counter,
    CpuSlice,
    DeviceSlice,
    RequestSlice,
    WaitKind,
    device_track_name,
    request_track_name,
)
from instrument.tracer import Tracer

__all__ = ["StepPattern", "emit_steps"]

_COMPUTE = device_track_name(0, "compute")
_COPY = device_track_name(0, "copy")


@dataclass(frozen=True)
class StepPattern:
    """What each step looks like: batch size, prefill share, output length, request tracks."""

    batch: int
    output_len: int = 128
    prefill_every: int = 16  # one step in N carries a prefill chunk (a mixed step)
    request_tracks: bool = False
    step_ns: int = 1_000_000


def _cpu(tracer: Tracer, base: int, step: int, p: StepPattern) -> None:
    prefill = 1 if step % p.prefill_every == 0 else 0
    tracer.thread_slice(
        CpuSlice.SCHEDULE.value,
        base + 10_000,
        base + 150_000,
        **{
            Arg.STEP.value: step,
            Arg.NUM_REQS.value: p.batch,
            Arg.NUM_TOKENS.value: p.batch - prefill + prefill * 512,
            Arg.NUM_PREFILL.value: prefill,
            Arg.NUM_DECODE.value: p.batch - prefill,
            Arg.NUM_SPEC_TOKENS.value: 0,
        },
    )
    tracer.thread_slice(CpuSlice.PREPARE_INPUTS.value, base + 150_000, base + 250_000, step=step)
    tracer.thread_slice(CpuSlice.LAUNCH.value, base + 250_000, base + 300_000, step=step)
    if step == 0:  # nothing to wait for before the first step
        return
    wait = {Arg.STEP.value: step - 1, Arg.KIND.value: WaitKind.SAMPLED.value}
    tracer.thread_slice(CpuSlice.WAIT_OUTPUT.value, base + 300_000, base + 700_000, **wait)
    tracer.thread_slice(
        CpuSlice.UPDATE_FROM_OUTPUT.value,
        base + 700_000,
        base + 900_000,
        **{
            Arg.STEP.value: step - 1,
            Arg.NUM_ACCEPTED.value: 0,
            Arg.NUM_REJECTED.value: 0,
            Arg.NUM_FINISHED.value: p.batch // p.output_len,
        },
    )


def _device(tracer: Tracer, base: int, step: int) -> None:
    t = base + 300_000
    tracer.slice_at(_COPY, CopySlice.H2D_INPUTS.value, t, t + 20_000, step=step)
    tracer.slice_at(_COMPUTE, DeviceSlice.INPUT_PREP.value, t + 20_000, t + 60_000, step=step)
    tracer.slice_at(_COMPUTE, DeviceSlice.FORWARD.value, t + 60_000, t + 900_000, step=step)
    tracer.slice_at(_COMPUTE, DeviceSlice.SAMPLE.value, t + 900_000, t + 960_000, step=step)
    tracer.slice_at(_COPY, CopySlice.D2H_OUTPUT.value, t + 960_000, t + 980_000, step=step)


def _counters(tracer: Tracer, step: int, p: StepPattern) -> None:
    values = {
        Counter.RUNNING_REQUESTS: p.batch,
        Counter.WAITING_REQUESTS: 3,
        Counter.KV_USAGE: 0.25 + (step % 100) / 400,
        Counter.OUTPUT_PLACEHOLDERS: p.batch,
        Counter.ACCEPTED_TOKENS: 0,
        Counter.BATCH_TOKENS: p.batch,
    }
    for counter, value in values.items():
        tracer.counter(counter.value, value)


def _requests(tracer: Tracer, base: int, step: int, p: StepPattern, finished: int) -> None:
    for k in range(finished):
        req_id = f"req-{step}-{k}"
        track = request_track_name(req_id)
        arrival = base - p.output_len * p.step_ns
        args = {Arg.REQUEST_ID.value: req_id}
        tracer.slice_at(track, RequestSlice.QUEUED.value, arrival, arrival + 200_000, **args)
        first = arrival + 2 * p.step_ns
        tracer.slice_at(track, RequestSlice.PREFILL.value, arrival + 200_000, first, **args)
        tracer.slice_at(
            track,
            RequestSlice.DECODE.value,
            first,
            base,
            **args,
            **{Arg.NUM_OUTPUT_TOKENS.value: p.output_len},
        )


def emit_steps(tracer: Tracer, first: int, num_steps: int, p: StepPattern, t0: int = 0) -> None:
    """Emit steps ``first .. first+num_steps-1`` (an async engine: step N's wait and update run
    in iteration N+1) on the calling thread's track."""
    owed = 0.0
    for step in range(first, first + num_steps):
        base = t0 + step * p.step_ns
        _cpu(tracer, base, step, p)
        _device(tracer, base, step)
        _counters(tracer, step, p)
        if p.request_tracks:
            owed += p.batch / p.output_len
            finished = int(owed)
            owed -= finished
            _requests(tracer, base, step, p, finished)
