"""Cut a stepscope Perfetto trace down to engine steps A..B-1, for small real test data.

Keeps every slice of those steps (engine thread, device stage, copy and kernel lanes) with its
args and times unchanged, plus every instant (``trace_metadata``, ``engine_config``,
``feature_decision``, syncs); drops stepless slices (request tracks) and flows. The result is
re-encoded with ``tracekit.perfetto`` (the same events, not the same bytes).

    python scripts/cut_trace.py IN.pftrace OUT.pftrace --steps 1490:1530
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from analysis import load_trace  # noqa: E402
from analysis.metrics.window import parse_window  # noqa: E402
from tracekit.perfetto import TraceSpec, write  # noqa: E402

# Loader columns that are not args of the original event.
_SLICE_FIELDS = {
    "slice_id",
    "track_id",
    "track",
    "role",
    "name",
    "raw_name",
    "ts_ns",
    "dur_ns",
    "end_ns",
    "depth",
}
_INSTANT_FIELDS = {"track_id", "track", "scope", "name", "ts_ns"}


def _plain(value: object) -> object | None:
    """A Python bool/int/float/str for an arg value; None for a missing one."""
    if value is None or (not isinstance(value, str) and pd.isna(value)):  # type: ignore[arg-type]
        return None
    if isinstance(value, (np.bool_, bool)):
        return bool(value)
    if isinstance(value, (np.integer, int)):
        return int(value)
    if isinstance(value, (np.floating, float)):
        f = float(value)
        return int(f) if f.is_integer() and abs(f) < 2**63 else f
    return str(value)


def _args(row: dict[str, object], skip: set[str]) -> dict[str, object]:
    out = {}
    for key, value in row.items():
        plain = None if key in skip else _plain(value)
        if plain is not None:
            out[key] = plain
    return out


def cut(src: Path, dst: Path, first: int, end: int) -> int:
    """Write steps ``first..end-1`` of ``src`` to ``dst``; returns the number of slices kept."""
    frames = load_trace(src)
    sl = frames.slices
    step = sl["step"].to_numpy(np.int64)
    keep = sl[(step >= first) & (step < end)]
    spec = TraceSpec()
    for row in keep.to_dict("records"):
        args = _args(row, _SLICE_FIELDS)
        spec.slices.append(
            (str(row["track"]), str(row["raw_name"]), int(row["ts_ns"]), int(row["end_ns"]), args)
        )
    for row in frames.instants.to_dict("records"):
        track = None if row.get("scope") == "process" else str(row["track"])
        spec.instants.append(
            (track, str(row["name"]), int(row["ts_ns"]), _args(row, _INSTANT_FIELDS))
        )
    write(spec, dst, intern=True)
    return len(keep)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--steps", required=True, help="A:B, engine steps A..B-1 to keep")
    args = p.parse_args(argv)
    _, first, end = parse_window(args.steps)
    if end is None:
        p.error("--steps needs an end: A:B")
    n = cut(args.src, args.dst, first, end)
    print(f"{args.dst}: {n} slices of steps {first}..{end - 1}, {args.dst.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
