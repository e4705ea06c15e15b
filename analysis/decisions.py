"""Feature decisions: silent fallbacks and "enabled but ineffective" (docs/design.md §5.7)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.derive import parse_requested
from analysis.frames import DECISION_COLUMNS, require_columns

__all__ = ["silent_fallbacks", "ineffective_features", "async_enabled"]

SILENT_COLUMNS = {**DECISION_COLUMNS, "why": "object"}
INEFFECTIVE_COLUMNS = {
    "feature": "object",
    "overlap": "float64",
    "threshold": "float64",
    "top_blocker": "object",
}


def silent_fallbacks(decisions: pd.DataFrame) -> pd.DataFrame:
    """Decisions that turned a feature off without the user choosing it.

    * requested True, resolved False, no reason (should have been a start-up error);
    * requested None (auto), resolved False, and the producer did not mark the reason as shown
      to the user (``shown``): the user never saw why.
    Columns: DECISION_COLUMNS plus ``why`` (one sentence).
    """
    require_columns(decisions, DECISION_COLUMNS, "silent_fallbacks")
    req = decisions["requested"].to_numpy(object)
    off = ~decisions["resolved"].to_numpy(bool)
    no_reason = decisions["reason"].fillna("").astype(str).str.strip().to_numpy(object) == ""
    explicit = np.array([r is True for r in req], dtype=bool) & off & no_reason
    unseen = ~decisions["shown"].to_numpy(bool)
    auto = np.array([r is None for r in req], dtype=bool) & off & unseen
    out = decisions[explicit | auto].copy()
    out["why"] = np.where(
        explicit[explicit | auto],
        "requested on but resolved off with no reason",
        "auto-resolved off: " + out["reason"].fillna("").astype(str).replace("", "no reason given"),
    )
    return out.reset_index(drop=True).astype(SILENT_COLUMNS)


def async_enabled(
    decisions: pd.DataFrame, config: dict[str, object], features: tuple[str, ...]
) -> str | None:
    """The name of the async-scheduling feature when it resolved on (decision or config), else None."""
    mine = decisions[decisions["feature"].isin(features)]
    if len(mine):
        on = mine[mine["resolved"]]
        return str(on["feature"].iloc[0]) if len(on) else None
    for key in features:
        if parse_requested(config.get(key)):
            return key
    return None


def ineffective_features(
    decisions: pd.DataFrame,
    config: dict[str, object],
    overlap: float,
    top_blocker: str,
    threshold: float,
    features: tuple[str, ...],
) -> pd.DataFrame:
    """Async scheduling resolved on, yet overlap below ``threshold``.

    Columns: ``feature``, ``overlap``, ``threshold``, ``top_blocker`` (the top bubble blame).
    """
    require_columns(decisions, DECISION_COLUMNS, "ineffective_features")
    feature = async_enabled(decisions, config, features)
    rows = []
    if feature is not None and np.isfinite(overlap) and overlap < threshold:
        rows.append(
            {
                "feature": feature,
                "overlap": overlap,
                "threshold": threshold,
                "top_blocker": top_blocker,
            }
        )
    return pd.DataFrame(rows, columns=list(INEFFECTIVE_COLUMNS)).astype(INEFFECTIVE_COLUMNS)
