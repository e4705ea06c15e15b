"""Capture control: which engine steps reach the trace file, and an exact count of the rest.

Every decision is made once per step (cached), off the hot path: the tracer's hot path appends
every event as usual and the flush thread asks the :class:`CaptureGate` whether the event's step
is kept. An event's step is its ``step`` argument; events without one (counters, ``sync``
instants, request slices) belong to the step of the latest CPU slice that carried one. Request
slices are written when the request finishes but span many steps, so rules 1-3 never drop them
(a request finishing in a warm-up step keeps its track; only the size budget applies).
Process-scoped instants (``trace_metadata``, ``engine_config``, ``feature_decision``) are always
kept.

Rules, in order (the first that drops a step names the reason):

1. ``warmup``: steps ``0 .. warmup_steps-1`` unless ``include_warmup``;
2. ``range``: steps outside ``[first, end)`` of ``--trace-steps A:B``;
3. ``sampled``: with ``every = N``, only steps ``s`` with ``(s - s0) % N == 0`` are kept, where
   ``s0`` is the first step the two rules above keep;
4. ``size`` (mode ``stop``): once the file holds ``max_bytes``, every step first seen afterwards.
   Steps already admitted keep their late events (device slices arrive a step or two later), so
   the file may pass the budget by those few events and the closing metadata.

Mode ``ring`` keeps the most recent steps instead of rule 4 (see ``instrument.ring_output``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from instrument.schema import CaptureArg

__all__ = ["CaptureConfig", "CaptureGate", "parse_step_range", "MODES"]

MODES = ("stop", "ring")
_MIN_MAX_BYTES = 64 * 1024
REASONS = ("warmup", "range", "sampled", "size")


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
        every: keep one step in ``every`` (1 = all).
        max_bytes: file size budget; None = unbounded.
        mode: ``stop`` (stop capturing steps at the budget) or ``ring`` (keep the most recent).
        warmup_steps: how many first steps count as warm-up.
        include_warmup: keep the warm-up steps anyway.
    """

    first_step: int = 0
    end_step: int | None = None
    every: int = 1
    max_bytes: int | None = None
    mode: str = "stop"
    warmup_steps: int = 0
    include_warmup: bool = False

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
        }


@dataclass
class CaptureGate:
    """Applies a :class:`CaptureConfig` step by step and counts what it drops (exactly).

    Used by the writer only (one thread). ``static(step)`` applies rules 1–3; ``admit(step,
    size)`` applies rule 4 at encode time; ``admitted`` holds the steps written so far.
    """

    config: CaptureConfig = field(default_factory=CaptureConfig)
    _static: dict[int, str | None] = field(default_factory=dict)
    admitted: set[int] = field(default_factory=set)
    _first_kept: int | None = None
    _stopped: bool = False
    dropped_steps: dict[str, set[int]] = field(default_factory=lambda: {r: set() for r in REASONS})
    dropped_events: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))

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
        c = self.config
        reason: str | None = None
        if step < c.warmup_steps and not c.include_warmup:
            reason = "warmup"
        elif step < c.first_step or (c.end_step is not None and step >= c.end_step):
            reason = "range"
        elif c.every > 1:
            if self._first_kept is None:
                self._first_kept = step
            if (step - self._first_kept) % c.every:
                reason = "sampled"
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

    @property
    def steps_seen(self) -> int:
        return len(self._static)

    def counts(self) -> dict[str, int]:
        """``trace_metadata`` args: steps seen/kept and dropped steps/events per reason."""
        out: dict[str, int] = {
            CaptureArg.STEPS_SEEN.value: self.steps_seen,
            CaptureArg.STEPS_KEPT.value: len(self.admitted),
        }
        for reason in REASONS:
            out[f"{CaptureArg.DROPPED_STEPS_PREFIX.value}{reason}"] = len(
                self.dropped_steps[reason]
            )
            out[f"{CaptureArg.DROPPED_EVENTS_PREFIX.value}{reason}"] = self.dropped_events[reason]
        return out
