"""The tracer's added host time a step, matched step by step over runs of one deterministic workload.

``bench_trace_overhead.py --interleaved`` compares traced blocks with the untraced blocks next to
them. On a workload whose steps recur identically (every request of one length: the H200's
1024 × (128→128)), that comparison has two problems the mean of a run cannot escape:

* **the steps differ**: a step's host time spreads over ~2× with what it does (requests finishing
  together, new ones taking their slots), and with the fixed block order the same expensive
  steps fall into the same kind of block in every run. An A/A control (``--control``: tracing off
  in every block) then reads a "difference" of its own: +42 µs a step on average over six H200
  runs (session 21), more than the A/B runs read.
* **the host drifts**: a step's host time wanders by ±10 % over seconds (after the step effects
  are removed, the SD of 256-step means is still ~220 µs on the H200), so one run's interval on
  its mean is ±30–100 µs.

Runs saved with ``--save-samples`` hold every step; when they come from one deterministic workload
(the same steps, request counts and finishes at the same positions: checked, else an error), this
fits, over all of them together, host time = step effect + (run × block pair) effect + τ ×
traced, by least squares (both sets of effects removed by alternating projections): the step
effects take out what each step does, the run × pair effects the host's drift; τ is the tracer's
added µs a step. A/A control runs count as untraced everywhere (they sharpen the step effects).
τ is identified only where some step is traced in one run and not in another: runs with the
blocks in opposite orders (``--order-invert``, or other ``--order-seed`` values). The 95 %
interval resamples the (run, pair) clusters. The null: the same fit on the control runs alone,
their labels taken as recorded in odd rounds and inverted in even ones (any labels are a valid
null for runs that traced nothing; these vary across runs, as the fit needs); it should cover 0.

    python bench/step_matched.py bench/results/h200/core_ab_s21_samples.tgz
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pool_interleaved import load_runs  # noqa: E402 -- a sibling script's loader

QUANTITIES = ("host_us", "cpu_us")
STRUCTURE = ("steady", "num_reqs", "finished")  # what must match step by step across runs


def _check_structure(runs: list[dict[str, Any]]) -> None:
    first = runs[0]["result"]["samples"]
    for run in runs[1:]:
        samples = run["result"]["samples"]
        n = min(len(samples["steady"]), len(first["steady"]))
        for column in STRUCTURE:
            if samples[column][:n] != first[column][:n]:
                k = next(i for i in range(n) if samples[column][i] != first[column][i])
                raise ValueError(
                    f"{run['source']} differs from {runs[0]['source']} in {column} at step {k}: "
                    "not one deterministic workload (the same --num-requests, lengths, seeds)"
                )


def _rows(runs: list[dict[str, Any]], q: str, labels: str) -> np.ndarray:
    """[run, step, pair, traced, value] over the steady steps every run holds. ``labels``:
    "real" (a control run untraced everywhere) or "null" (control runs labelled by their
    pattern, inverted in even rounds)."""
    n = min(len(r["result"]["samples"]["steady"]) for r in runs)
    steady = np.ones(n, dtype=bool)
    for run in runs:
        steady &= np.asarray(run["result"]["samples"]["steady"][:n], dtype=bool)
    parts = []
    for i, run in enumerate(runs):
        s = run["result"]["samples"]
        traced = np.asarray(s["traced"][:n], dtype=bool)
        if labels == "null":
            traced = traced ^ (run["round"] % 2 == 0)
        elif run["control"]:
            traced = np.zeros(n, dtype=bool)
        k = np.flatnonzero(steady)
        parts.append(np.column_stack([
            np.full(len(k), i), k, np.asarray(s["block"][:n])[k] // 2, traced[k],
            np.asarray(s[q][:n], dtype=float)[k],
        ]))  # fmt: skip
    return np.concatenate(parts)


def _fit(rows: np.ndarray, tol: float = 1e-9, max_iter: int = 500) -> tuple[float, np.ndarray]:
    """τ of value ~ step + cluster + τ·traced, and each row's cluster id (run × pair)."""
    step = np.unique(rows[:, 1], return_inverse=True)[1]
    cluster = np.unique(rows[:, 0] * 1_000_000 + rows[:, 2], return_inverse=True)[1]
    n_step, n_cluster = np.bincount(step), np.bincount(cluster)

    def residual(v: np.ndarray) -> np.ndarray:
        v = v - v.mean()
        for _ in range(max_iter):
            before = v
            v = v - (np.bincount(step, v) / n_step)[step]
            v = v - (np.bincount(cluster, v) / n_cluster)[cluster]
            if np.max(np.abs(v - before)) <= tol * (1.0 + np.max(np.abs(v))):
                break
        return v

    t = residual(rows[:, 3])
    if float(t @ t) < 1e-6 * len(t):
        raise ValueError(
            "every run traced the same steps: the step effects absorb the tracer's. Add runs "
            "with the blocks the other way round (--order-invert) or another --order-seed"
        )
    return float(t @ residual(rows[:, 4]) / (t @ t)), cluster


def estimate(rows: np.ndarray, boot: int = 200, seed: int = 0) -> dict[str, Any]:
    """τ and its 95 % interval from ``boot`` resamples of the (run, pair) clusters."""
    tau, cluster = _fit(rows)
    members = [np.flatnonzero(cluster == c) for c in range(cluster.max() + 1)]
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(boot):
        pick = rng.integers(0, len(members), size=len(members))
        sample = rows[np.concatenate([members[c] for c in pick])].copy()
        # each pick its own cluster (a cluster drawn twice is two clusters)
        sample[:, 0] = np.repeat(np.arange(len(pick)), [len(members[c]) for c in pick])
        sample[:, 2] = 0
        try:
            draws.append(_fit(sample)[0])
        except ValueError:  # a resample without the contrast: skipped
            continue
    lo, hi = np.percentile(draws, [2.5, 97.5]) if draws else (float("nan"),) * 2
    runs = len(np.unique(rows[:, 0]))
    return {"tau": tau, "ci95": [float(lo), float(hi)], "runs": runs,
            "steps": int(len(np.unique(rows[:, 1]))), "clusters": len(members),
            "rows": int(len(rows)), "boot": len(draws)}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("paths", nargs="+", help="interleaved JSON files or .tgz archives of them, "
                   "written with --save-samples")  # fmt: skip
    p.add_argument("--variants", default=None, help="comma list: keep only these variants")
    p.add_argument("--mode", default="trace", help="the traced mode (default: trace)")
    p.add_argument("--boot", type=int, default=200, help="bootstrap resamples (default 200)")
    args = p.parse_args(argv)
    runs = [r for r in load_runs(args.paths) if r["mode"] == args.mode]
    if args.variants:
        keep = set(args.variants.split(","))
        runs = [r for r in runs if r["variant"] in keep]
    runs = [r for r in runs if "samples" in r["result"]]
    if not runs:
        raise SystemExit("no run with saved samples (bench_trace_overhead.py --save-samples)")
    for run in runs:
        run["control"] = bool(run.get("config", {}).get("control"))
    _check_structure(runs)
    controls = [r for r in runs if r["control"]]
    print(
        f"{len(runs)} runs of one workload ({len(controls)} A/A controls): "
        + ", ".join(f"{r['variant']}#{r['round']}" for r in runs)
    )
    out: dict[str, Any] = {}
    for q in QUANTITIES:
        out[q] = {"tracer": estimate(_rows(runs, q, "real"), args.boot)}
        e = out[q]["tracer"]
        print(f"  {q:<8} tracer adds {e['tau']:+7.1f} us a step, 95% [{e['ci95'][0]:+.1f}, "
              f"{e['ci95'][1]:+.1f}] ({e['runs']} runs, {e['steps']} steps, {e['clusters']} "
              "run x pair clusters)")  # fmt: skip
        if len(controls) >= 2:
            out[q]["null"] = n = estimate(_rows(controls, q, "null"), args.boot)
            print(f"  {q:<8} A/A null    {n['tau']:+7.1f} us a step, 95% [{n['ci95'][0]:+.1f}, "
                  f"{n['ci95'][1]:+.1f}] ({n['runs']} control runs)")  # fmt: skip
    return out


if __name__ == "__main__":
    try:
        main()
    except ValueError as exc:
        sys.exit(f"step_matched: {exc}")
