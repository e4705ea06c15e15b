"""Kernel breakdown: hand-built kernels with exact clipped times, and every real trace against an
independent per-event computation from the raw JSON."""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path

import pandas as pd
import pytest

from analysis import analyze_trace, load_trace
from analysis.cli import analyze_main
from analysis.kernels import kernel_breakdown, kernel_slices

REAL = Path(__file__).resolve().parents[1] / "data" / "real"
REAL_TRACES = sorted(REAL.rglob("*.json.gz"))
_DEVICE = {"kernel", "gpu_memcpy", "gpu_memset", "mtia_ccp_events"}


def _kernels(rows: list[tuple[str, str, int, int]]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "role": [r[0] for r in rows],
            "raw_name": [r[1] for r in rows],
            "ts_ns": [r[2] for r in rows],
            "end_ns": [r[3] for r in rows],
        }
    )


def test_breakdown_of_hand_built_kernels_clips_to_the_window() -> None:
    k = _kernels(
        [
            ("compute", "gemm", 0, 100),  # 50 inside [50, 400)
            ("compute", "gemm", 100, 200),
            ("compute", "ncclDevKernel_AllReduce_Sum_f32", 150, 350),  # concurrent stream
            ("copy", "Memcpy DtoH (Device -> Pageable)", 350, 450),  # 50 inside
            ("compute", "Memset (Device)", 360, 370),
            ("compute", "softmax", 500, 600),  # outside
        ]
    )
    types, top = kernel_breakdown(k, 50, 400)
    got = dict(zip(types["kernel_type"], zip(types["num_kernels"], types["total_ns"], strict=True),
                   strict=True))  # fmt: skip
    assert got == {"computation": (2, 150), "communication": (1, 200), "memory": (2, 60)}
    assert types["share"].sum() == pytest.approx(1.0)
    assert list(types["kernel_type"]) == ["communication", "computation", "memory"]
    row = top.set_index("name").loc["gemm"]
    assert (row["count"], row["total_ns"], row["mean_ns"]) == (2, 150, 75.0)
    assert row["share"] == pytest.approx(150 / 410)
    empty_types, empty_top = kernel_breakdown(k, 700, 800)
    assert empty_types.empty and empty_top.empty and list(empty_top.columns) == list(top.columns)


def _independent(path: Path) -> tuple[list[tuple[str, int, int, str]], int, int]:
    """Device kernels of the raw JSON as (name, ts_ns, end_ns, type) and a window: the middle
    half of their span. Written from the trace format, not from the loader."""
    doc = json.loads(gzip.decompress(path.read_bytes()))
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    out = []
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X" or "ts" not in e:
            continue
        cat, name = str(e.get("cat", "")).lower(), str(e.get("name", ""))
        if cat not in _DEVICE or (
            cat == "mtia_ccp_events" and name in ("event_record", "event_wait")
        ):
            continue
        ts = round(float(e["ts"]) * 1000)
        end = ts + round(max(float(e.get("dur") or 0), 0.0) * 1000)
        low = name.lower().removeprefix("void").strip()
        if low.startswith(("nccl", "rccl")):
            kind = "communication"
        elif cat == "gpu_memcpy" or low.startswith(("memcpy", "memset", "dma")):
            kind = "memory"
        else:
            kind = "computation"
        out.append((name, ts, end, kind))
    if not out:
        return out, 0, 0
    lo, hi = min(k[1] for k in out), max(k[2] for k in out)
    return out, lo + (hi - lo) // 4, hi - (hi - lo) // 4


@pytest.mark.parametrize("path", REAL_TRACES, ids=lambda p: str(p.relative_to(REAL)))
def test_breakdown_matches_an_independent_count_on_real_traces(path: Path) -> None:
    kernels, lo, hi = _independent(path)
    types, top = kernel_breakdown(kernel_slices(load_trace(path)), lo, hi)
    by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    by_name: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for name, ts, end, kind in kernels:
        clipped = min(end, hi) - max(ts, lo)
        if clipped > 0 or (clipped == 0 and lo <= ts < hi):
            for acc in (by_type[kind], by_name[(name, kind)]):
                acc[0] += 1
                acc[1] += max(clipped, 0)
    got = {r.kernel_type: [r.num_kernels, r.total_ns] for r in types.itertuples()}
    assert got == dict(by_type)
    expected_top = sorted(by_name.items(), key=lambda kv: (-kv[1][1], kv[0][0]))[:10]
    assert [(r.name, r.kernel_type, r.count, r.total_ns) for r in top.itertuples()] == [
        (n, k, c, t) for (n, k), (c, t) in expected_top
    ]


def test_breakdown_in_the_report_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    path = REAL / "hta" / "nccl_parser_config" / "nccl_data.json.gz"
    report = analyze_trace(path)
    types = report.tables["kernel_types"]
    assert set(types["kernel_type"]) == {"computation", "communication", "memory"}
    assert analyze_main([str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tables"]["kernel_types"] == types.to_dict("records")
    assert out["tables"]["top_kernels"][0]["name"].startswith("ncclKernel_AllReduce")
    assert analyze_main([str(path)]) == 0
    text = capsys.readouterr().out
    assert "kernel_types" in text and "communication" in text
