"""JSON-ready values from numpy/pandas: scalars, nested containers and table rows."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["clean", "records"]


def clean(value: Any) -> Any:
    """``value`` with numpy scalars as Python ones and non-finite floats / ``pd.NA`` as None
    (dicts and sequences recursively; keys as strings)."""
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is pd.NA:
        return None
    return value


def _column(s: pd.Series) -> list[Any]:
    """JSON-ready values of one column: numeric numpy columns vectorised, the rest per value."""
    if isinstance(s.dtype, np.dtype) and s.dtype.kind in "iub":
        return s.to_numpy().tolist()
    if isinstance(s.dtype, np.dtype) and s.dtype.kind == "f":
        v = s.to_numpy()
        out = v.astype(object)
        out[~np.isfinite(v)] = None
        return out.tolist()
    return [clean(v) for v in s.astype(object).where(s.notna(), None).tolist()]


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """The rows of ``df`` as JSON-ready dicts (column name -> value)."""
    cols = {str(c): _column(df[c]) for c in df.columns}
    return [dict(zip(cols, row, strict=True)) for row in zip(*cols.values(), strict=True)]
