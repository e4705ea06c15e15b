"""The metric registry (analysis/metrics_registry.py) against real reports: one entry per
headline key and no other, the Headline record's JSON form, thresholds, compare's numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from analysis import HEADLINE_KEYS, Headline, analyze_trace
from analysis.metrics_registry import COMPARED, METRIC_BY_KEY, METRICS, metric

DATA = Path(__file__).resolve().parents[1] / "data"
TRACES = [
    DATA / "stepscope_small.pftrace",
    DATA / "kineto_gpu_small.json",
    DATA / "real/tracelens/h100/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz",
]


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name)
def test_every_headline_key_has_one_entry_and_vice_versa(path: Path) -> None:
    report = analyze_trace(path)
    out = report.to_dict(with_tables=False)
    keys = list(report.headline)
    assert keys == list(HEADLINE_KEYS) == [m.key for m in METRICS]
    assert len(METRIC_BY_KEY) == len(METRICS)  # no key twice
    # The JSON starts with exactly the headline keys, in order, with the record's values.
    assert list(out)[: len(keys)] == keys
    assert {k: out[k] for k in keys} == report.headline.to_dict()
    json.dumps(report.headline.to_dict(), allow_nan=False)  # JSON-ready: no NaN, no numpy
    for m in METRICS:
        assert m.label and m.definition and m.unit and m.section.startswith("§")


def test_headline_is_frozen_and_reads_like_a_mapping() -> None:
    h = analyze_trace(TRACES[0]).headline
    assert isinstance(h, Headline)
    with pytest.raises(AttributeError):
        h.overlap = 0.0  # type: ignore[misc]
    assert (
        h["overlap"] == h.overlap and h.get("no_such_key") is None and len(h) == len(HEADLINE_KEYS)
    )
    with pytest.raises(KeyError):
        h["no_such_key"]


@pytest.mark.parametrize(
    ("key", "value", "tone"),
    [
        ("overlap", 0.9, "good"),
        ("overlap", 0.8, "good"),  # thresholds are strict
        ("overlap", 0.6, "warn"),
        ("overlap", 0.4, "bad"),
        ("bubble_ratio", 0.01, "good"),
        ("bubble_ratio", 0.1, "warn"),
        ("bubble_ratio", 0.3, "bad"),
        ("hot_syncs", 0, "good"),
        ("hot_syncs", 2, "bad"),
        ("cpu_lead_us_p10", 40.0, "bad"),
        ("cpu_lead_us_p10", 100.0, "warn"),
        ("cpu_lead_us_p10", 900.0, "good"),
        ("top_blame", 1.0, ""),  # no direction: no tone
        ("overlap", None, ""),
    ],
)
def test_tones_follow_the_thresholds(key: str, value: float | None, tone: str) -> None:
    assert metric(key).tone_of(value) == tone


def test_relative_and_list_tones() -> None:
    """Exposed wait is judged as a share of the total; a list by its number of rows."""
    m = metric("wait_accepted_exposed_us")
    assert m.tone({"wait_accepted_exposed_us": 0.0, "wait_accepted_total_us": 0.0}) == "good"
    assert m.tone({"wait_accepted_exposed_us": 5.0, "wait_accepted_total_us": 100.0}) == "warn"
    assert m.tone({"wait_accepted_exposed_us": 50.0, "wait_accepted_total_us": 100.0}) == "bad"
    assert metric("silent_fallbacks").tone({"silent_fallbacks": []}) == "good"
    assert metric("silent_fallbacks").tone({"silent_fallbacks": [{"feature": "x"}]}) == "bad"


def test_compared_paths_resolve_in_a_report() -> None:
    """Every number compare takes a delta of exists in Report.to_dict() (a None leaf is fine)."""
    out = analyze_trace(TRACES[0]).to_dict(with_tables=False)
    for c in COMPARED:
        cur = out
        for part in c.path[:-1]:
            cur = cur[part]
        assert c.path[-1] in cur, c.name
        if c.path[0] in METRIC_BY_KEY:
            assert c.unit == metric(c.path[0]).unit
