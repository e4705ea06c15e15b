"""Does a sampled trace (``--trace-every N``) measure what a full trace of the same run does?

Runs ``stepscope run`` on one workload alternately with ``--trace`` (every step) and with
``--trace --trace-every N`` (runs of ``capture_run_length`` consecutive steps, one run in N),
``--rounds`` times each, in fresh processes, and analyses every trace with the same window. Per
trace it prints overlap, bubble_ratio and the CPU lead; then the medians of each mode, their
difference and whether it is within ±0.05 (the acceptance of issue 15, docs/design.md §4
"Sampled traces"), and whether any ratio, fraction or share anywhere in a report lies outside
[0, 1]. Runs of one mode differ between themselves too (host speed): their spread is printed
beside the difference, so a difference inside it is not the sampling's doing.

    python bench/bench_sampled_trace.py --device cuda --out bench/results/h200/sampled_trace.json
    python bench/bench_sampled_trace.py --quick          # CPU smoke: the sample model, tiny
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from analysis import Report, analyze_trace  # noqa: E402

TOLERANCE = 0.05
KEYS = ("overlap", "bubble_ratio", "cpu_lead_us_p50", "starved_steps_frac")
RATIO_KEY = re.compile(r"(^|_)(ratio|frac|overlap|fill|share)(_|$)")


def engine_command(args: argparse.Namespace, trace: str, every: int) -> list[str]:
    """The ``stepscope run`` command line of one traced run (``every`` 0: the full trace)."""
    cmd = [
        sys.executable, "-m", "stepscope.cli", "run",
        "--device", args.device, "--workload", args.workload,
        "--max-num-seqs", str(args.max_num_seqs), "--trace", trace, "--no-progress",
    ]  # fmt: skip
    if args.model_config:
        cmd += ["--model-config", args.model_config, "--random-weights"]
        cmd += ["--tokenizer", str(ROOT / "samples" / "models" / "pycoder-14m")]
    else:
        cmd += ["--model", args.model]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if every:
        cmd += ["--trace-every", str(every)]
    return cmd + list(args.engine_args)


def out_of_range_ratios(d: Any, path: str = "") -> list[tuple[str, float]]:
    """Every number in a report dict whose key names a ratio, fraction, overlap, fill or
    share and lies outside [0, 1] (a ``*_starvation_aware`` estimate included)."""
    bad: list[tuple[str, float]] = []
    if isinstance(d, dict):
        for k, v in d.items():
            key = f"{path}.{k}"
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                if RATIO_KEY.search(str(k)) and not 0.0 <= float(v) <= 1.0:
                    bad.append((key, float(v)))
            else:
                bad += out_of_range_ratios(v, key)
    elif isinstance(d, list):
        for i, v in enumerate(d):
            bad += out_of_range_ratios(v, f"{path}[{i}]")
    return bad


def measure(report: Report) -> dict[str, Any]:
    """The compared numbers of one trace's report, and its out-of-range ratios."""
    h = report.headline
    row: dict[str, Any] = {k: (None if h.get(k) is None else float(h[k])) for k in KEYS}
    runs = report.tables.get("runs")
    row["num_runs"] = 0 if runs is None else len(runs)
    row["num_steps"] = int(report.tables["steps"].shape[0]) if "steps" in report.tables else 0
    row["out_of_range"] = [f"{k}={v:.3f}" for k, v in out_of_range_ratios(report.to_dict())]
    return row


def _median(rows: list[dict[str, Any]], key: str) -> tuple[float, float]:
    """Median and spread (max - min) of ``key`` over the runs that have it."""
    vals = np.array([r[key] for r in rows if r[key] is not None], dtype=np.float64)
    if vals.size == 0:
        return float("nan"), float("nan")
    return float(np.median(vals)), float(vals.max() - vals.min())


def compare(full: list[dict[str, Any]], sampled: list[dict[str, Any]]) -> dict[str, Any]:
    """Per compared key: each mode's median and spread, the difference, the verdict."""
    out: dict[str, Any] = {}
    for key in KEYS:
        (f, fs), (s, ss) = _median(full, key), _median(sampled, key)
        row = {"full": f, "full_spread": fs, "sampled": s, "sampled_spread": ss, "diff": s - f}
        if key in ("overlap", "bubble_ratio"):
            row["within_tolerance"] = bool(abs(s - f) <= TOLERANCE)
        out[key] = row
    bad = [b for r in full + sampled for b in r["out_of_range"]]
    out["no_ratio_outside_0_1"] = not bad
    out["out_of_range"] = bad
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: the engine's (bfloat16 on CUDA)")
    p.add_argument("--model-config", default="qwen3-0.6b", help="a named shape, random weights")
    p.add_argument("--model", default="samples/models/pycoder-14m", help="without --model-config")
    p.add_argument("--workload", default="synthetic:n=1024,in=128-128,out=128-128,seed=0")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--every", type=int, default=4, help="--trace-every N of the sampled mode")
    p.add_argument("--rounds", type=int, default=2, help="alternations of full and sampled")
    p.add_argument("--window", default="steady", help="the analysis window of every trace")
    p.add_argument("--keep", help="write the traces into this folder (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="CPU smoke: the sample model, tiny")
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("engine_args", nargs="*", help="more `stepscope run` flags, after --")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.device, args.model_config, args.max_num_seqs = "cpu", None, 8
        args.workload, args.rounds = "synthetic:n=16,in=8-8,out=48-48,seed=0", 1
        args.engine_args = [*args.engine_args, "--num-kv-blocks", "256"]
    folder = Path(args.keep or tempfile.mkdtemp(prefix="stepscope-sampled-"))
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs: dict[str, list[dict[str, Any]]] = {"full": [], "sampled": []}
    for r in range(args.rounds):
        order = [("full", 0), ("sampled", args.every)]
        for mode, every in order if r % 2 == 0 else order[::-1]:
            trace = str(folder / f"{mode}_{r}.pftrace")
            cmd = engine_command(args, trace, every)
            subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
            row = {"round": r, "mode": mode, "trace": trace}
            row.update(measure(analyze_trace(trace, window=args.window)))
            runs[mode].append(row)
            lead = row["cpu_lead_us_p50"]
            print(
                f"  round {r + 1}/{args.rounds} {mode:8s} overlap {row['overlap']:.3f}  "
                f"bubble_ratio {row['bubble_ratio']:.3f}  cpu lead p50 "
                f"{'n/a' if lead is None else f'{lead:,.0f} µs'}  "
                f"{row['num_steps']} steps in {row['num_runs'] or 1} run(s)",
                flush=True,
            )
    result = compare(runs["full"], runs["sampled"])
    print(f"\nfull trace vs --trace-every {args.every}, medians of {args.rounds} run(s) each:")
    for key in KEYS:
        c = result[key]
        verdict = ""
        if "within_tolerance" in c:
            verdict = "  within ±0.05" if c["within_tolerance"] else "  OUTSIDE ±0.05"
        print(
            f"  {key:20s} full {c['full']:10.3f} (spread {c['full_spread']:.3f})  sampled "
            f"{c['sampled']:10.3f} (spread {c['sampled_spread']:.3f})  diff {c['diff']:+.3f}"
            f"{verdict}"
        )
    ok = result["no_ratio_outside_0_1"] and all(
        result[k]["within_tolerance"] for k in ("overlap", "bubble_ratio")
    )
    print(
        "  ratios in [0, 1] in every report: "
        + ("yes" if result["no_ratio_outside_0_1"] else f"NO {result['out_of_range']}")
    )
    print(f"\n{'PASS' if ok else 'FAIL'} (±{TOLERANCE})")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        doc = {"args": {k: v for k, v in vars(args).items()}, "runs": runs, "compare": result}
        doc["pass"] = ok
        Path(args.out).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
