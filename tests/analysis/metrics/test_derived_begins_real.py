"""Derived device begins against recorded ones and against CUPTI, on a real H200 trace written
with ``--trace-begins both --trace-kernels 300:340`` (tests/data/real/stepscope_h200, README
there): the measurements behind the default ``--trace-begins derived`` (docs/design.md §4.3)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis import load_trace
from analysis.frames import ROLE_KERNEL
from instrument.schema import Arg, DeviceBegins

TRACE = (
    Path(__file__).resolve().parents[2]
    / "data"
    / "real"
    / "stepscope_h200"
    / "begins_both_kw_steps298-341.pftrace"
)
STAGES = ("h2d_inputs", "input_prep", "d2h_output")


@pytest.fixture(scope="module")
def frames():
    return load_trace(str(TRACE))


def _first_work(frames) -> pd.DataFrame:
    """Per derived stage slice in the kernel window: its recorded and derived begins and the
    start of the first CUPTI activity attributed to it (ns)."""
    s = frames.slices
    kernels = s[s["role"] == ROLE_KERNEL]
    first = kernels.groupby(["stage", "step"])["ts_ns"].min().rename("first_ns").reset_index()
    stages = s[(s["role"] != ROLE_KERNEL) & s["name"].isin(STAGES)]
    stages = stages[["name", "step", "ts_ns", "derived_begin_ns"]].rename(columns={"name": "stage"})
    return stages.merge(first, on=["stage", "step"])


def test_every_derived_begin_is_at_or_before_the_recorded_one(frames):
    assert frames.metadata[Arg.DEVICE_BEGINS.value] == DeviceBegins.BOTH.value
    s = frames.slices
    both = s[s["derived_begin_ns"].notna()]
    assert set(both["name"]) == set(STAGES) and len(both) > 100
    assert (both["derived_begin_ns"] <= both["ts_ns"]).all()


def test_derived_begins_against_the_first_device_work(frames):
    """Compute and output-copy stages: the derived begin is a few µs before the recorded one,
    which is itself ~2 µs before the first kernel or memcpy. Input copies: both begins are
    ~100 µs and more before the first copy, the derived one ~30 µs earlier still."""
    work = _first_work(frames)
    error_ns = int(frames.metadata["kernel_clock_error_ns"])
    assert error_ns < 2_000 and len(work) >= 3 * 35
    after_recorded_us = (work["first_ns"] - work["ts_ns"]) / 1e3
    after_derived_us = (work["first_ns"] - work["derived_begin_ns"]) / 1e3
    # A begin never follows the work it brackets (up to the kernel clock's error bound).
    assert (after_derived_us > -error_ns / 1e3).all() and (
        after_recorded_us > -error_ns / 1e3
    ).all()
    p50 = pd.DataFrame({"rec": after_recorded_us, "der": after_derived_us, "stage": work["stage"]})
    p50 = p50.groupby("stage").median()
    for stage in ("input_prep", "d2h_output"):
        assert p50.loc[stage, "rec"] < 5 and p50.loc[stage, "der"] < 10, p50
    assert p50.loc["h2d_inputs", "rec"] > 100 and p50.loc["h2d_inputs", "der"] > 130, p50
    extra = p50["der"] - p50["rec"]
    assert np.allclose(extra.loc[["input_prep", "d2h_output"]], [1.3, 4.8], atol=0.5), extra


def test_the_starvation_estimate_holds_with_derived_begins(frames):
    """The kernel-window check (stage slices alone against CUPTI's kernel union, steps 300..339)
    with the trace's recorded begins, and again with every derived stage's begin put in their
    place (what a default ``--trace-begins derived`` trace holds): both within the tolerance,
    and within 0.001 of each other."""
    import dataclasses

    from bench.bench_kernel_window import TOLERANCE, compare_window

    steps = str(frames.metadata["capture_kernel_steps"])
    slices = frames.slices.copy()
    derived = slices["derived_begin_ns"].notna()
    slices.loc[derived, "ts_ns"] = slices.loc[derived, "derived_begin_ns"].astype("int64")
    slices.loc[derived, "dur_ns"] = slices.loc[derived, "end_ns"] - slices.loc[derived, "ts_ns"]
    rows = [
        {r["phase"]: r for r in compare_window(f, steps)}
        for f in (frames, dataclasses.replace(frames, slices=slices))
    ]
    for by_phase in rows:
        assert set(by_phase) == {"decode_only"}
        assert abs(by_phase["decode_only"]["error"]) <= TOLERANCE
    recorded, with_derived = (r["decode_only"] for r in rows)
    for key in ("bubble_ratio_slices", "bubble_ratio_starvation_aware"):
        assert with_derived[key] == pytest.approx(recorded[key], abs=0.001), key
    assert with_derived["bubble_ratio_slices"] <= recorded["bubble_ratio_slices"]  # longer slices
