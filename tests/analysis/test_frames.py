"""Frame contracts: the text columns of slices/instants are categories holding the right strings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis import load_trace
from analysis.frames import (
    INSTANT_COLUMNS,
    SLICE_COLUMNS,
    categorical_from_codes,
    categorize,
    empty_frame,
)

DATA = Path(__file__).resolve().parents[1] / "data"
SLICE_TEXT = ("track", "role", "name", "raw_name", "kind")
INSTANT_TEXT = ("track", "scope", "name")


def _assert_tidy_category(col: pd.Series) -> None:
    assert isinstance(col.dtype, pd.CategoricalDtype), col.name
    cats = list(col.cat.categories)
    assert cats == sorted(cats), col.name  # sorting by the column sorts by the string
    assert set(cats) == set(col.tolist()), col.name  # no unused categories


@pytest.mark.parametrize(
    ("name", "profile"),
    [
        ("stepscope_small.pftrace", None),
        ("stepscope_small.pftrace", "vllm"),  # a renaming profile on a Perfetto trace
        ("kineto_gpu_small.json", None),
        ("torch_cpu_small.json", "vllm"),
    ],
)
def test_text_columns_are_categories_with_the_right_values(name: str, profile: str | None) -> None:
    frames = load_trace(DATA / name, profile)
    slices, tracks = frames.slices, frames.tracks
    for col in SLICE_TEXT:
        _assert_tidy_category(slices[col])
    for col in INSTANT_TEXT:
        if len(frames.instants):
            _assert_tidy_category(frames.instants[col])
    # Reference: the track frame's own (plain) names and roles, looked up by track_id.
    by_id = tracks.set_index("track_id")
    tid = slices["track_id"].to_numpy()
    assert slices["track"].tolist() == by_id.loc[tid, "name"].tolist()
    if name.endswith(".pftrace"):  # Perfetto roles are per track (Kineto's per event category)
        assert slices["role"].tolist() == by_id.loc[tid, "role"].tolist()
    if profile is None and name.endswith(".pftrace"):  # the stepscope profile renames nothing
        assert slices["name"].tolist() == slices["raw_name"].tolist()


def test_empty_frames_keep_the_contract_dtypes() -> None:
    for columns in (SLICE_COLUMNS, INSTANT_COLUMNS):
        df = empty_frame(columns)
        assert list(df.columns) == list(columns)
        for col, dtype in columns.items():
            assert str(df[col].dtype) == dtype, col


def test_categorical_from_codes_matches_plain_lookup() -> None:
    labels = ["b", "a", "b", "", "c", "unused"]  # repeated and unused labels
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 5, size=1000)
    got = categorical_from_codes(codes, labels)
    assert got.tolist() == np.asarray(labels, dtype=object)[codes].tolist()
    assert list(got.categories) == ["", "a", "b", "c"]


def test_categorize_is_idempotent_and_keeps_values() -> None:
    df = pd.DataFrame({"name": ["x", "y", "x"], "other": ["p", "q", "r"]})
    categorize(df)
    categorize(df)
    assert isinstance(df["name"].dtype, pd.CategoricalDtype)
    assert not isinstance(df["other"].dtype, pd.CategoricalDtype)
    assert df["name"].tolist() == ["x", "y", "x"]
