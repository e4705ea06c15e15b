"""Structured output under async scheduling: does forward N+1 overlap the grammar work of N?

Runs the structured sample workload with async on (deferred sampling) and off and reads the grammar
numbers of each trace from ``stepscope analyze`` (``analyze_trace(path).headline``, every step but
the warm-up one, see ``analysis.metrics.grammar``): grammar CPU time (``grammar_mask_ms``), the share of it
under device work (``grammar_hidden_frac``), the share of masked steps whose device work began
before their ``grammar_mask`` ended (``grammar_overlap_steps_frac``), the grammar wait and its
exposed part (``grammar_wait_total_us`` / ``grammar_wait_exposed_us``); plus throughput. All
outputs are checked against their grammar (json / regex / choice).

Usage: python bench/bench_structured.py [--device cuda] [--json out.json]
       [--model-config qwen3-0.6b --tokenizer samples/models/pycoder-14m --repeat 8]
(a Qwen3-0.6B-shaped model with random weights gives the GPU a forward long enough to hide the
grammar work under; the sample model's forward is shorter than one output round trip)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import tempfile
import time

from analysis import analyze_trace
from analysis.metrics.grammar import GRAMMAR_HEADLINE_KEYS
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


def _workload(args: argparse.Namespace) -> list:
    """The workload file, ``--repeat`` times over (copies get their own ids)."""
    base = load_workload(args.workload)
    return [dataclasses.replace(w, id=f"{w.id}#{k}") for k in range(args.repeat) for w in base]


def _llm(args: argparse.Namespace, async_on: bool, tracer: Tracer | None) -> LLM:
    source = (
        {"model_config": args.model_config, "random_weights": True, "tokenizer": args.tokenizer}
        if args.model_config
        else {"model": args.model, "tokenizer": args.tokenizer}
    )
    return LLM(
        tracer=tracer,
        trace_requests=False,
        device=args.device,
        dtype=args.dtype,
        async_scheduling=async_on,
        max_num_seqs=args.max_num_seqs,
        **source,
    )


def run(async_on: bool, args: argparse.Namespace, tmp: str) -> tuple[dict, list]:
    path = os.path.join(tmp, f"structured_async_{async_on}.pftrace")
    workload = _workload(args)
    tracer = Tracer(path)
    llm = _llm(args, async_on, tracer)
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
        "steps": headline["window"].get("num_steps"),
        "requests": len(outs),
        "errored": len(errored),
        "valid": f"{sum(valid)}/{len(valid)}",
        "tok_per_s": sum(len(o.output_token_ids) for o in outs) / elapsed,
        "overlap": headline["overlap"],
        **{k: headline[k] for k in GRAMMAR_HEADLINE_KEYS},
    }, outs


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return str(value)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="samples/models/pycoder-14m")
    p.add_argument("--model-config", default=None, help="a shape with random weights instead")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (with --model-config)")
    p.add_argument("--repeat", type=int, default=1, help="copies of the workload in one run")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--workload", default="samples/workloads/structured.jsonl")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="stepscope-structured-")
    # Warm-up (kernels compiled, graphs captured) so neither measured run pays for it.
    warm = _llm(args, True, None)
    warm.run_workload(_workload(args)[:4])
    warm.close()
    (off, off_outs), (on, on_outs) = run(False, args, tmp), run(True, args, tmp)
    same = sum(
        a.output_token_ids == b.output_token_ids for a, b in zip(off_outs, on_outs, strict=True)
    )
    off["same_tokens_as_async_off"] = on["same_tokens_as_async_off"] = f"{same}/{len(on_outs)}"
    rows = [off, on]
    keys = list(rows[0])
    for k in keys:
        print(f"{k:<40} " + "  ".join(f"{_cell(r[k]):>14}" for r in rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
