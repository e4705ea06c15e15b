"""Structured output under async scheduling: does forward N+1 overlap the grammar work of N?

Runs the structured sample workload with async on (deferred sampling) and off and reads the grammar
numbers of each trace from ``stepscope analyze`` (``analyze_trace(path).headline``, every step but
the warm-up one, see ``analysis.grammar``): grammar CPU time (``grammar_mask_ms``), the share of it
under device work (``grammar_hidden_frac``), the share of masked steps whose device work began
before their ``grammar_mask`` ended (``grammar_overlap_steps_frac``), the grammar wait and its
exposed part (``grammar_wait_total_us`` / ``grammar_wait_exposed_us``); plus throughput. All
outputs are checked against their grammar (json / regex / choice).

Usage: python bench/bench_structured.py [--device cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time

from analysis import analyze_trace
from analysis.grammar import GRAMMAR_HEADLINE_KEYS
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
    headline = analyze_trace(path, window="all").headline
    pairs = list(zip(workload, outs, strict=True))
    errored = [o for _, o in pairs if o.finish_reason == "error"]  # invalid grammars, on purpose
    valid = [_valid(x.structured, o.text or "") for x, o in pairs if o.finish_reason != "error"]
    return {
        "async": async_on,
        "requests": len(outs),
        "errored": len(errored),
        "valid": f"{sum(valid)}/{len(valid)}",
        "tok_per_s": sum(len(o.output_token_ids) for o in outs) / elapsed,
        "overlap": headline["overlap"],
        **{k: headline[k] for k in GRAMMAR_HEADLINE_KEYS},
    }


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return str(value)


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
        print(f"{k:<40} " + "  ".join(f"{_cell(r[k]):>14}" for r in rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
