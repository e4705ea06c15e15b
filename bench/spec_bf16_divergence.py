"""Why speculative runs emit other tokens than the run without speculation in bf16 (not in fp32).

Two checks on the engine's own model code (engine.model, paged KV, the kernels of ``--device``):

1. **Shape**: for each sample prompt, the logits of its last token computed in a 1-token step
   (decode) and as the first row of a 4-token step (verify with k = 3: the token and three more),
   after the same prefill of the rest. Causal attention makes the two mathematically equal; in
   bf16 the matmuls of a 1-row and a 4-row input round differently. Reported: max |Δ logit| and
   whether the argmax flips, in bf16 and fp32.
2. **Near-ties**: the engine runs the prompts greedy without speculation and with EAGLE (k = 3) in
   bf16; for every request whose tokens differ, the two candidate tokens at the first differing
   position are scored by the fp32 model on the common prefix: their logit gap, set against the
   median top-1/top-2 gap over every position of the run.

Usage: python bench/spec_bf16_divergence.py [--device cpu] [--limit 16] [--max-tokens 48] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from typing import Any

import torch

from engine.llm import LLM
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import load_model
from engine.model.paged_batch import build_attention_metadata
from engine.workload import load_workload

TARGET = "samples/models/pycoder-14m"
EAGLE = "samples/models/pycoder-14m-eagle"
BLOCK = 16


def step_logits(
    model: LlamaForCausalLM, device: str, prefix: list[int], query: list[int]
) -> torch.Tensor:
    """Logits ``[len(query), vocab]`` (fp32) of ``query`` after a one-step prefill of ``prefix``."""
    blocks = -(-(len(prefix) + len(query)) // BLOCK)
    kv = model.allocate_kv_caches(blocks, BLOCK)
    table = [list(range(blocks))]
    out = None
    with torch.no_grad():
        for done, ids in ((0, prefix), (len(prefix), query)):
            meta, pos = build_attention_metadata([done], [len(ids)], table, BLOCK, device)
            hidden = model(torch.tensor(ids, device=device), pos, meta, kv)
            out = model.compute_logits(hidden).float()
    assert out is not None
    return out


def shape_check(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """Check 1 per dtype: max |Δ logit| decode vs verify row 0, and argmax flips."""
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        model, _ = load_model(args.model, dtype, args.device)
        diffs, flips = [], 0
        for ids in prompts:
            prefix, last = ids[:-1], ids[-1]
            decode = step_logits(model, args.device, prefix, [last])[0]
            verify = step_logits(model, args.device, prefix, [last, *ids[-4:-1]])[0]
            diffs.append(float((decode - verify).abs().max()))
            flips += int(decode.argmax() != verify.argmax())
        out[str(dtype).removeprefix("torch.")] = {
            "max_abs_logit_diff_max": max(diffs),
            "max_abs_logit_diff_median": statistics.median(diffs),
            "num_differing": sum(d > 0 for d in diffs),
            "argmax_flips": flips,
            "num_prompts": len(prompts),
        }
    return out


def run_tokens(args: argparse.Namespace, spec: dict[str, Any]) -> dict[str, list[int]]:
    workload = [
        dataclasses.replace(
            w,
            arrival_time_s=0.0,
            params=dataclasses.replace(w.params, temperature=0.0, max_tokens=args.max_tokens),
        )
        for w in load_workload(args.workload)[: args.limit]
    ]
    llm = LLM(model=args.model, device=args.device, dtype="bfloat16", **spec)
    outs = llm.run_workload(workload)
    llm.close()
    return {o.id: list(o.output_token_ids) for o in outs}


def near_tie_check(args: argparse.Namespace, prompts: dict[str, list[int]]) -> dict[str, Any]:
    """Check 2: fp32 logit gaps of the two candidates where the bf16 runs first differ."""
    none = run_tokens(args, {})
    eagle = run_tokens(args, {"spec_method": "eagle", "spec_model": EAGLE, "num_spec_tokens": 3})
    model, _ = load_model(args.model, torch.float32, args.device)
    gaps, top_gaps = [], []
    for rid, a in none.items():
        b = eagle[rid]
        context = prompts[rid] + a
        with torch.no_grad():
            logits = step_logits(model, args.device, context[:1], context[1:])  # every position
        first = len(prompts[rid]) - 2  # the row whose logits chose output token 0
        top2 = logits[first : first + len(a)].topk(2, dim=-1).values
        top_gaps += (top2[:, 0] - top2[:, 1]).tolist()
        p = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if p is None:
            continue
        row = logits[first + p]
        gaps.append({"request": rid, "position": p, "fp32_gap": float(row[a[p]] - row[b[p]])})
    return {
        "num_requests": len(none),
        "num_differing": len(gaps),
        "divergences": gaps,
        "median_top2_gap_fp32": statistics.median(top_gaps) if top_gaps else None,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=TARGET)
    p.add_argument("--workload", default="samples/workloads/pycode_prompts.jsonl")
    p.add_argument("--device", default="cpu")
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    llm_tok = LLM(model=args.model, device=args.device, dtype="float32").tokenizer
    prompts = {
        w.id: list(w.prompt_token_ids or llm_tok.encode(w.prompt))
        for w in load_workload(args.workload)[: args.limit]
    }
    shape = shape_check(args, [ids for ids in prompts.values() if len(ids) >= 5])
    for dtype, r in shape.items():
        print(
            f"{dtype}: decode vs verify row 0, same token: max |Δ logit| median "
            f"{r['max_abs_logit_diff_median']:.2g}, max {r['max_abs_logit_diff_max']:.2g} "
            f"(non-zero for {r['num_differing']}/{r['num_prompts']} prompts); "
            f"argmax flips {r['argmax_flips']}/{r['num_prompts']}"
        )
    ties = near_tie_check(args, prompts)
    print(
        f"bf16 engine, none vs eagle k=3: {ties['num_differing']}/{ties['num_requests']} requests "
        f"differ; median fp32 top-1/top-2 gap over all positions {ties['median_top2_gap_fp32']:.3f}"
    )
    for d in ties["divergences"]:
        print(
            f"  {d['request']}: first differs at output {d['position']}, fp32 gap of the two tokens {d['fp32_gap']:+.4f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": shape, "near_ties": ties, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
