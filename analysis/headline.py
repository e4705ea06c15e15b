"""The headline of one trace's report: a frozen, typed record (docs/design.md §5.11).

Every field is a headline key of ``stepscope analyze --json``, in the JSON's order; its label,
unit, definition and thresholds live in ``analysis.metrics_registry`` (one entry per field).
The record reads like a mapping (``headline["overlap"]``, ``set(headline)``, ``.get``) so that
code written against the former ``dict`` keeps working; ``to_dict()`` is the JSON form.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["Headline", "HEADLINE_KEYS"]


@dataclass(frozen=True, eq=False)
class Headline(Mapping[str, Any]):
    """The headline numbers, by their fixed names (JSON-ready values: no numpy scalars, no NaN).

    Nested values (``bubbles``, ``top_blame``, ``window``, percentiles, rows) are plain dicts and
    lists as they appear in the JSON; the record itself cannot be rebound field by field.
    """

    overlap: float | None  # §5.3
    bubble_ratio: float | None  # §5.4
    device_idle_ratio: float | None  # §5.14.4
    bubbles: dict[str, Any]  # count, idle_ms, largest
    top_blame: dict[str, Any] | None  # label, share, idle_ms
    wait_accepted_total_us: float  # §5.5
    wait_accepted_exposed_us: float
    wait_accepted_hidden_us: float
    grammar_mask_ms: float  # §5.6
    grammar_hidden_frac: float | None
    grammar_wait_total_us: float
    grammar_wait_exposed_us: float
    grammar_overlap_steps_frac: float | None
    silent_fallbacks: list[dict[str, Any]]  # §5.7
    ineffective: list[dict[str, Any]]
    hot_syncs: int  # §5.8
    ttft_ms: dict[str, Any]  # §5.9: p50, p95, p99, mean, count
    tpot_ms: dict[str, Any]
    window: dict[str, Any]  # §5.2
    cpu_lead_us_p50: float | None  # §5.14.1
    cpu_lead_us_p10: float | None
    starved_steps_frac: float | None  # §5.14.2
    busy_source: str  # kernels, stage_slices or kernels_and_stage_slices
    bubble_ratio_bound: str  # measured or lower_bound
    bubble_ratio_starvation_aware: float | None

    def __getitem__(self, key: str) -> Any:
        if key not in _KEY_SET:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(HEADLINE_KEYS)

    def __len__(self) -> int:
        return len(HEADLINE_KEYS)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: every key in ``HEADLINE_KEYS`` order."""
        return {k: getattr(self, k) for k in HEADLINE_KEYS}


HEADLINE_KEYS: tuple[str, ...] = tuple(f.name for f in fields(Headline))
_KEY_SET = frozenset(HEADLINE_KEYS)
