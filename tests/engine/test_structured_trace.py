"""An async structured run's trace shows deferred sampling: ``grammar_mask`` and
``wait_output(kind=grammar)`` slices, and forward N+1 starting before the grammar work of N ends."""

from __future__ import annotations

import pandas as pd
import pytest

pytest.importorskip("xgrammar")

from analysis import load_trace  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from instrument.capture import CaptureConfig  # noqa: E402
from instrument.schema import CpuSlice, DeviceSlice, WaitKind  # noqa: E402
from instrument.tracer import Tracer  # noqa: E402
from tests.engine.test_structured_engine import ENGINE, SCHEMA, build_checkpoint  # noqa: E402


def _trace(tmp_path, async_on: bool, capture: CaptureConfig | None = None) -> pd.DataFrame:
    checkpoint = build_checkpoint(tmp_path / "ckpt")
    path = str(tmp_path / f"structured_{async_on}_{capture is not None}.pftrace")
    tracer = Tracer(path, capture=capture)
    llm = LLM(model=checkpoint, tracer=tracer, async_scheduling=async_on, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    structured = [{"json_schema": SCHEMA}, {"choice": ["yes", "no"]}, None]
    outs = llm.generate(["{", "answer:", "def"], params, structured=structured)
    llm.close()
    tracer.close()
    assert [o.finish_reason for o in outs] == ["stop", "stop", "length"]
    return load_trace(path).slices


def test_async_trace_shows_forward_n1_under_grammar_work_of_n(tmp_path) -> None:
    slices = _trace(tmp_path, async_on=True)
    masks = slices[slices["name"] == CpuSlice.GRAMMAR_MASK.value]
    waits = slices[slices["name"] == CpuSlice.WAIT_OUTPUT.value]
    grammar_waits = waits[waits["kind"] == WaitKind.GRAMMAR.value]
    assert len(masks) > 5 and len(grammar_waits) > 5
    launches = slices[slices["name"] == CpuSlice.LAUNCH.value].groupby("step")["end_ns"].min()
    samples = slices[slices["name"] == DeviceSlice.SAMPLE.value].set_index("step")["ts_ns"]
    # The device's forward half of a step: input prep then forward (CPU: input prep alone takes
    # milliseconds here; on a GPU it is microseconds and the forward itself is what overlaps).
    halves = slices[slices["name"].isin([DeviceSlice.INPUT_PREP.value, DeviceSlice.FORWARD.value])]
    forward_half_start = halves.groupby("step")["ts_ns"].min()
    overlapped, unmasked = 0, 0
    for _, wait in grammar_waits.iterrows():
        nxt = int(wait["step"]) + 1
        # forward N+1 was enqueued before the host waited on output N ...
        assert launches[nxt] <= wait["ts_ns"], nxt
        mask = masks[masks["step"] == nxt]
        if mask.empty:  # its structured requests finished in update N: sampled unmasked
            unmasked += 1
            continue
        assert len(mask) == 1, nxt
        mask_end = mask["end_ns"].iloc[0]
        # ... the mask of N+1 was built only once output N was back, sampling N+1 waited for it
        assert mask["ts_ns"].iloc[0] >= wait["end_ns"] and samples[nxt] >= mask_end, nxt
        # ... and the device was already running step N+1 while the host did the grammar work
        overlapped += int(forward_half_start[nxt] < mask_end)
    assert unmasked <= 2
    assert overlapped >= 0.8 * (len(grammar_waits) - unmasked), (overlapped, len(grammar_waits))


def test_sync_trace_masks_before_launch_and_never_waits_for_grammar(tmp_path) -> None:
    slices = _trace(tmp_path, async_on=False)
    masks = slices[slices["name"] == CpuSlice.GRAMMAR_MASK.value]
    waits = slices[slices["name"] == CpuSlice.WAIT_OUTPUT.value]
    assert len(masks) > 5
    assert not (waits["kind"] == WaitKind.GRAMMAR.value).any()
    forwards = slices[slices["name"] == DeviceSlice.FORWARD.value].set_index("step")
    for _, mask in masks.iterrows():  # synchronous: the mask exists before its forward starts
        assert forwards.loc[int(mask["step"]), "ts_ns"] >= mask["end_ns"]


def test_sampled_async_trace_keeps_deferred_steps_whole(tmp_path) -> None:
    """A deferred sampling runs in the phase that retires the step before it; with a sampled
    trace the engine pauses the tracer by the deferred step's own decision, so each kept step
    has the full trace's slices (its grammar mask and second launch included), and no dropped
    step has any (docs/design.md §4.9)."""
    full = _trace(tmp_path, async_on=True)
    sampled = _trace(tmp_path, async_on=True, capture=CaptureConfig(every=2, run_length=3))
    steps = sorted(set(full.loc[full["step"] >= 0, "step"]))
    kept = [s for s in steps if ((s - steps[0]) // 3) % 2 == 0]
    assert sorted(set(sampled.loc[sampled["step"] >= 0, "step"])) == kept

    def names(df: pd.DataFrame, step: int) -> list[str]:
        return sorted(df.loc[df["step"] == step, "name"].astype(str))

    assert any(CpuSlice.GRAMMAR_MASK.value in names(full, s) for s in kept)
    for step in kept:
        assert names(sampled, step) == names(full, step), step
