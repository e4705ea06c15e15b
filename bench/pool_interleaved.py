"""Pool the interleaved traced/untraced runs of ``bench_trace_overhead.py --interleaved``.

One interleaved run gives, per quantity, the median over block pairs of the traced − untraced
difference of the blocks' medians ("paired median") and of their means ("paired mean"). A
single run's interval on the mean is wide (±30–100 µs a step on the H200: a step's host time
spreads over ~2×), so a claim about the average step needs several runs. This reads the runs'
JSON files (or the ``.tgz`` archives the h200 stages ``core-ab`` and ``poll-chunk-ab`` write),
prints one row per run, then per variant and over every run: the median of the paired medians,
the median and the mean of the paired means, and a 95 % t-interval of that mean over the runs
(each run one sample; the runs are on one machine or several, so the interval is over runs,
not steps). The variant is the file name's ``il_<variant>_<round>.json`` part.

    python bench/pool_interleaved.py bench/results/h200/core_ab_s19b.tgz \\
        bench/results/h200/core_ab_s20.tgz --variants c,c-emit
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tarfile
from typing import Any

QUANTITIES = ("host_us", "cpu_us", "proc_us")
# Two-sided 95 % quantiles of Student's t by degrees of freedom (beyond 30: the normal's).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120,
        17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064,
        25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042}  # fmt: skip
_NAME = re.compile(r"il_(?P<variant>.+)_(?P<round>\d+)\.json$")


def t95(df: int) -> float:
    """The two-sided 95 % quantile of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"a t-interval needs at least 2 samples (df {df})")
    return _T95.get(df, 1.960)


def load_runs(paths: list[str]) -> list[dict[str, Any]]:
    """Every interleaved run in ``paths`` (JSON files, or .tgz archives holding ``il_*.json``):
    its source, variant, round and the ``interleaved`` result of each traced mode."""
    runs: list[dict[str, Any]] = []
    for path in paths:
        if path.endswith((".tgz", ".tar.gz")):
            with tarfile.open(path) as tar:
                for member in sorted(tar.getmembers(), key=lambda m: m.name):
                    if not member.isfile() or not _NAME.search(os.path.basename(member.name)):
                        continue
                    handle = tar.extractfile(member)
                    assert handle is not None
                    runs.extend(_runs_of(f"{path}:{member.name}", json.load(handle)))
        else:
            with open(path) as f:
                runs.extend(_runs_of(path, json.load(f)))
    return runs


def _runs_of(source: str, data: dict[str, Any]) -> list[dict[str, Any]]:
    if "interleaved" not in data:
        raise ValueError(f"{source}: not an --interleaved result (no 'interleaved' key)")
    match = _NAME.search(os.path.basename(source))
    variant = match["variant"] if match else os.path.splitext(os.path.basename(source))[0]
    rnd = int(match["round"]) if match else 0
    out = []
    for mode, result in data["interleaved"].items():
        if not all(q in result for q in QUANTITIES):
            raise ValueError(f"{source}: mode {mode} has no paired differences (too few pairs?)")
        out.append({"source": source, "variant": variant, "round": rnd, "mode": mode,
                    "result": result, "config": data.get("config", {})})  # fmt: skip
    return out


def row(run: dict[str, Any]) -> dict[str, Any]:
    """One run's numbers: per quantity its paired median and paired mean (µs a step), the
    tracer threads' CPU, the poll's build time a stage, the throughput ratio."""
    r = run["result"]
    out: dict[str, Any] = {k: run[k] for k in ("source", "variant", "round", "mode")}
    for q in QUANTITIES:
        out[q] = {"paired_median": r[q]["diff_median"], "paired_mean": r[q]["mean_diff_median"]}
    threads = r.get("helper_threads") or {}
    sections = threads.get("poll_sections") or {}
    out["poller_us"] = threads.get("poller_us_per_traced_step")
    out["flush_us"] = threads.get("flush_us_per_traced_step")
    stages = sections.get("stages") or 0
    out["build_us_per_stage"] = sections["build"] / stages / 1e3 if stages else None
    out["throughput_ratio"] = r["throughput_ratio"]["median"]
    return out


def pool(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Over ``rows``: per quantity, the median of the paired medians, the median and mean of the
    paired means with a 95 % t-interval of that mean (None for one run), min..max of each."""
    out: dict[str, Any] = {"runs": len(rows)}
    for q in QUANTITIES:
        medians = [r[q]["paired_median"] for r in rows]
        means = [r[q]["paired_mean"] for r in rows]
        mean = statistics.fmean(means)
        interval = None
        if len(means) >= 2:
            half = t95(len(means) - 1) * statistics.stdev(means) / math.sqrt(len(means))
            interval = [mean - half, mean + half]
        out[q] = {
            "median_of_paired_medians": statistics.median(medians),
            "paired_medians_range": [min(medians), max(medians)],
            "median_of_paired_means": statistics.median(means),
            "mean_of_paired_means": mean,
            "mean_ci95": interval,
            "paired_means_range": [min(means), max(means)],
        }
    return out


def _fmt_pool(name: str, pooled: dict[str, Any]) -> str:
    lines = [f"{name}: {pooled['runs']} runs (µs a step, traced − untraced)"]
    for q in QUANTITIES:
        p = pooled[q]
        ci = p["mean_ci95"]
        ci_s = f"[{ci[0]:+.1f}, {ci[1]:+.1f}]" if ci else "(one run)"
        lines.append(
            f"    {q:<8} paired medians: median {p['median_of_paired_medians']:+7.1f} "
            f"({p['paired_medians_range'][0]:+.1f}..{p['paired_medians_range'][1]:+.1f}); "
            f"paired means: median {p['median_of_paired_means']:+7.1f}, mean "
            f"{p['mean_of_paired_means']:+7.1f} {ci_s} "
            f"({p['paired_means_range'][0]:+.1f}..{p['paired_means_range'][1]:+.1f})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("paths", nargs="+", help="interleaved JSON files or .tgz archives of them")
    p.add_argument("--variants", default=None, help="comma list: keep only these variants")
    p.add_argument("--mode", default="trace", help="the traced mode to pool (default: trace)")
    p.add_argument("--json", default=None, help="write the rows and pools as JSON here")
    args = p.parse_args(argv)
    runs = [r for r in load_runs(args.paths) if r["mode"] == args.mode]
    if args.variants:
        keep = set(args.variants.split(","))
        runs = [r for r in runs if r["variant"] in keep]
    if not runs:
        raise SystemExit(f"no interleaved runs of mode {args.mode!r} in {args.paths}")
    rows = [row(r) for r in runs]
    print(f"{'run':<44} {'host med/mean':>15} {'cpu med/mean':>15} {'proc med/mean':>15} "
          f"{'poller':>7} {'flush':>6} {'build':>6} {'thr':>7}")  # fmt: skip
    for r in rows:
        label = f"{os.path.basename(r['source'].split(':')[0])}:{r['variant']}#{r['round']}"
        cells = " ".join(
            f"{r[q]['paired_median']:+7.1f}/{r[q]['paired_mean']:+7.1f}" for q in QUANTITIES
        )
        extra = " ".join(
            f"{v:>{w}.{d}f}" if v is not None else f"{'-':>{w}}"
            for v, w, d in ((r["poller_us"], 7, 1), (r["flush_us"], 6, 1),
                            (r["build_us_per_stage"], 6, 2), (r["throughput_ratio"], 7, 4))
        )  # fmt: skip
        print(f"{label:<44} {cells} {extra}")
    pools: dict[str, Any] = {}
    for variant in dict.fromkeys(r["variant"] for r in rows):
        pools[variant] = pool([r for r in rows if r["variant"] == variant])
        print(_fmt_pool(f"variant {variant}", pools[variant]))
    if len(pools) > 1:
        pools["all"] = pool(rows)
        print(_fmt_pool("all runs", pools["all"]))
    result = {"rows": rows, "pools": pools}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    try:
        main()
    except ValueError as exc:
        sys.exit(f"pool_interleaved: {exc}")
