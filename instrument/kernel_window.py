"""Kernel windows: CUPTI kernel, memcpy and memset activity of engine steps ``[first, end)``.

``stepscope run --trace-kernels A:B`` records the device activity of engine steps A..B-1 with
torch.profiler (``activities=[CUDA]`` only: no CPU ops, no stacks, no shapes) and writes every
kernel into the same Perfetto trace, one slice per kernel on the ``gpu:<i> kernels`` track, with
args ``stage`` (the device stage it ran in), ``step`` and ``activity`` (docs/design.md).

**Clock alignment.** Kineto stamps device activity on its own clock (the system clock); the trace
uses the host monotonic clock, onto which the stage slices are mapped through CUDA events
(:class:`~instrument.device_timeline.CudaClock`). At the start and at the end of the window a
marker is enqueued on the compute stream: timing event ``e0``, a ~1 µs spin kernel, timing event
``e1``. The stream runs them in order, so the spin kernel ``[ks, ke]`` (Kineto clock) lies inside
``[e0, e1]`` (host clock): the offset host - Kineto is within ``[e0 - ks, e1 - ke]``. The window
takes the intersection of the two markers' intervals (``combine_brackets``); ``kernel_clock_error_ns``
in ``trace_metadata`` bounds the error (half the intersection; if the brackets do not meet, the
clocks drifted: half the widest interval plus half the two markers' disagreement). The markers are not written as kernels.

**Stage attribution.** A kernel belongs to the stage slice that contains its midpoint. Copy-lane
slices of step N+1 can run during compute-lane slices of step N, so a kernel inside two slices
goes to the one whose stage its CUDA stream ran most often among kernels with one candidate,
then to the lane of its kind (memcpy: copy; kernel, memset: compute); a kernel inside none (alignment error) goes to the nearest slice within ``tolerance_ns``, else it
is written with ``stage = "unattributed"``. Kernels of steps outside ``[first, end)`` (the window
starts while step ``first - 1`` may still run, and stops after step ``end`` was launched) are not
written and are counted as ``dropped_kernels_outside_window``.

Starting the profiler and stopping it (which synchronises the device) happen at the window's
edges, off the steps measured; CUPTI itself slows every launch inside the window a little.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter as _Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from instrument.schema import DEVICE_KERNELS, Arg, CaptureArg, device_track_name
from instrument.tracer import Tracer

__all__ = [
    "KernelRecord",
    "StageSpan",
    "KernelWindow",
    "attribute_kernels",
    "activity_kind",
    "UNATTRIBUTED",
    "MARKER_KERNEL",
]

UNATTRIBUTED = "unattributed"
MARKER_KERNEL = "spin_kernel"  # torch.cuda._sleep's kernel: the clock marker
MARKER_CYCLES = 2_000  # the marker spin (~1 µs)
PRE_SPIN_CYCLES = 400_000  # keeps the stream busy ~200 µs while the host records the bracket
_ACTIVITIES = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}


@dataclass(frozen=True)
class KernelRecord:
    """One CUPTI activity record, times on the host clock."""

    name: str
    activity: str  # "kernel", "memcpy" or "memset"
    stream: int
    start_ns: int
    end_ns: int


@dataclass(frozen=True)
class StageSpan:
    """A device stage slice as the timeline emitted it (host clock)."""

    lane: str
    name: str
    step: int
    start_ns: int
    end_ns: int


def activity_kind(activity_type: str) -> str | None:
    """Kineto's activity type -> ``kernel`` / ``memcpy`` / ``memset``; None for anything else
    (runtime calls, annotations)."""
    return _ACTIVITIES.get(activity_type)


_SYNC_ACTIVITIES = ("event sync", "stream sync", "context sync", "stream wait event")


def kind_from_name(name: str) -> str | None:
    """A device activity's kind from its CUPTI name (``Memcpy DtoH (Device -> Pinned)``,
    ``Memset (Device)``; CUPTI's synchronization records are None; anything else a kernel)."""
    lowered = name.lower()
    if lowered.startswith(_SYNC_ACTIVITIES):
        return None
    if lowered.startswith("memcpy"):
        return "memcpy"
    if lowered.startswith("memset"):
        return "memset"
    return "kernel"


def _event_kind(event: Any) -> str | None:
    """``kernel`` / ``memcpy`` / ``memset`` of a Kineto event, None for host-side events.
    Torch builds without ``activity_type()`` (2.11) are read by device type and name."""
    if hasattr(event, "activity_type"):
        return activity_kind(str(event.activity_type()))
    if "cuda" not in str(event.device_type()).lower():
        return None  # runtime calls and annotations sit on the CPU side
    return kind_from_name(str(event.name()))


def combine_brackets(intervals: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The host-minus-Kineto offset from the markers' brackets, and a bound on its error.

    Each marker says offset ∈ [lo, hi]; with no drift all hold, so the offset lies in their
    intersection (the tightest marker wins: on the H200 the first spin kernel after the profiler
    starts is launched ~8 ms after its begin event, a loose bracket, while the end marker's is
    ~3 µs wide). An empty intersection (the clocks drifted apart over the window) falls back to
    the mean of the midpoints, bounded by half the widest bracket plus half their disagreement.
    """
    lo = max(b[0] for b in intervals)
    hi = min(b[1] for b in intervals)
    if lo <= hi:
        return (lo + hi) // 2, (hi - lo + 1) // 2
    mids = [(a + b) // 2 for a, b in intervals]
    spread = (max(mids) - min(mids) + 1) // 2
    return sum(mids) // len(mids), max((b - a + 1) // 2 for a, b in intervals) + spread


def _distance(k: KernelRecord, s: StageSpan) -> int:
    mid = (k.start_ns + k.end_ns) // 2
    return max(s.start_ns - mid, mid - s.end_ns, 0)


def attribute_kernels(
    kernels: Sequence[KernelRecord], stages: Sequence[StageSpan], tolerance_ns: int = 20_000
) -> list[StageSpan | None]:
    """For each kernel, the stage slice it ran in (None: no slice within ``tolerance_ns``).

    Rule: the slice containing the kernel's midpoint; among several, the stage its stream ran
    most often (counted over kernels with a single containing slice), then the lane of its kind
    (a memcpy on the copy lane, a kernel or memset on the compute lane), then the shortest slice; among none, the nearest slice within ``tolerance_ns``.
    """
    ordered = sorted(stages, key=lambda s: s.start_ns)
    starts = [s.start_ns for s in ordered]
    longest = max((s.end_ns - s.start_ns for s in ordered), default=0)
    candidates: list[list[StageSpan]] = []
    for k in kernels:
        mid = (k.start_ns + k.end_ns) // 2
        lo = bisect.bisect_left(starts, mid - longest - tolerance_ns)
        hi = bisect.bisect_right(starts, mid + tolerance_ns)
        near = ordered[lo:hi]
        inside = [s for s in near if s.start_ns <= mid <= s.end_ns]
        if not inside:
            near = [s for s in near if _distance(k, s) <= tolerance_ns]
            inside = sorted(near, key=lambda s: _distance(k, s))[:1]
        candidates.append(inside)
    votes: dict[int, _Counter[tuple[str, str]]] = {}
    for k, cands in zip(kernels, candidates, strict=True):
        if len(cands) == 1:
            votes.setdefault(k.stream, _Counter())[(cands[0].lane, cands[0].name)] += 1
    out: list[StageSpan | None] = []
    for k, cands in zip(kernels, candidates, strict=True):
        if len(cands) <= 1:
            out.append(cands[0] if cands else None)
            continue
        home = votes.get(k.stream, _Counter())
        out.append(
            min(
                cands,
                key=lambda s: (
                    -home[(s.lane, s.name)],
                    (s.lane == "copy") != (k.activity == "memcpy"),
                    s.end_ns - s.start_ns,
                ),
            )
        )
    return out


@dataclass(frozen=True)
class _Marker:
    """A clock marker: host-clock bracket ``[e0, e1]`` around a spin kernel."""

    begin: Any  # TimedEvent
    end: Any


class KernelWindow:
    """Owns one torch.profiler session over engine steps ``[first, end)`` and writes its kernels.

    The engine calls :meth:`before_schedule` with the number of the step it is about to schedule
    and :meth:`after_update` with the step it just retired; :meth:`observe_stage` receives every
    device stage slice the timeline emits; :meth:`close` finishes a window the run cut short.

    Args:
        tracer: where the kernel slices and the window's metadata go.
        device_index: the ``<i>`` of ``gpu:<i> kernels``.
        first / end: the half-open step window.
        event_factory: timing events on the host clock (the device timeline's).
        stream: the compute stream (where the clock markers run).
        enqueue_marker: enqueues a spin kernel of the given cycles on ``stream``.
        synchronize: waits for the device and emits every pending stage slice (through
            :meth:`observe_stage`); called only when the window stops.
    """

    def __init__(
        self,
        tracer: Tracer,
        device_index: int,
        first: int,
        end: int,
        event_factory: Callable[[], Any],
        stream: Any,
        enqueue_marker: Callable[[int], None],
        synchronize: Callable[[], None],
    ) -> None:
        if end <= first:
            raise ValueError(f"empty kernel window [{first}, {end})")
        self.tracer = tracer
        self.device_index = device_index
        self.first, self.end = first, end
        self._event_factory = event_factory
        self._stream = stream
        self._enqueue_marker = enqueue_marker
        self._synchronize = synchronize
        self._prof: Any = None
        self._markers: list[_Marker] = []
        self._stages: list[StageSpan] = []
        self.marker_brackets = ""  # "lo:hi,..." per marker, relative to the chosen offset
        self.state = "waiting"  # -> "recording" -> "done"
        self.num_written = 0
        tracer.metadata(**{CaptureArg.KERNEL_STEPS.value: f"{first}:{end}"})

    # ---- engine hooks -----------------------------------------------------------------------
    def before_schedule(self, next_step: int) -> None:
        """Start recording before step ``first`` is scheduled (and launched)."""
        if self.state == "waiting" and next_step >= self.first:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CUDA])
            self._prof.start()
            self._mark()
            self.state = "recording"

    def after_update(self, step: int) -> None:
        """Stop once step ``end - 1`` has been retired (its device work is done)."""
        if self.state == "recording" and step >= self.end - 1:
            self._finish()

    def observe_stage(self, lane: str, name: str, step: int, start_ns: int, end_ns: int) -> None:
        """A device stage slice just emitted by the timeline (host clock)."""
        if self.state == "recording":
            self._stages.append(StageSpan(lane, name, step, start_ns, end_ns))

    def close(self) -> None:
        """Finish a window the run ended inside (no-op when done or never started)."""
        if self.state == "recording":
            self._finish()
        self.state = "done"

    # ---- internals --------------------------------------------------------------------------
    def _mark(self) -> None:
        # A long spin first keeps the stream busy while the host records the bracket: the device
        # then reaches the begin event, the marker spin and the end event back to back, so the
        # bracket is a few µs wide. Without it an idle device reaches the begin event at once and
        # the marker only after its launch latency (brackets of ~80 µs on the H200).
        self._enqueue_marker(PRE_SPIN_CYCLES)
        begin, end = self._event_factory(), self._event_factory()
        begin.record(self._stream)
        self._enqueue_marker(MARKER_CYCLES)
        end.record(self._stream)
        self._markers.append(_Marker(begin, end))

    def _finish(self) -> None:
        from instrument.sync_detect import cold_region

        self._mark()
        with cold_region():  # the window's one intended sync, after its last step
            self._synchronize()
            self._prof.stop()
        self.state = "done"
        records = self._records()
        offset, error = self._offset(records)
        kernels = [
            KernelRecord(r.name, r.activity, r.stream, r.start_ns + offset, r.end_ns + offset)
            for r in records
            if r.name.find(MARKER_KERNEL) < 0
        ]
        self._write(kernels, offset, error)

    def _records(self) -> list[KernelRecord]:
        """Kernel / memcpy / memset records on the Kineto clock, in start order."""
        out = []
        for e in self._prof.profiler.kineto_results.events():
            kind = _event_kind(e)
            if kind is None:
                continue
            start = int(e.start_ns())
            out.append(
                KernelRecord(e.name(), kind, int(e.device_resource_id()), start, int(e.end_ns()))
            )
        out.sort(key=lambda r: r.start_ns)
        return out

    def _offset(self, records: list[KernelRecord]) -> tuple[int, int | None]:
        """Host minus Kineto clock, and a bound on its error (None: markers not found; then the
        realtime - monotonic difference read now, with no stated bound)."""
        # Each mark enqueues two spins: the pre-spin, then the marker (the second of each pair).
        spins = [r for r in records if r.name.find(MARKER_KERNEL) >= 0][1::2]
        if len(spins) != len(self._markers) or not spins:
            return time.monotonic_ns() - time.time_ns(), None
        intervals = []
        for m, k in zip(self._markers, spins, strict=True):
            lo, hi = m.begin.host_ns() - k.start_ns, m.end.host_ns() - k.end_ns
            intervals.append((lo, max(hi, lo)))
        offset, error = combine_brackets(intervals)
        # Each marker's bracket relative to the offset, for the metadata (diagnosis of the bound).
        self.marker_brackets = ",".join(f"{lo - offset}:{hi - offset}" for lo, hi in intervals)
        return offset, error

    def _write(self, kernels: list[KernelRecord], offset: int, error: int | None) -> None:
        track = device_track_name(self.device_index, DEVICE_KERNELS)
        stages = attribute_kernels(kernels, self._stages)
        outside = unattributed = 0
        for k, stage in zip(kernels, stages, strict=True):
            if stage is not None and not self.first <= stage.step < self.end:
                outside += 1
                continue
            args: dict[str, object] = {Arg.ACTIVITY.value: k.activity}
            if stage is None:
                unattributed += 1
                args[Arg.STAGE.value] = UNATTRIBUTED
            else:
                args[Arg.STAGE.value] = stage.name
                args[Arg.STEP.value] = stage.step
            self.tracer.slice_at(track, k.name, k.start_ns, max(k.end_ns, k.start_ns), **args)
            self.num_written += 1
        if outside:
            self.tracer.count_dropped("kernels_outside_window", outside)
        self.tracer.metadata(
            **{
                CaptureArg.KERNEL_STEPS.value: f"{self.first}:{self.end}",
                CaptureArg.KERNELS_WRITTEN.value: self.num_written,
                CaptureArg.KERNELS_UNATTRIBUTED.value: unattributed,
                CaptureArg.KERNEL_CLOCK_OFFSET_NS.value: offset,
                CaptureArg.KERNEL_CLOCK_ERROR_NS.value: -1 if error is None else error,
                "kernel_clock_marker_brackets_ns": self.marker_brackets,
            }
        )
