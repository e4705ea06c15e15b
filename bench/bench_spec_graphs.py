"""Speculative graphs end to end (issue 19): output tok/s of each proposer with the forward,
verify and draft graphs (``spec_cuda_graphs``) against no speculation, on the sample models.

The lead's H200 workload: ``samples/workloads/pycode_prompts.jsonl`` repeated ``--repeat`` times,
greedy, ``--max-tokens`` each, all arriving at 0, ``--max-num-seqs`` 64, bf16, warm-up on. Each
run is its own engine (start-up and warm-up excluded from the timing); runs go in the order given
by ``--runs`` (``METHOD`` = graphs on, ``METHOD-eager`` = ``spec_cuda_graphs`` off,
``METHOD-sync`` = ``--spec-sync-accepted``, ``none`` = no speculation). Per run it prints tok/s,
the speedup over the first ``none`` run, acceptance (accepted / drafted), how many speculative
steps replayed graphs / ran eagerly, and the share of requests whose tokens equal the ``none``
run's (with bf16 a few differ: the padded and the unpadded batch round differently).

Usage: python bench/bench_spec_graphs.py [--device cuda] [--dtype bfloat16] [--repeat 8]
       [--runs none,eagle,mtp,draft,ngram,eagle-sync,eagle-eager] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

from engine.llm import LLM
from engine.workload import WorkloadRequest, load_workload

MODELS = "samples/models"
TARGET = f"{MODELS}/pycoder-14m"
SPEC_MODELS = {
    "ngram": None,
    "draft": f"{MODELS}/pycoder-draft-2m",
    "eagle": f"{MODELS}/pycoder-14m-eagle",
    "mtp": f"{TARGET}/mtp",
}


def workload(args: argparse.Namespace) -> list[WorkloadRequest]:
    """The prompts repeated, greedy, ``max_tokens`` each, every one arriving at 0."""
    base = load_workload(args.workload)
    out = []
    for r in range(args.repeat):
        for w in base:
            params = dataclasses.replace(w.params, temperature=0.0, max_tokens=args.max_tokens)
            out.append(dataclasses.replace(w, id=f"{w.id}-{r}", arrival_time_s=0.0, params=params))
    return out


def run_one(name: str, args: argparse.Namespace, requests: list[WorkloadRequest]) -> dict[str, Any]:
    method, _, variant = name.partition("-")
    kwargs: dict[str, Any] = {}
    if method != "none":
        kwargs = dict(spec_method=method, spec_model=SPEC_MODELS[method], num_spec_tokens=args.k)
        kwargs["spec_sync_accepted"] = variant == "sync"
        kwargs["spec_cuda_graphs"] = False if variant == "eager" else None
    start = time.monotonic()
    llm = LLM(
        model=args.target,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        **kwargs,
    )
    startup_s = time.monotonic() - start
    drafted = accepted = 0
    update = llm.engine._update

    def counting_update(so: Any, out: Any) -> Any:
        nonlocal drafted, accepted
        outputs = update(so, out)
        drafted += sum(o.num_draft_tokens for o in outputs)
        accepted += sum(o.num_accepted for o in outputs)
        return outputs

    llm.engine._update = counting_update
    start = time.monotonic()
    outs = llm.run_workload(requests)
    elapsed = time.monotonic() - start
    graphs = llm.engine.runner.spec_graphs
    decision = {d.feature: d for d in llm.engine.features.decisions}.get("spec_cuda_graphs")
    llm.close()
    tokens = sum(len(o.output_token_ids) for o in outs)
    return {
        "run": name,
        "startup_s": startup_s,
        "elapsed_s": elapsed,
        "tokens": tokens,
        "tok_per_s": tokens / elapsed,
        "acceptance": accepted / drafted if drafted else None,
        "graph_steps": graphs.num_replays,
        "eager_spec_steps": graphs.num_eager,
        "spec_graph_buckets": graphs.describe(),
        "spec_cuda_graphs": None if decision is None else f"{decision.resolved}: {decision.reason}",
        "outputs": {o.id: o.output_token_ids for o in outs},
    }


def same_share(a: dict[str, list[int]], b: dict[str, list[int]]) -> float:
    return sum(a[k] == b.get(k) for k in a) / max(len(a), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", default=TARGET)
    p.add_argument("--workload", default="samples/workloads/pycode_prompts.jsonl")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=8)
    p.add_argument("--runs", default="none,eagle,mtp,draft,ngram,eagle-sync")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: sized at start-up")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    requests = workload(args)
    rows = []
    for name in [r for r in args.runs.split(",") if r]:
        row = run_one(name, args, requests)
        rows.append(row)
        print(f"{name}: {row['tok_per_s']:.0f} tok/s ({row['spec_cuda_graphs']})", flush=True)
    base = next((r for r in rows if r["run"] == "none"), rows[0])
    print(f"\n{len(requests)} requests x {args.max_tokens} tokens, {args.dtype}, k = {args.k}")
    print(
        f"{'run':<12} {'tok/s':>8} {'vs none':>7} {'accept':>7} {'graph':>6} {'eager':>6} "
        f"{'same':>5} {'start s':>7}"
    )
    for r in rows:
        acc = f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "-"
        print(
            f"{r['run']:<12} {r['tok_per_s']:>8.0f} {r['tok_per_s'] / base['tok_per_s']:>7.2f} "
            f"{acc:>7} {r['graph_steps']:>6} {r['eager_spec_steps']:>6} "
            f"{same_share(r['outputs'], base['outputs']):>5.2f} {r['startup_s']:>7.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "outputs"} for r in rows], f, indent=2)


if __name__ == "__main__":
    main()
