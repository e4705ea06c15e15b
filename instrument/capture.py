"""Capture control: which engine steps reach the trace file, and an exact count of the rest.

Rules 1-3 below depend only on the step number (:class:`StepRule`, integer arithmetic). They are
applied twice, with the same arithmetic:

* on the engine thread, once per step, when the step is about to be scheduled
  (``Tracer.trace_step``): a step they drop is not traced at all (the tracer is paused around
  its phases, so it costs what an untraced step costs) and is counted there
  (``engine_skipped_steps_<reason>``; its events were never made, so no event count exists;
  docs/design.md §4.9, "Sampled traces on the engine thread");
* on the flush thread / writer process, for every event that does reach it (the
  :class:`CaptureGate`, cached per step): producers other than the engine, and engines that trace
  every step (tensor parallel, kernel windows), are gated there as before.

An event's step is its ``step`` argument; events without one (counters, ``sync``
instants, request slices) belong to the step of the latest CPU slice that carried one. Request
slices are written when the request finishes but span many steps, so rules 1-3 never drop them
(a request finishing in a warm-up step keeps its track; only the size budget applies).
Process-scoped instants (``trace_metadata``, ``engine_config``, ``feature_decision``) are always
kept.

Rules, in order (the first that drops a step names the reason):

1. ``warmup``: steps ``0 .. warmup_steps-1`` unless ``include_warmup``;
2. ``range``: steps outside ``[first, end)`` of ``--trace-steps A:B``;
3. ``sampled``: with ``every = N > 1``, steps are kept in runs of ``R = run_length`` consecutive
   steps, one run in N: step ``s`` is kept when ``((s - s0) // R) % N == 0``, where ``s0`` is the
   first step the two rules above keep. Runs, not single steps: overlap and bubbles need
   consecutive steps (with the batch queue of depth 2, step N's scheduling overlaps step N-1's
   device work, and a bubble sits between two steps), so a lone kept step has neither a
   predecessor nor a successor to measure against. With R = 16 (the default) only the first
   step of a run lacks its predecessor (< 1/16 of the kept steps), and each kept step keeps all
   its events, device slices included (they carry its ``step``);
4. ``size`` (mode ``stop``): once the file holds ``max_bytes``, every step first seen afterwards.
   Steps already admitted keep their late events (device slices arrive a step or two later), so
   the file may pass the budget by those few events and the closing metadata.

Mode ``ring`` keeps the most recent steps instead of rule 4 (see ``instrument.ring_output``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from instrument.schema import CaptureArg

__all__ = [
    "CaptureConfig",
    "CaptureGate",
    "StepRule",
    "parse_step_range",
    "MODES",
    "DEFAULT_RUN_LENGTH",
    "STEP_REASONS",
]

MODES = ("stop", "ring")
_MIN_MAX_BYTES = 64 * 1024
DEFAULT_RUN_LENGTH = 16
REASONS = ("warmup", "range", "sampled", "size")
STEP_REASONS = REASONS[:3]  # the rules that depend only on the step number (1-3)


def parse_step_range(text: str) -> tuple[int, int | None]:
    """``"A:B"`` -> ``(A, B)`` (half-open, like a Python slice); ``"A:"`` -> ``(A, None)``,
    ``":B"`` -> ``(0, B)``. Raises ``ValueError`` with the reason."""
    head, sep, tail = text.partition(":")
    if not sep:
        raise ValueError(f"expected A:B (half-open step range), got {text!r}")
    try:
        first = int(head) if head.strip() else 0
        end = int(tail) if tail.strip() else None
    except ValueError:
        raise ValueError(f"step range bounds must be integers, got {text!r}") from None
    if first < 0 or (end is not None and end <= first):
        raise ValueError(f"step range {text!r} is empty or negative")
    return first, end


@dataclass(frozen=True)
class CaptureConfig:
    """What to capture. The default keeps everything (no warm-up excluded).

    Args:
        first_step / end_step: half-open step range ``[first_step, end_step)``; ``end_step``
            None = no end.
        every: keep one step in ``every`` (1 = all), in runs of ``run_length`` consecutive steps.
        max_bytes: file size budget; None = unbounded.
        mode: ``stop`` (stop capturing steps at the budget) or ``ring`` (keep the most recent).
        warmup_steps: how many first steps count as warm-up.
        include_warmup: keep the warm-up steps anyway.
        run_length: consecutive steps per kept run when ``every > 1``.
    """

    first_step: int = 0
    end_step: int | None = None
    every: int = 1
    max_bytes: int | None = None
    mode: str = "stop"
    warmup_steps: int = 0
    include_warmup: bool = False
    run_length: int = DEFAULT_RUN_LENGTH

    def __post_init__(self) -> None:
        if self.first_step < 0:
            raise ValueError(f"first_step must be >= 0, got {self.first_step}")
        if self.end_step is not None and self.end_step <= self.first_step:
            raise ValueError(f"empty step range [{self.first_step}, {self.end_step})")
        if self.every < 1:
            raise ValueError(f"every must be >= 1, got {self.every}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.max_bytes is not None and self.max_bytes < _MIN_MAX_BYTES:
            raise ValueError(f"max_bytes must be >= {_MIN_MAX_BYTES}, got {self.max_bytes}")
        if self.mode == "ring" and self.max_bytes is None:
            raise ValueError("mode 'ring' needs max_bytes (the ring's size)")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.run_length < 1:
            raise ValueError(f"run_length must be >= 1, got {self.run_length}")

    @property
    def ring_bytes(self) -> int | None:
        """The ring's total size (``max_bytes`` in ring mode), else None."""
        return self.max_bytes if self.mode == "ring" else None

    def describe(self) -> dict[str, object]:
        """The settings as ``trace_metadata`` args (names from ``schema.CaptureArg``)."""
        end = "" if self.end_step is None else str(self.end_step)
        return {
            CaptureArg.STEPS.value: f"{self.first_step}:{end}",
            CaptureArg.EVERY.value: self.every,
            CaptureArg.MAX_BYTES.value: self.max_bytes or 0,
            CaptureArg.MODE.value: self.mode,
            CaptureArg.WARMUP_STEPS.value: 0 if self.include_warmup else self.warmup_steps,
            CaptureArg.RUN_LENGTH.value: self.run_length if self.every > 1 else 0,
        }


_NEVER = 1 << 62  # a step no run reaches: "holds for every later step"


class StepRule:
    """Rules 1-3 of one :class:`CaptureConfig`: ``reason(step)`` is the rule that drops the step
    (``"warmup"``, ``"range"``, ``"sampled"``) or None. Integer arithmetic on the step number and
    one remembered step (``s0``, the first step rules 1-2 keep, set by the first such step asked
    about: ask in step order). The only state besides is the latest answer and the steps
    ``[lo, hi)`` it holds for (a warm-up, a range edge, or a run of ``run_length`` steps), so
    most steps are one comparison; nothing grows per step, and the engine thread asks once per
    step for as long as it runs."""

    __slots__ = ("_warmup_end", "_first", "_end", "_every", "_run_length", "first_kept",
                 "_lo", "_hi", "_reason")  # fmt: skip

    def __init__(self, config: CaptureConfig) -> None:
        self._warmup_end = 0 if config.include_warmup else config.warmup_steps
        self._first = config.first_step
        self._end = config.end_step
        self._every = config.every
        self._run_length = config.run_length
        self.first_kept: int | None = None  # s0
        self._lo = self._hi = 0  # no answer yet
        self._reason: str | None = None

    @property
    def drops_any(self) -> bool:
        """True when some step can be dropped by rules 1-3."""
        return bool(self._warmup_end or self._first or self._end is not None or self._every > 1)

    @property
    def settled(self) -> bool:
        """The latest answer keeps every later step too (past the warm-up and the range's start,
        no range end, no sampling): asking again is pointless."""
        return self._reason is None and self._hi >= _NEVER

    def reason(self, step: int) -> str | None:
        if self._lo <= step < self._hi:
            return self._reason
        reason, self._hi = self._decide(step)
        self._lo, self._reason = step, reason
        return reason

    def _decide(self, step: int) -> tuple[str | None, int]:
        """The reason for ``step`` and the first later step it may not hold for."""
        end = self._end
        never = _NEVER
        if step < self._warmup_end:
            return "warmup", self._warmup_end
        if step < self._first:
            return "range", self._first
        if end is not None and step >= end:
            return "range", never
        stop = never if end is None else end  # the range's end: where the answer changes
        if self._every == 1:
            return None, stop
        s0 = self.first_kept
        if s0 is None:
            s0 = self.first_kept = step
        run = (step - s0) // self._run_length
        reason = "sampled" if run % self._every else None
        return reason, min(s0 + (run + 1) * self._run_length, stop)


@dataclass
class CaptureGate:
    """Applies a :class:`CaptureConfig` step by step and counts what it drops (exactly).

    Used by the writer only (one thread); the engine thread's own use of rules 1-3 is counted
    in through :meth:`skipped` at close. ``static(step)`` applies rules 1–3; ``admit(step,
    size)`` applies rule 4 at encode time; ``admitted`` holds the steps written so far.
    """

    config: CaptureConfig = field(default_factory=CaptureConfig)
    _static: dict[int, str | None] = field(default_factory=dict)
    admitted: set[int] = field(default_factory=set)
    _stopped: bool = False
    dropped_steps: dict[str, set[int]] = field(default_factory=lambda: {r: set() for r in REASONS})
    dropped_events: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    # Steps the engine thread skipped whole (rules 1-3 there: no event of theirs reaches this
    # gate), per reason, and the thread instants raised meanwhile; told at close (``skipped``).
    engine_skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEP_REASONS, 0))
    engine_skipped_instants: int = 0

    def __post_init__(self) -> None:
        self._rule = StepRule(self.config)

    @property
    def passes_all(self) -> bool:
        """True when no rule can drop anything (the writer may skip the gate)."""
        c = self.config
        no_warmup = c.include_warmup or c.warmup_steps == 0
        return (
            no_warmup
            and c.first_step == 0
            and c.end_step is None
            and c.every == 1
            and (c.max_bytes is None or c.mode == "ring")
        )

    def static(self, step: int) -> str | None:
        """Reason rules 1–3 drop ``step`` (None: kept so far). Cached per step."""
        try:
            return self._static[step]
        except KeyError:
            pass
        reason = self._rule.reason(step)
        self._static[step] = reason
        if reason is not None:
            self.dropped_steps[reason].add(step)
        return reason

    def admit(self, step: int, size: int) -> bool:
        """Rule 4 for a statically kept step, with the file at ``size`` bytes."""
        if step in self.admitted:
            return True
        c = self.config
        if self._stopped or (c.mode == "stop" and c.max_bytes is not None and size >= c.max_bytes):
            self._stopped = True
            self.dropped_steps["size"].add(step)
            return False
        self.admitted.add(step)
        return True

    def drop(self, reason: str, n: int = 1) -> None:
        """Count ``n`` events dropped for ``reason``."""
        self.dropped_events[reason] += n

    def skipped(self, steps: dict[str, int], instants: int = 0) -> None:
        """Add the steps the engine thread skipped whole, per reason of rules 1-3, and the thread
        instants it did not write meanwhile (``Tracer.trace_step``). Those steps never reach this
        gate (none of their events was made), so they are counted once."""
        for reason, n in steps.items():
            if reason not in self.engine_skipped:
                raise ValueError(f"unknown skip reason {reason!r}")
            self.engine_skipped[reason] += n
        self.engine_skipped_instants += instants

    @property
    def steps_seen(self) -> int:
        """Steps this gate saw plus those the engine skipped (disjoint sets)."""
        return len(self._static) + sum(self.engine_skipped.values())

    def counts(self) -> dict[str, int]:
        """``trace_metadata`` args: steps seen/kept and dropped steps/events per reason; of the
        dropped steps, those the engine skipped (``engine_skipped_steps_<reason>``: their events
        were never made, so ``dropped_events_<reason>`` does not count them), and the thread
        instants not written meanwhile."""
        out: dict[str, int] = {
            CaptureArg.STEPS_SEEN.value: self.steps_seen,
            CaptureArg.STEPS_KEPT.value: len(self.admitted),
        }
        for reason in REASONS:
            skipped = self.engine_skipped.get(reason, 0)
            out[f"{CaptureArg.DROPPED_STEPS_PREFIX.value}{reason}"] = (
                len(self.dropped_steps[reason]) + skipped
            )
            out[f"{CaptureArg.DROPPED_EVENTS_PREFIX.value}{reason}"] = self.dropped_events[reason]
            if reason in self.engine_skipped:
                out[f"{CaptureArg.ENGINE_SKIPPED_STEPS_PREFIX.value}{reason}"] = skipped
        out[CaptureArg.ENGINE_SKIPPED_INSTANTS.value] = self.engine_skipped_instants
        return out
