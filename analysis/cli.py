"""``stepscope analyze`` and ``stepscope compare``: verdicts first, then tables; ``--json``."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from analysis.errors import TraceError
from analysis.jsonout import dump_json
from analysis.loading.load import DEFAULT_MAX_DECOMPRESSED_MB
from analysis.loading.prefetch import TracePrefetch
from analysis.ranks.cli import is_rank_set

if TYPE_CHECKING:  # the analysis (pandas) is imported once the trace is being read
    import pandas as pd

    from analysis import Report

__all__ = ["analyze_main", "compare_main"]

_SHOWN_TABLES = (
    "kernel_types",
    "top_kernels",
    "phases",
    "starvation",
    "fill",
    "blame",
    "overlap",
    "waits",
    "grammar",
    "syncs",
    "silent_fallbacks",
    "decisions",
    "steps",
)
_MAX_ROWS = 15


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile", default=None, help="stepscope, vllm, sglang, or a .json/.toml mapping file"
    )
    parser.add_argument(
        "--window",
        default="steady",
        metavar="all|steady|A:B",
        help="steps measured: steady (default: first to last step with stable batch size and "
        "step time, see README), all, or A:B (steps A..B-1)",
    )
    parser.add_argument(
        "--skip-steps",
        type=int,
        default=1,
        help="with --window all: warm-up steps left out (only when 2 steps remain and the "
        "warm-up does not hold all the device work)",
    )
    parser.add_argument("--json", action="store_true", help="print every number as JSON")
    parser.add_argument(
        "--max-decompressed-mb",
        type=float,
        default=DEFAULT_MAX_DECOMPRESSED_MB,
        metavar="MB",
        help="refuse a .gz trace that decompresses to more than this (default %(default).0f)",
    )


def _print_json(obj: Any) -> None:
    dump_json(obj)


def _fmt(df: pd.DataFrame) -> str:
    import pandas as pd

    with pd.option_context(
        "display.width", 120, "display.max_columns", 12, "display.float_format", "{:.3f}".format
    ):
        return df.head(_MAX_ROWS).to_string(index=False)


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _print_headline(report: Report) -> None:
    """The headline's numbers with their registry labels and units; warn/bad marked."""
    from analysis.metrics_registry import METRICS

    h = report.headline
    print("headline:")
    for m in METRICS:
        value = h[m.key]
        if isinstance(value, dict) and isinstance(value.get("p50"), (int, float)):
            value = value["p50"]  # percentiles: the median
            label = f"{m.label} p50"
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            label = m.label
        else:
            continue
        tone = m.tone(h)
        mark = f"  ({tone})" if tone in ("warn", "bad") else ""
        print(f"  {label:<30} {m.show(value)}{mark}")


def _print_report(report: Report) -> None:
    from instrument.schema import CaptureArg

    for line in report.verdicts:
        print(f"* {line}")
    w = report.headline["window"]
    print(
        f"\nwindow ({w['rule']}): steps {w['first_step']}..{w['last_step']} "
        f"({w['num_steps']} steps, {w['skipped_steps']} before it; "
        f"{w['duration_ms']:.2f} ms of device span)"
    )
    if w["note"]:
        print(f"  note: {w['note']}")
    for note in report.frames.metadata.get("notes", []):
        print(f"  note: {note}")
    _print_headline(report)
    capture = report.extra.get("capture", {})
    dropped = {
        k: v
        for k, v in capture.items()
        if k.startswith(CaptureArg.DROPPED_STEPS_PREFIX.value) and v
    }
    if capture.get("sampled") or dropped:
        sampled = (
            f"one step in {capture.get(CaptureArg.EVERY.value, 1)} kept; "
            if capture["sampled"]
            else ""
        )
        print(f"  capture: {sampled}steps left out of the trace {dropped or 'none'}")
    for name in _SHOWN_TABLES:
        df = report.tables[name]
        if name == "top_kernels":  # C++ kernel names run to hundreds of characters
            df = df.assign(name=df["name"].map(_short))
        if len(df):
            print(
                f"\n{name} ({len(df)} rows{', first ' + str(_MAX_ROWS) if len(df) > _MAX_ROWS else ''})"
            )
            print(_fmt(df))


def analyze_main(argv: list[str]) -> int:
    """``stepscope analyze TRACE [--profile P|FILE] [--window all|steady|A:B] [--json]``; returns
    the exit code."""
    parser = argparse.ArgumentParser(prog="stepscope analyze", description=__doc__)
    parser.add_argument(
        "trace",
        nargs="+",
        help="a .pftrace (stepscope/Perfetto) or Kineto .json[.gz] file; several files or a "
        "directory: the rank traces of one tensor-parallel run (*.rank<i>.pftrace, or Kineto "
        "traces ranked by their distributedInfo; per-rank and straggler tables)",
    )
    _common(parser)
    args = parser.parse_args(argv)
    if is_rank_set(args.trace):  # tensor parallel: analysis.ranks.cli
        from analysis.ranks.cli import rank_analyze_main

        return rank_analyze_main(args)
    args.trace = args.trace[0]
    # A process that has yet to import pandas and the metrics decodes the trace meanwhile in a
    # forked child (analysis.loading.prefetch); one that has them (tests, the dashboard) would
    # gain nothing and loads in place.
    prefetch = TracePrefetch(args.trace, args.max_decompressed_mb, "pandas" not in sys.modules)
    # pandas and the metrics (about as long as the child's decoding) are imported meanwhile;
    # analysis.analyze_frames alone would import them only once the trace is loaded.
    import analysis.report  # noqa: F401
    from analysis import analyze_frames

    try:
        frames = prefetch.load(args.profile)
        report = analyze_frames(frames, args.profile, args.skip_steps, args.window, parallel=True)
    except TraceError as exc:
        print(f"stepscope analyze: {exc}", file=sys.stderr)
        return 2
    if args.json:
        _print_json(report.to_dict())
    else:
        _print_report(report)
    return 0


def compare_main(argv: list[str]) -> int:
    """``stepscope compare A B [--vary KEY ...] [--profile P] [--json]``; exit 1 when the A/B
    contract is broken, 2 when a trace cannot be read."""
    parser = argparse.ArgumentParser(prog="stepscope compare", description=__doc__)
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument(
        "--vary",
        action="append",
        default=[],
        help="config key under test (repeatable); others must be equal",
    )
    _common(parser)
    args = parser.parse_args(argv)
    from analysis import analyze_trace, compare_reports

    try:
        a, b = (
            analyze_trace(p, args.profile, args.skip_steps, args.window, args.max_decompressed_mb)
            for p in (args.a, args.b)
        )
    except TraceError as exc:
        print(f"stepscope compare: {exc}", file=sys.stderr)
        return 2
    cmp = compare_reports(a, b, tuple(args.vary))
    if args.json:
        _print_json({"comparison": cmp.to_dict(), "a": a.to_dict(False), "b": b.to_dict(False)})
        return 0 if cmp.contract_ok else 1
    # Unchecked (no engine_config in either trace): the notes below say so.
    if cmp.checked and cmp.contract_ok:
        varied = (
            ", ".join(f"{k}: {va!r} -> {vb!r}" for k, (va, vb) in cmp.differences.items())
            or "nothing"
        )
        print(f"* A/B contract holds; the variable under test: {varied}.")
    elif cmp.checked:
        print(
            f"* A/B contract BROKEN: the traces differ in {', '.join(cmp.violations) or 'an unknown config'}"
            " — the deltas below mix several causes."
        )
    for note in cmp.notes:
        print(f"* {note}")
    if cmp.outputs_agree is not None:
        print(f"* outputs {'agree' if cmp.outputs_agree else 'DIFFER'} (digests).")
    from analysis.compare import wait_and_idle_lines

    for line in wait_and_idle_lines(cmp):
        print(f"* {line}")
    import pandas as pd

    rows = [{"metric": k, **v} for k, v in cmp.deltas.items()]
    print()
    print(_fmt(pd.DataFrame(rows)))
    return 0 if cmp.contract_ok else 1
