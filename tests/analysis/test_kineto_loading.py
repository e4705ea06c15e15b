"""Kineto loading: HIP/MTIA names, dropped categories, rank metadata and NCCL kernels, bounded
inputs (gzip bombs, deep nesting), the lenient decode path, and every real trace of
tests/data/real loading without a traceback."""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import Any

import pytest

from analysis import analyze_frames, load_trace
from analysis.cli import analyze_main
from analysis.frames import TraceError
from analysis.kineto_decode import decode_kineto
from analysis.load import gunzip_bounded
from analysis.rank_report import analyze_ranks

REAL = Path(__file__).resolve().parents[1] / "data" / "real"
REAL_TRACES = sorted(REAL.rglob("*.json.gz"))


def _x(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args: Any) -> dict[str, Any]:
    pid = args.pop("pid", 100)
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
            "args": args}  # fmt: skip


def _kernel(name: str, ts: float, dur: float, corr: int, cat: str = "kernel") -> dict[str, Any]:
    return _x(cat, name, ts, dur, tid=7, pid=0, device=0, stream=7, correlation=corr)


def _write(path: Path, events: list[dict[str, Any]], **extra: Any) -> Path:
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events, **extra}))
    return path


def _sync_trace(runtime: str) -> list[dict[str, Any]]:
    """Three syncs and two blocking copies (one D2H, one H2D) in the ``runtime`` API's names."""
    sync = {"cuda": "cuda", "hip": "hip"}[runtime]
    copy = "cudaMemcpy" if runtime == "cuda" else "hipMemcpyWithStream"
    return [
        _x(
            "cuda_runtime",
            "cudaLaunchKernel" if runtime == "cuda" else "hipLaunchKernel",
            0,
            5,
            correlation=1,
        ),  # fmt: skip
        _kernel("gemm", 10, 100, 1),
        _x("cuda_runtime", f"{sync}DeviceSynchronize", 20, 90),
        _x("cuda_runtime", f"{sync}StreamSynchronize", 120, 10),
        _x("cuda_runtime", f"{sync}EventSynchronize", 140, 10),
        _x("cuda_runtime", copy, 160, 50, correlation=2),
        _x(
            "gpu_memcpy",
            "Memcpy DtoH (Device -> Host)",
            170,
            30,
            tid=8,
            pid=0,
            device=0,
            stream=8,
            correlation=2,
        ),  # fmt: skip
        _x("cuda_runtime", copy, 220, 20, correlation=3),
        _x(
            "gpu_memcpy",
            "Memcpy HtoD (Host -> Device)",
            225,
            10,
            tid=8,
            pid=0,
            device=0,
            stream=8,
            correlation=3,
        ),  # fmt: skip
    ]


def _waits(path: Path) -> list[tuple[str, str]]:
    s = load_trace(path).slices
    w = s[s["name"] == "wait_output"].sort_values("ts_ns")
    return list(zip(w["raw_name"].astype(str), w["kind"].astype(str), strict=True))


def test_hip_syncs_and_blocking_copies_match_their_cuda_twins(tmp_path: Path) -> None:
    hip = _waits(_write(tmp_path / "hip.json", _sync_trace("hip")))
    cuda = _waits(_write(tmp_path / "cuda.json", _sync_trace("cuda")))
    assert [k for _, k in hip] == [k for _, k in cuda] == ["sync", "sync", "sync", "d2h_copy"]
    assert [n for n, _ in hip] == [
        "hipDeviceSynchronize",
        "hipStreamSynchronize",
        "hipEventSynchronize",
        "hipMemcpyWithStream",
    ]
    syncs = load_trace(tmp_path / "hip.json").syncs
    assert sorted(syncs["op"]) == sorted(n for n, _ in hip)


def test_mtia_events_are_device_work_and_dropped_categories_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events = [
        _x("mtia_runtime", "runFunction", 0, 5),
        _x("mtia_ccp_events", "pe_exe", 10, 100, tid=3, pid=17, stream=1),
        _x("mtia_ccp_events", "dma_request", 110, 20, tid=4, pid=17, stream=1),
        _x("mtia_ccp_events", "event_wait", 130, 500, tid=3, pid=17, stream=1),
        _x("mtia_runtime", "synchronizeStream", 20, 600),
        _x("cuda_sync", "Stream Sync", 30, 40, tid=9, pid=17),
        _x("cuda_sync", "Event Sync", 80, 10, tid=9, pid=17),
        _x("weird_new_thing", "x", 90, 1),
    ]
    path = _write(tmp_path / "mtia.json", events)
    frames = load_trace(path)
    s = frames.slices.set_index("raw_name")
    assert (s.loc["pe_exe", "role"], s.loc["dma_request", "role"]) == ("compute", "copy")
    assert s.loc["event_wait", "role"] == "annotation"  # a wait on the device is not work
    assert s.loc["synchronizeStream", "kind"] == "sync"
    assert frames.metadata["unknown_categories"] == ["cuda_sync", "weird_new_thing"]
    (note,) = frames.metadata["notes"]
    assert "cuda_sync (2)" in note and "weird_new_thing (1)" in note
    report = analyze_frames(frames, window="all", skip_steps=0)
    # busy = pe_exe [10, 110] only (the copy is not compute): window [10, 110] has no idle
    assert report.headline["bubble_ratio"] == 0.0
    assert analyze_main([str(path), "--window", "all"]) == 0
    assert "cuda_sync (2)" in capsys.readouterr().out


def _rank_events(rank: int, shift: float) -> list[dict[str, Any]]:
    """Two ProfilerSteps; per step a gemm and an NCCL all-reduce kernel (exact times)."""
    out: list[dict[str, Any]] = []
    for step in (1, 2):
        t0 = step * 1000.0 + shift
        out.append(_x("user_annotation", f"ProfilerStep#{step}", t0, 900))
        out.append(_x("cuda_runtime", "cudaLaunchKernel", t0 + 10, 5, correlation=step * 10))
        out.append(_x("cuda_runtime", "cudaLaunchKernel", t0 + 20, 5, correlation=step * 10 + 1))
        out.append(_kernel("sm90_gemm", t0 + 30, 200, step * 10))
        nccl = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL" if rank else "ncclKernel_AllReduce_RING"
        out.append(_kernel(nccl, t0 + 240, 100 + 10 * rank, step * 10 + 1))
    return out


def test_rank_traces_from_distributed_info_merge_with_nccl_collectives(tmp_path: Path) -> None:
    rank_dir = tmp_path / "ranks"
    rank_dir.mkdir()
    for rank, name in ((0, "host-a_123.pt.trace.json"), (1, "whatever.json")):
        info = {"backend": "nccl", "rank": rank, "world_size": 2}
        _write(rank_dir / name, _rank_events(rank, 5.0 * rank), distributedInfo=info)
    assert load_trace(rank_dir / "whatever.json").metadata["rank"] == 1
    report = analyze_ranks([str(rank_dir)], window="all", skip_steps=0)
    assert report.ranks.ranks == [0, 1] and report.ranks.world_size == 2
    coll = report.tables["collectives"].set_index(["step", "rank"])
    for step in (1, 2):
        for rank in (0, 1):
            assert coll.loc[(step, rank), "num_collectives"] == 1
            assert coll.loc[(step, rank), "collective_ns"] == (100 + 10 * rank) * 1000
            # a rank's step starts at its first kernel: rank 1 runs 5 us late
            assert coll.loc[(step, rank), "arrival_wait_ns"] == (0 if rank else 5000)


def _bomb(size: int) -> bytes:
    return gzip.compress(b"[" + b" " * size + b"]", compresslevel=9)


def test_gzip_bomb_is_refused_naming_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "bomb.json.gz"
    path.write_bytes(_bomb(3 * 2**20))
    assert path.stat().st_size < 2**16
    with pytest.raises(TraceError, match=r"more than 1 MB.*--max-decompressed-mb"):
        load_trace(path, max_decompressed_mb=1)
    with pytest.raises(TraceError, match="no events"):  # under the limit it is read in full
        load_trace(path, max_decompressed_mb=4)
    assert analyze_main([str(path), "--max-decompressed-mb", "1"]) == 2


def test_gunzip_bounded_members_and_cut_off() -> None:
    a, b = gzip.compress(b"x" * 1000), gzip.compress(b"y" * 500)
    assert gunzip_bounded(a + b, 1500) == b"x" * 1000 + b"y" * 500
    with pytest.raises(TraceError):
        gunzip_bounded(a + b, 1499)
    cut = gzip.compress(bytes(range(256)) * 64)[:-20]
    prefix = gunzip_bounded(cut, 2**20)
    assert 0 < len(prefix) and (bytes(range(256)) * 64).startswith(prefix)
    with pytest.raises(zlib.error):  # the reference: a plain decompress refuses the cut file
        zlib.decompress(cut, wbits=47)


@pytest.mark.parametrize(
    "doc",
    [
        b"[" * 200_000 + b"]" * 200_000,
        b'{"traceEvents": [{"ph": "X", "args": ' + b"[" * 200_000 + b"]" * 200_000 + b"}]}",
        b'{"traceEvents": [' + b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"]}",
    ],
)
def test_deeply_nested_json_is_refused_cleanly(tmp_path: Path, doc: bytes) -> None:
    path = tmp_path / "deep.json"
    path.write_bytes(doc)
    with pytest.raises(TraceError):
        load_trace(path)


def _frames_equal(a: Any, b: Any) -> None:
    for name in ("slices", "tracks", "flows", "syncs"):
        x, y = getattr(a, name), getattr(b, name)
        assert list(x.columns) == list(y.columns), name
        for col in x.columns:
            assert x[col].astype(object).tolist() == y[col].astype(object).tolist(), (name, col)


def test_lenient_path_matches_the_typed_path(tmp_path: Path) -> None:
    src = REAL / "tracelens" / "inference" / "sglang_decode" / "sglang_Qwen3-8B_decode.json.gz"
    doc = json.loads(gzip.decompress(src.read_bytes()))
    typed = load_trace(src)
    doc["traceEvents"].append(7)  # not an object: the typed decoder refuses, the lenient skips it
    odd = _write(tmp_path / "odd.json", doc["traceEvents"], **{k: v for k, v in doc.items()
                                                               if k != "traceEvents"})  # fmt: skip
    _frames_equal(typed, load_trace(odd))
    cols = decode_kineto(odd.read_bytes())
    assert len(cols.events) == len(doc["traceEvents"]) - 1


@pytest.mark.parametrize("path", REAL_TRACES, ids=lambda p: str(p.relative_to(REAL)))
def test_every_real_trace_loads(path: Path) -> None:
    frames = load_trace(path)
    raw = json.loads(gzip.decompress(path.read_bytes()))
    events = raw["traceEvents"] if isinstance(raw, dict) else raw
    complete = [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e]
    assert len(frames.slices) == len(complete)
    assert frames.slices["ts_ns"].is_monotonic_increasing
    info = raw.get("distributedInfo") if isinstance(raw, dict) else None
    if isinstance(info, dict) and "rank" in info:
        assert frames.metadata["rank"] == info["rank"]


def test_counters_and_named_threads(tmp_path: Path) -> None:
    events = [
        {"ph": "M", "name": "thread_name", "pid": "Spans", "tid": "t1", "args": {"name": "main"}},
        _x("cpu_op", "aten::mm", 0, 10, tid="t1", pid="Spans"),
        {"ph": "C", "name": "mem", "pid": 1, "tid": 1, "ts": 5, "args": {"used": 3, "free": 7.5}},
    ]
    frames = load_trace(_write(tmp_path / "c.json", events))
    assert frames.slices["track"].tolist() == ["main"]
    got = sorted(zip(frames.counters["name"], frames.counters["value"], strict=True))
    assert got == [("mem.free", 7.5), ("mem.used", 3.0)]
    assert frames.counters["ts_ns"].tolist() == [5000, 5000]
