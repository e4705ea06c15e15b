"""Silent fallback = off without the user having been told why (table-driven)."""

from __future__ import annotations

import pandas as pd
import pytest

from analysis.decisions import silent_fallbacks
from analysis.derive import parse_requested


@pytest.mark.parametrize(
    ("requested", "resolved", "reason", "shown", "silent"),
    [
        (None, False, "auto: off, no CUDA device", False, True),  # auto off, never shown
        (None, False, "auto: off, no CUDA device", True, False),  # auto off, shown at start-up
        (True, False, "", True, True),  # explicit on, resolved off with no reason
        (True, False, "capture failed", False, False),  # explicit, with a reason
        (None, True, "auto: on", False, False),  # on: not a fallback
        (False, False, "off as requested", False, False),
    ],
)
def test_silent_rule(requested, resolved, reason, shown, silent):
    frame = pd.DataFrame(
        {
            "feature": ["cuda_graphs"],
            "requested": [requested],
            "resolved": [resolved],
            "reason": [reason],
            "shown": [shown],
            "ts_ns": [1],
        }
    ).astype({"requested": object})
    assert len(silent_fallbacks(frame)) == int(silent)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, True),
        ("False", False),
        ("auto", None),
        (None, None),
        ("None", None),
        ("ngram", True),  # spec_method names its choice: requested and resolved on
        ("none", None),  # spec_method requested nothing (not a request for "off")
        ("off", False),
    ],
)
def test_parse_requested_reads_choices(value: object, expected: bool | None) -> None:
    assert parse_requested(value) is expected
