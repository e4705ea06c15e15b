"""Output waits of speculative runs: the CPU engine runs EAGLE with ``--spec-sync-accepted`` (the
host waits for step N's accepted counts before preparing N+1) and without (the async loop waits
for step N's output only after launching N+1). ``stepscope compare`` names each side's exposed
wait and its cost per step; the numbers are checked against an interval computation written here
in plain Python on the trace's raw slices."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from analysis import Report, analyze_trace, compare_reports
from analysis.cli import compare_main
from analysis.compare import SERIAL_FACTOR, device_idle_line, exposed_wait_line
from engine.llm import LLM
from engine.workload import load_workload
from instrument.tracer import Tracer

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "samples" / "models"
WORKLOAD = ROOT / "samples" / "workloads" / "pycode_prompts.jsonl"


def _trace(path: Path, sync: bool) -> Path:
    workload = [
        dataclasses.replace(
            w,
            arrival_time_s=0.0,
            params=dataclasses.replace(w.params, temperature=0.0, max_tokens=16),
        )
        for w in load_workload(str(WORKLOAD))[:6]
    ]
    tracer = Tracer(str(path))
    llm = LLM(
        tracer=tracer,
        model=str(MODELS / "pycoder-14m"),
        device="cpu",
        dtype="float32",
        async_scheduling=True,
        spec_method="eagle",
        spec_model=str(MODELS / "pycoder-14m-eagle"),
        num_spec_tokens=3,
        spec_sync_accepted=sync,
    )
    llm.run_workload(workload)
    llm.close()
    tracer.close()
    return path


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("spec_waits")
    return _trace(tmp / "sync.pftrace", True), _trace(tmp / "async.pftrace", False)


def _merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _overlap(s: int, e: int, merged: list[tuple[int, int]]) -> int:
    return sum(max(0, min(e, b) - max(s, a)) for a, b in merged)


def _reference(report: Report) -> dict[str, tuple[float, float]]:
    """By wait kind, per window step: the exposed µs |wait ∩ [t0, t1)| − |wait ∩ busy ∩ [t0, t1)|
    (busy = every compute slice of the trace: the CPU trace is one kept run, no kernels), and
    the µs of the wait before its step's d2h_output copy ended."""
    sl = report.frames.slices
    win = report.headline["window"]
    t0, t1 = win["start_ns"], win["end_ns"]
    compute = sl[sl["role"] == "compute"]
    busy = [
        (max(int(s), t0), min(int(e), t1))
        for s, e in zip(compute["ts_ns"], compute["end_ns"], strict=True)
        if e > t0 and s < t1
    ]
    busy = _merged(busy)
    waits = sl[
        (sl["name"] == "wait_output")
        & (sl["step"] >= win["first_step"])
        & (sl["step"] <= win["last_step"])
    ]
    copies = sl[sl["name"] == "d2h_output"]
    copy_end = dict(zip(copies["step"], copies["end_ns"], strict=True))
    exposed: dict[str, int] = {}
    device: dict[str, int] = {}
    for w in waits.itertuples():
        before = min(int(w.end_ns), int(copy_end[w.step])) - int(w.ts_ns)
        device[w.kind] = device.get(w.kind, 0) + max(before, 0)
        s, e = max(int(w.ts_ns), t0), min(int(w.end_ns), t1)
        if e > s:
            exposed[w.kind] = exposed.get(w.kind, 0) + (e - s) - _overlap(s, e, busy)
        else:
            exposed.setdefault(w.kind, 0)
    n = win["num_steps"]
    return {k: (v / 1e3 / n, device[k] / 1e3 / n) for k, v in exposed.items()}


def test_compare_names_each_sides_exposed_wait_per_step(traces: tuple[Path, Path]) -> None:
    sync, asyn = (analyze_trace(p, window="all") for p in traces)
    cmp = compare_reports(sync, asyn)
    assert cmp.contract_ok and set(cmp.differences) == {"spec_sync_accepted"}
    ew = cmp.exposed_wait
    assert ew is not None
    # The sync loop waits for accepted counts, the async loop for the sampled output.
    assert set(ew["a"]["by_kind"]) == {"accepted_count"}
    assert set(ew["b"]["by_kind"]) == {"sampled"}
    for side, report in (("a", sync), ("b", asyn)):
        ref = _reference(report)
        got = {k: v["exposed_us_per_step"] for k, v in ew[side]["by_kind"].items()}
        assert got == pytest.approx({k: v[0] for k, v in ref.items()}, abs=1e-6)
        dev = {k: v["device_wait_us_per_step"] for k, v in ew[side]["by_kind"].items()}
        assert dev == pytest.approx({k: v[1] for k, v in ref.items()}, abs=1e-6)
        win = report.headline["window"]  # the share's denominator: the window's device span
        exposed_ns = sum(v[0] for v in ref.values()) * win["num_steps"] * 1e3
        share = exposed_ns / (win["end_ns"] - win["start_ns"])
        assert ew[side]["exposed_share"] == pytest.approx(share, rel=1e-9)
        assert ew[side]["num_steps"] == win["num_steps"]
    assert ew["delta_us_per_step"] == pytest.approx(
        ew["b"]["exposed_us_per_step"] - ew["a"]["exposed_us_per_step"]
    )
    # The headline accepted-count wait is the sync side's accepted_count kind, in total.
    total = sync.extra["output_wait"]["by_kind"]["accepted_count"]["exposed_us"]
    assert sync.headline["wait_accepted_exposed_us"] == pytest.approx(total)
    assert asyn.headline["wait_accepted_total_us"] == 0.0
    # On the CPU device the sync loop's wait covers the device work of its own step (nothing
    # else is queued), so nearly all of it comes before the step's output reached the host.
    sync_kind = ew["a"]["by_kind"]["accepted_count"]
    total_us = sync.extra["output_wait"]["by_kind"]["accepted_count"]["wait_us"]
    assert (
        sync_kind["device_wait_us_per_step"] * sync.headline["window"]["num_steps"] > 0.5 * total_us
    )
    (said,) = [v for v in sync.verdicts if v.startswith("Waiting for accepted counts")]
    assert "came before the step's output reached the host." in said  # not host work alone
    line = exposed_wait_line(ew)
    assert "A wait_output(accepted_count)" in line and "B wait_output(sampled)" in line
    assert f"{ew['a']['exposed_us_per_step']:,.1f} µs/step" in line


def test_compare_cli_prints_the_exposed_wait_line(
    traces: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert compare_main([str(traces[0]), str(traces[1]), "--window", "all"]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("* exposed wait for step output")]
    assert "wait_output(accepted_count)" in line and "B − A" in line
    assert "output_wait_exposed_us_per_step" in out  # the delta table row


def test_no_exposed_wait_line_without_speculation() -> None:
    """A trace without a proposer or accepted-count waits (a Kineto trace whose waits are a
    blocking d2h copy and a sync): its output waits are tabled, compare adds no spec line."""
    report = analyze_trace(ROOT / "tests" / "data" / "kineto_gpu_small.json")
    assert set(report.extra["output_wait"]["by_kind"]) == {"d2h_copy", "sync"}
    assert compare_reports(report, report).exposed_wait is None


@pytest.mark.parametrize(("device_a", "warned"), [(0.0, True), (100.0, False), (None, False)])
def test_line_warns_when_no_wait_was_for_the_device(device_a: float | None, warned: bool) -> None:
    """As on the H200 today: both outputs were on the host before the waits began."""

    def side(kind: str, us: float, dev: float | None) -> dict:
        v = {"exposed_us_per_step": us, "exposed_share": us / 20e3, "device_wait_us_per_step": dev}
        return {"exposed_us_per_step": us, "exposed_share": us / 20e3, "by_kind": {kind: v}}

    cmp = {
        "a": side("accepted_count", 1112.7, device_a),
        "b": side("sampled", 920.0, 0.0),
        "delta_us_per_step": -192.7,
        "delta_share": -192.7 / 20e3,
    }
    line = exposed_wait_line(cmp)
    assert "A wait_output(accepted_count) 1,112.7 µs/step (5.6% of step time" in line
    assert "B − A -192.7 µs/step (-0.96 points of step time)" in line
    assert ("Neither side waited for the device" in line) is warned


def test_read_output_is_host_work_after_the_wait_not_exposed_wait(
    traces: tuple[Path, Path],
) -> None:
    """The engine writes ``wait_output`` around the wait for the output event only and
    ``read_output`` (same step and kind) right after it around reading the output; the table's
    ``read_ns`` is the reads' union per step (checked against the raw slices), and exposed wait
    counts ``wait_output`` alone."""
    for path in traces:
        report = analyze_trace(path, window="all")
        sl = report.frames.slices
        waits = sl[sl["name"] == "wait_output"].sort_values("ts_ns")
        reads = sl[sl["name"] == "read_output"].sort_values("ts_ns")
        assert len(reads) == len(waits) > 0
        for w, r in zip(waits.itertuples(), reads.itertuples(), strict=True):
            assert (r.step, r.kind) == (w.step, w.kind)
            assert w.end_ns <= r.ts_ns  # the read follows the wait, never inside it
        table = report.tables["output_waits"]
        win = report.headline["window"]
        in_win = reads[(reads["step"] >= win["first_step"]) & (reads["step"] <= win["last_step"])]
        want = (in_win["end_ns"] - in_win["ts_ns"]).groupby(in_win["step"]).sum()
        got = table.set_index("step")["read_ns"]
        assert got.to_dict() == {int(k): int(v) for k, v in want.items()}
        ow = report.extra["output_wait"]
        assert ow["read_split"] is True
        (kind,) = ow["by_kind"].values()
        n = win["num_steps"]
        assert kind["read_us_per_step"] == pytest.approx(int(want.sum()) / 1e3 / n)
        # exposed wait: the reference over wait_output slices only (the reads excluded)
        ref = _reference(report)
        assert {k: v["exposed_us_per_step"] for k, v in ow["by_kind"].items()} == pytest.approx(
            {k: v[0] for k, v in ref.items()}, abs=1e-6
        )


def test_output_waits_table_splits_wait_and_read_by_hand() -> None:
    """A hand-made step: compute busy [0, 100), the copy ends at 140, the host waits
    [100, 150) and reads [150, 180) (kind sampled); a second, older-style step waits [300, 360)
    with no read. Exposed wait = the wait's idle part only; the read is tabled apart."""
    import numpy as np
    import pandas as pd

    from analysis.intervals import complement, union
    from analysis.metrics.waits import exposed_wait_summary, output_wait_by_step

    rows = [  # name, kind, step, ts, end
        ("forward", "", 1, 0, 100),
        ("d2h_output", "", 1, 90, 140),
        ("wait_output", "sampled", 1, 100, 150),
        ("read_output", "sampled", 1, 150, 180),
        ("forward", "", 2, 200, 290),
        ("d2h_output", "", 2, 280, 300),
        ("wait_output", "sampled", 2, 300, 360),
    ]
    slices = pd.DataFrame(rows, columns=["name", "kind", "step", "ts_ns", "end_ns"])
    busy = union(np.array([0, 200]), np.array([100, 290]))
    idle = complement(busy, 0, 400)
    table = output_wait_by_step(slices, busy, idle).set_index("step")
    assert table.loc[1, ["wait_ns", "exposed_ns", "read_ns", "read_exposed_ns"]].tolist() == [
        50, 50, 30, 30,
    ]  # fmt: skip
    assert table.loc[1, "device_wait_ns"] == 40.0  # the wait before the copy ended (140)
    assert table.loc[2, ["wait_ns", "exposed_ns", "read_ns"]].tolist() == [60, 60, 0]
    summary = exposed_wait_summary(table.reset_index(), num_steps=2, span_ns=400)
    assert summary["exposed_us_per_step"] == pytest.approx((50 + 60) / 1e3 / 2)
    assert summary["by_kind"]["sampled"]["read_us_per_step"] == pytest.approx(30 / 1e3 / 2)
    assert summary["read_split"] is True


def test_compare_gives_each_side_device_idle_per_step_and_its_blame(
    traces: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The idle a serial loop pays is more than its exposed wait: compare reports each side's
    bubbles per window step, their share of step time and the CPU phases blamed for them."""
    sync, asyn = (analyze_trace(p, window="all") for p in traces)
    cmp = compare_reports(sync, asyn)
    assert cmp.device_idle is not None
    for name, report in (("a", sync), ("b", asyn)):
        side = cmp.device_idle[name]
        steps = report.headline["window"]["num_steps"]
        assert side["num_steps"] == steps > 0
        bubbles = report.tables["bubbles"]
        assert side["idle_us_per_step"] == pytest.approx(bubbles["dur_ns"].sum() / 1e3 / steps)
        assert side["idle_share"] == report.headline["bubble_ratio"]
        blame = report.tables["blame"].head(4)
        assert list(side["blame_us_per_step"]) == list(blame["label"])
        for row in blame.itertuples():
            assert side["blame_us_per_step"][row.label] == pytest.approx(row.idle_ns / 1e3 / steps)
    assert cmp.device_idle["delta_us_per_step"] == pytest.approx(
        cmp.device_idle["b"]["idle_us_per_step"] - cmp.device_idle["a"]["idle_us_per_step"]
    )
    assert cmp.to_dict()["device_idle"] == cmp.device_idle
    assert compare_main([str(traces[0]), str(traces[1]), "--window", "all"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("* device idle")]
    assert f"A {cmp.device_idle['a']['idle_us_per_step']:,.1f} µs/step" in line
    assert "B − A" in line


def _idle_side(us: float, share: float, blame: dict[str, float]) -> dict:
    return {
        "num_steps": 100,
        "idle_us_per_step": us,
        "idle_share": share,
        "starvation_aware_share": share,
        "lower_bound": True,
        "blame_us_per_step": blame,
    }


def _waits(kind_a: str, us_a: float) -> dict:
    def side(kind: str, us: float) -> dict:
        v = {"exposed_us_per_step": us, "exposed_share": us / 1e4, "device_wait_us_per_step": us}
        return {"exposed_us_per_step": us, "exposed_share": us / 1e4, "by_kind": {kind: v}}

    return {"a": side(kind_a, us_a), "b": side("sampled", 0.7)}


def test_idle_line_names_the_host_work_serialised_after_an_accepted_count_wait() -> None:
    """As on the H200 (Qwen3-0.6B shape, batch 256, n-gram k=3): the sync side exposed 2.7 µs of
    wait a step but left the device idle 2.6 ms a step while it updated, scheduled, prepared
    and launched the next step."""
    idle = {
        "a": _idle_side(
            2598.1, 0.26, {"update_from_output": 1020.0, "schedule": 610.0, "launch": 480.0}
        ),
        "b": _idle_side(132.0, 0.019, {"schedule": 100.0}),
        "delta_us_per_step": 132.0 - 2598.1,
        "delta_share": 0.019 - 0.26,
    }
    line = device_idle_line(idle, _waits("accepted_count", 2.7))
    assert (
        "A 2,598.1 µs/step (26.0% of step time; meanwhile the host ran update_from_output" in line
    )
    assert "B − A -2,466.1 µs/step (-24.10 points of step time)" in line
    assert "a lower bound where slices span launch gaps" in line
    assert (
        "A waits for accepted counts: the wait itself left the device idle 2.7 µs/step, the host"
        " work after it (reading the output, update, schedule, prepare and launch of the next"
        " step) 2,595.4 µs/step; B idles 132.0 µs/step." in line
    )
    # Idle no larger than SERIAL_FACTOR times the wait: the wait is the cost, nothing more said.
    idle["a"]["idle_us_per_step"] = SERIAL_FACTOR * 2.7 * 0.9
    assert "waits for accepted counts" not in device_idle_line(idle, _waits("accepted_count", 2.7))
    # As on a vLLM Kineto trace whose profile maps a wait onto accepted_count: 25 µs of idle a
    # step, 0.2 % of step time, while no CPU slice ran. Not a serial loop: nothing said.
    quiet = dict(idle, a=_idle_side(25.5, 0.002, {"(no cpu slice)": 25.5}))
    assert "waits for accepted counts" not in device_idle_line(quiet, _waits("accepted_count", 0))
    # Enough idle, but mostly while nothing or only the waits ran: nothing said either.
    waits_only = dict(idle, a=_idle_side(2598.1, 0.26, {"wait_output(sampled)": 2000.0}))
    assert "waits for accepted" not in device_idle_line(waits_only, _waits("accepted_count", 2.7))
    # No accepted-count wait on either side (an async on/off comparison): no such sentence.
    idle["a"]["idle_us_per_step"] = 2598.1
    assert "waits for accepted counts" not in device_idle_line(idle, _waits("sampled", 2.7))
    assert "waits for accepted counts" not in device_idle_line(idle)


H200 = ROOT / "tests" / "data" / "real" / "stepscope_h200"


def test_h200_sync_loop_idles_the_device_through_the_host_work_after_its_wait() -> None:
    """Real H200 traces (tests/data/real/README.md): n-gram k=3 on the Qwen3-0.6B shape at batch
    256, where the device is the bottleneck. The sync side exposes ~3 µs of wait a step but idles
    the device ~2.7 ms a step while the host updates, schedules, prepares and launches the next
    step; compare says so, and its numbers add up to the reports' bubble ratios."""
    sync = analyze_trace(H200 / "spec_ngram_sync_b256.pftrace.gz")
    asyn = analyze_trace(H200 / "spec_ngram_async_b256.pftrace.gz")
    cmp = compare_reports(sync, asyn)
    assert cmp.contract_ok and list(cmp.differences) == ["spec_sync_accepted"]
    idle, waits = cmp.device_idle, cmp.exposed_wait
    assert idle is not None and waits is not None
    exposed = waits["a"]["by_kind"]["accepted_count"]["exposed_us_per_step"]
    assert exposed < 10.0  # the wait itself: almost nothing
    assert idle["a"]["idle_us_per_step"] > 100 * exposed  # the serial host work: ~2.7 ms/step
    assert idle["a"]["idle_share"] > 5 * idle["b"]["idle_share"]
    for name, report in (("a", sync), ("b", asyn)):
        # Brute force on the raw slices: the window minus the union of compute slices in it.
        window = report.headline["window"]
        t0, t1 = window["start_ns"], window["end_ns"]
        sl = report.frames.slices
        compute = sl[sl["track"] == "gpu:0 compute"]
        busy = _merged(
            [(max(s, t0), min(e, t1)) for s, e in zip(compute["ts_ns"], compute["end_ns"], strict=True)
             if e > t0 and s < t1]
        )  # fmt: skip
        idle_ns = (t1 - t0) - sum(e - s for s, e in busy)
        assert idle[name]["idle_us_per_step"] == pytest.approx(
            idle_ns / 1e3 / window["num_steps"], rel=1e-6
        )
        assert idle[name]["idle_share"] == pytest.approx(idle_ns / (t1 - t0), rel=1e-6)
    # The host phases blamed for A's idle are the serial loop's own.
    assert set(idle["a"]["blame_us_per_step"]) >= {"update_from_output", "schedule", "launch"}
    line = device_idle_line(idle, waits)
    assert "A waits for accepted counts: the wait itself left the device idle" in line
    # analyze: starved in every step, but not by launching (1.26 ms of launch, 7.26 ms of slices)
    says = " ".join(sync.verdicts)
    assert "Spec-verify steps are host-bound between steps, not launch-bound" in says
    assert "launching one took 1.26 ms against 7.26 ms of device slices" in says
    assert f"A {idle['a']['idle_us_per_step']:,.1f} µs/step (26.1% of step time" in line
