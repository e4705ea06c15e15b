"""Structured output under async scheduling: does forward N+1 overlap the grammar work of N?

Runs the structured sample workload with async on (deferred sampling) and off, then measures from
each trace: the share of grammar CPU time (``grammar_mask`` slices) during which the device was
busy, the share of steps whose device work started before their ``grammar_mask`` ended, the
exposed grammar wait (``wait_output(kind=grammar)`` while the device idles), and throughput.
All outputs are checked against their grammar (json / regex / choice).

Usage: python bench/bench_structured.py [--device cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time

import numpy as np

from analysis import load_trace
from analysis.intervals import intersect_measure, measure, union
from engine.llm import LLM
from engine.workload import load_workload
from instrument.tracer import Tracer


def _valid(spec: dict | None, text: str) -> bool:
    if spec is None:
        return True
    body = text.split("<|endoftext|>")[0]
    if "json_schema" in spec:
        try:
            return isinstance(json.loads(body), dict)
        except ValueError:
            return False
    if "regex" in spec:
        return re.fullmatch(spec["regex"], body) is not None
    return body in spec.get("choice", [])


def run(async_on: bool, args: argparse.Namespace, tmp: str) -> dict:
    path = os.path.join(tmp, f"structured_async_{async_on}.pftrace")
    workload = load_workload(args.workload)
    tracer = Tracer(path)
    llm = LLM(
        tracer=tracer,
        trace_requests=False,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        async_scheduling=async_on,
    )
    start = time.monotonic()
    outs = llm.run_workload(workload)
    elapsed = time.monotonic() - start
    llm.close()
    tracer.close()
    sl = load_trace(path).slices
    comp = sl[sl["role"] == "compute"]
    busy = union(comp["ts_ns"].to_numpy(), comp["end_ns"].to_numpy())
    grammar = sl[sl["name"] == "grammar_mask"]
    g = union(grammar["ts_ns"].to_numpy(), grammar["end_ns"].to_numpy())
    g_total = measure(g)
    g_hidden = int(intersect_measure(g[0], g[1], busy).sum())
    dev_start = comp.groupby("step")["ts_ns"].min()
    early = [int(dev_start.get(r.step, 1 << 62) < r.end_ns) for r in grammar.itertuples()]
    waits = sl[(sl["name"] == "wait_output") & (sl["kind"] == "grammar")]
    w = union(waits["ts_ns"].to_numpy(), waits["end_ns"].to_numpy())
    w_total = measure(w)
    w_hidden = int(intersect_measure(w[0], w[1], busy).sum())
    pairs = list(zip(workload, outs, strict=True))
    errored = [o for _, o in pairs if o.finish_reason == "error"]  # invalid grammars, on purpose
    valid = [_valid(x.structured, o.text or "") for x, o in pairs if o.finish_reason != "error"]
    return {
        "async": async_on,
        "requests": len(outs),
        "errored": len(errored),
        "valid": f"{sum(valid)}/{len(valid)}",
        "tok_per_s": sum(len(o.output_token_ids) for o in outs) / elapsed,
        "grammar_ms": g_total / 1e6,
        "grammar_hidden_frac": g_hidden / g_total if g_total else None,
        "steps_device_started_before_mask_end": float(np.mean(early)) if early else None,
        "grammar_wait_ms": w_total / 1e6,
        "grammar_wait_exposed_ms": (w_total - w_hidden) / 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="samples/models/pycoder-14m")
    p.add_argument("--workload", default="samples/workloads/structured.jsonl")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="stepscope-structured-")
    rows = [run(False, args, tmp), run(True, args, tmp)]
    keys = list(rows[0])
    for k in keys:
        print(f"{k:<40} " + "  ".join(f"{r[k]!s:>14}" for r in rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
