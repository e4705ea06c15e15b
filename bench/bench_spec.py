"""Speculative decoding on the sample models: acceptance, speedup, and accepted-count wait exposure.

For each proposer (none, ngram, draft, eagle, mtp) runs the same workload (greedy, so every run
emits the same tokens) with async scheduling, then EAGLE again with ``spec_sync_accepted`` (the
CPU waits for accepted counts before preparing the next step). Prints acceptance rate (accepted /
drafted, from the trace's ``update_from_output`` args), output tok/s, speedup over no
speculation, and the exposed/hidden accepted-count wait from the analysis.

Usage: python bench/bench_spec.py [--device cuda] [--k 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time

from analysis import analyze_trace
from engine.llm import LLM
from engine.workload import load_workload
from instrument.tracer import Tracer

MODELS = "samples/models"
TARGET = f"{MODELS}/pycoder-14m"
SPEC_MODELS = {
    "ngram": None,
    "draft": f"{MODELS}/pycoder-draft-2m",
    "eagle": f"{MODELS}/pycoder-14m-eagle",
    "mtp": f"{TARGET}/mtp",
}


def run_one(method: str | None, sync_accepted: bool, args: argparse.Namespace, tmp: str) -> dict:
    tag = f"{method or 'none'}{'-sync' if sync_accepted else ''}"
    path = os.path.join(tmp, f"spec_{tag}.pftrace")
    workload = [
        dataclasses.replace(
            w, arrival_time_s=0.0, params=dataclasses.replace(w.params, temperature=0.0)
        )
        for w in load_workload(args.workload)[: args.limit]
    ]
    spec = {}
    if method is not None:
        spec = {
            "spec_method": method,
            "spec_model": SPEC_MODELS[method],
            "num_spec_tokens": args.k,
            "spec_sync_accepted": sync_accepted,
        }
    tracer = Tracer(path)
    llm = LLM(
        tracer=tracer,
        trace_requests=False,
        model=args.target,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        **spec,
    )
    llm.run_workload([dataclasses.replace(w, id=f"warm-{w.id}") for w in workload[:4]])
    start = time.monotonic()
    outs = llm.run_workload(workload)
    elapsed = time.monotonic() - start
    llm.close()
    tracer.close()
    report = analyze_trace(path)
    steps = report.frames.slices
    upd = steps[steps["name"] == "update_from_output"]
    accepted = int(upd["num_accepted"].fillna(0).sum()) if "num_accepted" in upd else 0
    rejected = int(upd["num_rejected"].fillna(0).sum()) if "num_rejected" in upd else 0
    h = report.headline
    return {
        "run": tag,
        "tokens": sum(len(o.output_token_ids) for o in outs),
        "elapsed_s": elapsed,
        "tok_per_s": sum(len(o.output_token_ids) for o in outs) / elapsed,
        "acceptance": accepted / (accepted + rejected) if accepted + rejected else None,
        "overlap": h.get("overlap"),
        "wait_accepted_exposed_us": h.get("wait_accepted_exposed_us"),
        "wait_accepted_hidden_us": h.get("wait_accepted_hidden_us"),
        "outputs": {o.id: o.output_token_ids for o in outs},
        "trace": path,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", default=TARGET)
    p.add_argument("--workload", default="samples/workloads/pycode_prompts.jsonl")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--methods", default="ngram,draft,eagle,mtp")
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="stepscope-spec-")
    methods = [m for m in args.methods.split(",") if m]
    rows = [run_one(None, False, args, tmp)] + [run_one(m, False, args, tmp) for m in methods]
    if "eagle" in methods:
        rows.append(run_one("eagle", True, args, tmp))
    base = rows[0]
    print(
        f"{'run':<12} {'accept':>7} {'tok/s':>9} {'speedup':>7} {'overlap':>7} "
        f"{'exposed us':>11} {'hidden us':>10} {'same tokens':>11}"
    )
    for r in rows:
        acc = f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "-"
        ov = r["overlap"] if r["overlap"] is not None else float("nan")
        print(
            f"{r['run']:<12} {acc:>7} {r['tok_per_s']:>9.1f} {r['tok_per_s'] / base['tok_per_s']:>7.2f} "
            f"{ov:>7.2f} {r['wait_accepted_exposed_us'] or 0:>11.0f} "
            f"{r['wait_accepted_hidden_us'] or 0:>10.0f} {str(r['outputs'] == base['outputs']):>11}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "outputs"} for r in rows], f, indent=2)


if __name__ == "__main__":
    main()
