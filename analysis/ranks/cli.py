"""``stepscope analyze`` on a rank set (several traces, or a directory of ``*.rank<i>.pftrace`` or
of Kineto ``.json[.gz]`` rank traces)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from analysis.errors import TraceError
from analysis.jsonout import dump_json

if TYPE_CHECKING:  # `stepscope analyze` imports this module before pandas (is_rank_set)
    from analysis.ranks.report import RankReport

__all__ = ["is_rank_set", "rank_analyze_main", "print_rank_report"]

_MAX_ROWS = 15
_TABLE_TITLES = {
    "ranks": "per rank (ms; overlap and bubbles over each rank's own trace)",
    "stragglers": "stragglers per step (ns)",
    "collectives": "collective wait per rank and step (ns)",
}


def is_rank_set(paths: list[str]) -> bool:
    """Several traces, or one directory: analysed as the ranks of one tensor-parallel run."""
    return len(paths) > 1 or (len(paths) == 1 and os.path.isdir(paths[0]))


def print_rank_report(report: RankReport) -> None:
    """Verdicts, the window, then the per-rank, straggler and collective tables."""
    import pandas as pd

    for line in report.verdicts:
        print(f"* {line}")
    for note in report.ranks.notes:
        print(f"  note: {note}")
    w = report.headline["window"]
    clock = "one host: clocks shared, not shifted" if report.ranks.same_host else (
        f"clocks shifted onto rank 0's by {report.ranks.clock_shift_ns} ns"
    )  # fmt: skip
    print(
        f"\n{report.headline['world_size']} ranks; rank 0's window ({w['rule']}): steps "
        f"{w['first_step']}..{w['last_step']}; {clock}"
    )
    with pd.option_context(
        "display.width", 160, "display.max_columns", 16, "display.float_format", "{:.3f}".format
    ):
        for name, title in _TABLE_TITLES.items():
            df = report.tables[name]
            more = f", first {_MAX_ROWS}" if len(df) > _MAX_ROWS else ""
            print(f"\n{title} ({len(df)} rows{more})")
            print(df.head(_MAX_ROWS).to_string(index=False) if len(df) else "(empty)")


def rank_analyze_main(args: argparse.Namespace) -> int:
    """The rank-set branch of ``stepscope analyze`` (``args.trace`` is a list)."""
    from analysis.ranks.report import analyze_ranks

    try:
        report = analyze_ranks(
            args.trace, args.profile, args.skip_steps, args.window, args.max_decompressed_mb
        )
    except TraceError as exc:
        print(f"stepscope analyze: {exc}", file=sys.stderr)
        return 2
    if args.json:
        dump_json(report.to_dict())
    else:
        print_rank_report(report)
    return 0
