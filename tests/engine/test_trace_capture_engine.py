"""What the engine writes for CPU lead and sampled traces, on real CPU engine runs.

* every device stage slice carries ``host_end_ns``, recorded inside its step's ``launch`` slice,
  in enqueue order;
* ``--trace-every`` keeps runs of consecutive steps, each kept step whole (CPU and device
  slices), and the metadata counts every step (the dropped ones skipped on the engine thread);
* tracing (full, sampled, with request tracks) changes no token.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from analysis import load_trace
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from instrument.capture import CaptureConfig, StepRule
from instrument.schema import Arg, CopySlice, CpuSlice, DeviceSlice, parse_device_track_name
from instrument.tracer import Tracer
from tests.engine.test_trace_cost import _tiny_llm
from tests.instrument.conftest import read_trace

PROMPTS = [[(5 * i + j) % 120 + 2 for j in range(6 + i)] for i in range(6)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
# Enqueue order of one step's stages (no spec decoding, no grammar).
STAGE_ORDER = [
    CopySlice.H2D_INPUTS.value,
    DeviceSlice.INPUT_PREP.value,
    DeviceSlice.FORWARD.value,
    DeviceSlice.SAMPLE.value,
    CopySlice.D2H_OUTPUT.value,
]


def _generate(config: str, path: Path | None, capture: CaptureConfig | None = None,
              trace_requests: bool = False) -> list[list[int]]:  # fmt: skip
    tracer = Tracer(path, capture=capture) if path is not None else None
    llm = LLM(
        tracer=tracer,
        trace_requests=trace_requests,
        model_config=config,
        random_weights=True,
        async_scheduling=True,
        num_kv_blocks=128,
        max_num_seqs=8,
    )
    outs = llm.generate(PROMPTS, PARAMS)
    llm.close()
    if tracer is not None:
        tracer.close()
    return [o.output_token_ids for o in outs]


@pytest.fixture(scope="module")
def full_trace(tmp_path_factory, tiny_model_config) -> tuple[str, list[list[int]]]:
    path = tmp_path_factory.mktemp("lead") / "full.pftrace"
    tokens = _generate(tiny_model_config, path, trace_requests=True)
    return str(path), tokens


def test_every_device_slice_has_host_end_inside_its_launch(full_trace) -> None:
    path, _ = full_trace
    slices = read_trace(path).slices()
    launches = {a[Arg.STEP.value]: (s, e) for _, n, s, e, a in slices if n == CpuSlice.LAUNCH.value}
    by_step: dict[int, list[tuple[int, str]]] = defaultdict(list)
    num_device = 0
    for track, name, _start, end, args in slices:
        parsed = parse_device_track_name(track)
        if parsed is None or parsed[1] == "kernels":
            continue
        num_device += 1
        host_end = args[Arg.HOST_END_NS.value]
        step = args[Arg.STEP.value]
        launch_start, launch_end = launches[step]
        # The CPU recorded the stage's end event while launching the step.
        assert launch_start <= host_end <= launch_end, (name, step)
        # The stream reached the end event after the host began enqueueing the stage's step.
        assert end >= launch_start
        by_step[step].append((host_end, name))
    assert num_device >= 5 * len(launches) > 0
    for step, ends in by_step.items():
        assert [n for _, n in sorted(ends)] == STAGE_ORDER, step


def _runs(steps: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


@pytest.mark.parametrize(("every", "run_length"), [(2, 4), (3, 5), (4, 4)])
def test_sampled_trace_keeps_whole_runs_of_steps(
    tmp_path, tiny_model_config, full_trace, every: int, run_length: int
) -> None:
    path = tmp_path / "sampled.pftrace"
    capture = CaptureConfig(every=every, run_length=run_length, warmup_steps=2)
    tokens = _generate(tiny_model_config, path, capture, trace_requests=True)
    assert tokens == full_trace[1]  # sampling changes no token
    frames = load_trace(str(path))
    full = load_trace(full_trace[0])
    all_steps = sorted(set(full.slices.loc[full.slices["step"] >= 0, "step"]))
    kept = sorted(set(frames.slices.loc[frames.slices["step"] >= 0, "step"]))
    # Reference: runs of run_length steps from the first step after warm-up, one run in `every`.
    expected = [s for s in all_steps if s >= 2 and ((s - 2) // run_length) % every == 0]
    assert kept == expected
    runs = _runs(kept)
    assert all(len(r) == run_length for r in runs[:-1]) and len(runs) >= 2

    # Each kept step is whole: the same slices as in the full trace (CPU and device).
    def names(df, step):  # noqa: ANN001, ANN202
        return sorted(df.slices.loc[df.slices["step"] == step, "name"].astype(str))

    for step in kept:
        assert names(frames, step) == names(full, step), step

    # Request tracks span steps: each request keeps its track whatever step it finished in.
    def tracks(df):  # noqa: ANN001, ANN202
        return sorted(t for t in df.slices["track"].unique() if t.startswith("request "))

    assert tracks(frames) == tracks(full) and len(tracks(full)) == len(PROMPTS)
    meta = frames.metadata
    assert meta["steps_kept"] == len(kept)
    assert meta["steps_seen"] == len(all_steps)
    assert meta["dropped_steps_warmup"] == 2
    assert meta["dropped_steps_sampled"] == len(all_steps) - 2 - len(kept)
    # The engine thread skipped the dropped steps whole: none of their events was made, so no
    # event was dropped by the writer, and the skipped steps are counted apart.
    assert meta["engine_skipped_steps_sampled"] == meta["dropped_steps_sampled"] > 0
    assert meta["engine_skipped_steps_warmup"] == 2
    assert "dropped_events_sampled" not in meta and "dropped_events_warmup" not in meta
    assert meta["capture_run_length"] == run_length and meta["capture_every"] == every


def test_tracing_changes_no_tokens(tiny_model_config, full_trace) -> None:
    assert _generate(tiny_model_config, None) == full_trace[1]


@pytest.mark.parametrize(
    ("capture", "asks_every_step"),
    [
        (CaptureConfig(warmup_steps=2), False),  # a full trace past its warm-up: settled
        (CaptureConfig(warmup_steps=2, every=2, run_length=4), True),  # sampled: never settled
        (CaptureConfig(warmup_steps=0, first_step=3, end_step=12), True),  # dropped after 12
    ],
)
def test_the_engine_stops_asking_the_capture_rules_once_they_drop_no_later_step(
    tmp_path, tiny_model_config, capture, asks_every_step
) -> None:
    """A full trace's rules drop only the warm-up steps: past them the tracer lets its rule go
    and the engine stops asking (no per-step call for the rest of the run); rules that may still
    drop a later step (sampling, a range's end) are asked every step. The skipped counts and
    the trace's steps are the same either way."""
    tracer = Tracer(str(tmp_path / "t.pftrace"), capture=capture)
    llm = _tiny_llm(tracer, tiny_model_config)
    asked: list[int] = []
    trace_step = tracer.trace_step

    def counted(step: int) -> bool:
        asked.append(step)
        return trace_step(step)

    tracer.trace_step = counted  # type: ignore[method-assign]
    llm.generate(PROMPTS, PARAMS)
    llm.close()
    tracer.close()
    steps = llm.engine.scheduler.next_step
    assert steps > 30
    if asks_every_step:
        assert len(asked) >= steps - 1 and tracer.can_skip_steps
    else:
        assert asked == [0, 1, 2] and not tracer.can_skip_steps  # 0, 1 warm-up; 2 settles it
    rule = StepRule(capture)
    expected = {s for s in range(steps) if rule.reason(s) is None}  # asked in step order
    slices = load_trace(str(tmp_path / "t.pftrace")).slices
    kept = set(slices["step"].dropna().astype(int))
    assert kept == expected
