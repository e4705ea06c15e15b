"""The one validation layer for request fields: vLLM's types and ranges, errors that name the field.

``SamplingParams`` and workload requests check every field through these helpers, so the API,
JSONL and ShareGPT loaders refuse the same values with the same words. A :class:`FieldError`
carries the field's name; the workload loader prefixes ``file:line``. NaN and infinities are
refused everywhere (a NaN arrival time never arrives, a NaN temperature samples garbage).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "FieldError",
    "check_bool",
    "check_int",
    "check_number",
    "check_str_list",
    "check_token_ids",
]


class FieldError(ValueError):
    """A field with a value of the wrong type or out of range: ``field: problem``."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise FieldError(field, f"expected true or false, got {_shown(value)}")
    return value


def check_int(
    field: str, value: Any, lo: int | None = None, hi: int | None = None, what: str = ""
) -> int:
    """An integer (not a bool, not 2.5, not "3") within ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(field, f"expected an integer, got {_shown(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise FieldError(field, f"must be {what or _range(lo, hi)}, got {value}")
    return value


def check_number(
    field: str,
    value: Any,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    what: str = "",
) -> float:
    """A finite number (int or float, not bool) within ``[lo, hi]`` (``(lo, hi]`` if lo_open)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FieldError(field, f"expected a number, got {_shown(value)}")
    if not math.isfinite(value):
        raise FieldError(field, f"must be a finite number, got {value}")
    below = lo is not None and (value <= lo if lo_open else value < lo)
    if below or (hi is not None and value > hi):
        bounds = what or _range(lo, hi, lo_open)
        raise FieldError(field, f"must be {bounds}, got {value}")
    return float(value)


def _range(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo:g}"
    return f"<= {hi:g}"


def check_str_list(field: str, value: Any) -> tuple[str, ...]:
    """A string or a list of non-empty strings (vLLM's ``stop``)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(s, str) for s in items):
        raise FieldError(field, f"expected a string or a list of strings, got {_shown(value)}")
    if any(not s for s in items):
        raise FieldError(field, "stop strings must not be empty")
    return tuple(items)


def check_token_ids(field: str, value: Any, allow_empty: bool = True) -> tuple[int, ...]:
    """A list of token ids (integers >= 0)."""
    if not isinstance(value, list | tuple):
        raise FieldError(field, f"expected a list of token ids, got {_shown(value)}")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise FieldError(field, f"token ids must be integers >= 0, got {_shown(t)}")
    if not value and not allow_empty:
        raise FieldError(field, "is empty")
    return tuple(value)
