"""Real stepscope traces written with :class:`instrument.tracer.Tracer`, for the dashboard tests
and the dashboard benchmark.

An engine loop (sync, or async with a queue of depth 2) is played on a thread named
``engine-core`` against a simulated clock (:class:`SimClock`): CPU work is written with
``Tracer.thread_slice`` (explicit times on the thread's track), device work with ``slice_at`` on
``gpu:0 compute``/``copy``, queued behind earlier device work as a stream would run it. Instants
and counters take the tracer's clock, which is pointed at the simulated one while the loop runs.
No sleeping, so a 100k-step trace takes seconds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import instrument.tracer as tracer_module
from instrument.schema import FLOW_ID_BASE, device_track_name, request_track_name
from instrument.tracer import Tracer

__all__ = ["TraceRecipe", "SimClock", "write_engine_trace"]

_COMPUTE = device_track_name(0, "compute")
_COPY = device_track_name(0, "copy")


@dataclass(frozen=True)
class TraceRecipe:
    """Shape of a simulated engine run (times in µs, jittered by a seeded RNG)."""

    num_steps: int = 40
    forward_us: float = 400.0
    schedule_us: float = 120.0
    update_us: float = 60.0
    async_scheduling: bool = False
    slow_schedule_every: int = 9  # every n-th schedule is slow (admission, preemption)
    slow_schedule_factor: float = 6.0
    num_requests: int = 4
    hot_sync_steps: tuple[int, ...] = (5, 17)
    model: str = "tiny-llama"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_steps < 2:
            raise ValueError(f"num_steps must be >= 2, got {self.num_steps}")
        if min(self.forward_us, self.schedule_us, self.update_us) <= 0:
            raise ValueError("durations must be > 0")


class SimClock:
    """A monotonic nanosecond clock that moves only when told to."""

    def __init__(self, start_ns: int) -> None:
        self.now = start_ns

    def __call__(self) -> int:
        return self.now

    def advance_us(self, us: float) -> None:
        self.now += max(int(us * 1000), 1)

    def wait_until(self, ns: int) -> None:
        self.now = max(self.now, ns)


@contextmanager
def _clock(clock: SimClock) -> Iterator[None]:
    saved = tracer_module.now_ns
    tracer_module.now_ns = clock
    try:
        yield
    finally:
        tracer_module.now_ns = saved


class _Engine:
    """The simulated loop; ``device_free`` is when the device stream drains."""

    def __init__(self, tracer: Tracer, clock: SimClock, recipe: TraceRecipe) -> None:
        self.t, self.clock, self.r = tracer, clock, recipe
        self.rng = np.random.default_rng(recipe.seed)
        self.device_free = clock.now

    def jitter(self, us: float) -> float:
        return us * float(self.rng.uniform(0.85, 1.15))

    def cpu(self, name: str, us: float, **args: object) -> None:
        start = self.clock.now
        self.clock.advance_us(self.jitter(us))
        self.t.thread_slice(name, start, self.clock.now, **args)

    def launch(self, step: int, batch: int) -> int:
        """CPU launch of step ``step``; returns when its output will be ready."""
        self.cpu("launch", 25, step=step, flow_out=FLOW_ID_BASE + step)
        start = max(self.clock.now, self.device_free)
        t = start
        for name, us in (
            ("input_prep", 30),
            ("forward", self.r.forward_us * (1 + 0.04 * batch)),
            ("sample", 45),
        ):
            end = t + int(self.jitter(us) * 1000)
            extra = {"flow_in": FLOW_ID_BASE + step} if name == "forward" else {}
            self.t.slice_at(_COMPUTE, name, t, end, step=step, **extra)
            t = end
        self.t.slice_at(_COPY, "h2d_inputs", start - 8_000, start, step=step)
        self.t.slice_at(_COPY, "d2h_output", t, t + 6_000, step=step)
        self.device_free = t
        return t + 6_000

    def schedule(self, step: int, batch: int) -> None:
        slow = self.r.slow_schedule_every and step % self.r.slow_schedule_every == 0
        self.cpu(
            "schedule",
            self.r.schedule_us * (self.r.slow_schedule_factor if slow else 1),
            step=step,
            num_reqs=batch,
            num_tokens=batch * 3,
            num_prefill=int(step < 2),
            num_decode=batch,
            num_spec_tokens=batch * 2,
        )
        self.cpu("prepare_inputs", self.r.schedule_us / 3, step=step)

    def finish(self, step: int, ready_ns: int) -> None:
        start = self.clock.now
        self.clock.wait_until(ready_ns)
        self.clock.advance_us(2)
        self.t.thread_slice("wait_output", start, self.clock.now, step=step, kind="accepted_count")
        if step in self.r.hot_sync_steps:
            self.t.instant(
                "sync",
                op="item",
                where="engine/runner/model_runner.py:212",
                stack="model_runner.py:212 execute_model\ncore.py:88 step",
                hot=True,
            )
        accepted = 1 + int(self.rng.integers(0, 3))
        self.cpu(
            "update_from_output",
            self.r.update_us,
            step=step,
            num_accepted=accepted,
            num_rejected=2 - accepted + 1,
            num_finished=0,
        )
        self.t.counter("accepted_tokens", accepted)

    def run(self) -> None:
        pending: tuple[int, int] | None = None
        for step in range(self.r.num_steps):
            batch = self.r.num_requests + step % 3
            start = self.clock.now
            self.schedule(step, batch)
            ready = self.launch(step, batch)
            if self.r.async_scheduling:
                if pending is not None:
                    self.finish(*pending)
                pending = (step, ready)
            else:
                self.finish(step, ready)
            self.t.thread_slice("step", start, self.clock.now, step=step)
            self.t.counter("batch_tokens", batch * 3)
            self.t.counter("running_requests", batch)
        if pending is not None:
            self.finish(*pending)


def _decisions(tracer: Tracer, recipe: TraceRecipe) -> None:
    rows = [
        (
            "async_scheduling",
            "None",
            recipe.async_scheduling,
            "auto: device supports async output"
            if recipe.async_scheduling
            else "auto: structured output forces sync",
        ),
        ("cuda_graphs", "None", False, ""),  # a silent fallback: off, nobody told the user why
        ("triton_kernels", "True", True, "requested"),
        ("pinned_memory", "False", False, "requested off"),
    ]
    for feature, requested, resolved, reason in rows:
        tracer.instant(
            "feature_decision",
            scope="process",
            feature=feature,
            requested=requested,
            resolved=resolved,
            reason=reason,
        )
    tracer.instant(
        "engine_config",
        scope="process",
        model=recipe.model,
        async_scheduling=recipe.async_scheduling,
        max_num_seqs=recipe.num_requests,
    )


def _requests(tracer: Tracer, recipe: TraceRecipe, t0: int, t1: int) -> None:
    span = max(t1 - t0, 1)
    for i in range(recipe.num_requests):
        track = request_track_name(f"r{i}")
        arrive = t0 + i * span // (8 * recipe.num_requests)
        first = arrive + span // 20
        tracer.slice_at(track, "queued", arrive, arrive + span // 100, request_id=f"r{i}")
        tracer.slice_at(track, "prefill", arrive + span // 100, first, request_id=f"r{i}")
        tracer.slice_at(track, "decode", first, t1, request_id=f"r{i}")


def write_engine_trace(
    path: str | Path, recipe: TraceRecipe | None = None, metadata: dict[str, object] | None = None
) -> Path:
    """Play ``recipe`` on an ``engine-core`` thread into a trace at ``path``; returns the path.
    ``metadata``: extra ``trace_metadata`` args (e.g. a tensor-parallel ``rank``/``world_size``)."""
    recipe = recipe or TraceRecipe()
    path = Path(path)
    tracer = Tracer(path, flush_interval_s=0.2)
    if metadata:
        tracer.metadata(**metadata)
    clock = SimClock(tracer_module.now_ns())
    errors: list[BaseException] = []

    def body() -> None:
        try:
            t0 = clock.now
            with _clock(clock):
                _decisions(tracer, recipe)
                _Engine(tracer, clock, recipe).run()
            _requests(tracer, recipe, t0, clock.now)
        except BaseException as exc:  # re-raised on the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=body, name="engine-core")
    thread.start()
    thread.join()
    tracer.close()
    if errors:
        raise errors[0]
    return path
