"""Speculative decoding on the sample models, warm and alternated: speed, acceptance, output
waits and tokens against the run without speculation.

Every variant (``none``, then each proposer at its k, and EAGLE with ``--spec-sync-accepted``)
gets one engine and one trace, built once and reused by every pass. On CUDA the engine warms
itself (engine/warmup.py: every decode size, mixed-step bucket, sampling variant, verify and draft
path); then each engine runs one untimed pass of the workload (``--warm-repeat`` copies of the
sample prompts). The measured workload is ``--repeat`` copies of the 64 sample prompts (greedy,
all arriving at once, ``--max-tokens`` each, fresh request ids per copy); without ``--repeat`` it
is sized from the untimed passes so that the fastest variant's run lasts ``--min-run-s`` (with a
1.25x margin: the untimed passes' speeds are rough). Rounds alternate every variant
``--rounds`` times in this process (the order rotates each round); each round's output tok/s is
divided by the no-speculation run of the same round. The rounds run with the tracer muted
(``--traced extra``, the default: speed as ``stepscope run`` without ``--trace``); then one
traced pass per variant (a quarter of the workload) gives the trace's numbers below and
its own tok/s, printed apart (``--traced every``: every round traced, as before).

Per variant: output tok/s and its ratio to ``none`` (median, min..max over rounds), acceptance
(accepted / drafted), output tokens per request per target step, the exposed wait for step output
per step (device idle while the host waited in ``wait_output``: kind ``accepted_count`` with
``--spec-sync-accepted``, ``sampled`` otherwise; docs/design.md §5.5), and the tokens against
``none`` (share of identical sequences, first-divergence position). In float32 (or with
``--check-tokens``) any difference from ``none`` exits 1.

Usage: python bench/bench_spec.py [--device cuda] [--dtype bfloat16] [--variants ...]
       [--pick-k ngram=1,2,3] [--rounds 3] [--min-run-s 10 | --repeat N] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from analysis.compare import compare_output_waits, exposed_wait_line
from bench._spec_engines import TARGET, PassRecord, SpecEngine, Variant, parse_variants
from bench._spec_summary import analyse_passes, divergence, first_difference, summarise_variant
from engine.workload import WorkloadRequest, load_workload

DEFAULT_VARIANTS = "none,ngram:1,draft:2,eagle:3,mtp:3,eagle:3:sync"


def base_workload(args: argparse.Namespace) -> list[WorkloadRequest]:
    """The sample prompts, greedy, all at time 0, ``--max-tokens`` output tokens each."""
    return [
        dataclasses.replace(
            w,
            arrival_time_s=0.0,
            params=dataclasses.replace(
                w.params, temperature=0.0, max_tokens=args.max_tokens, seed=None
            ),
        )
        for w in load_workload(args.workload)[: args.limit]
    ]


def copies(base: list[WorkloadRequest], n: int, label: str) -> list[WorkloadRequest]:
    """``n`` copies of ``base`` with fresh ids ``<label>-c<copy>-<id>`` (the same ids on every
    variant of one round, so their tokens can be compared request by request)."""
    return [dataclasses.replace(w, id=f"{label}-c{c}-{w.id}") for c in range(n) for w in base]


def build(
    args: argparse.Namespace, v: Variant, trace_dir: str, base: list[WorkloadRequest]
) -> SpecEngine:
    e = SpecEngine(
        v,
        trace_dir,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        batch_invariant=args.batch_invariant,
    )
    # untraced like the rounds it sizes (--traced extra)
    warm = e.run("warm", copies(base, args.warm_repeat, "warm"), traced=args.traced == "every")
    print(
        f"  {v.name:<16} built + warmed up in {e.build_s:6.1f} s; untimed pass "
        f"{warm.output_tokens} tokens in {warm.elapsed_s:6.2f} s ({warm.tok_s:,.0f} tok/s)",
        flush=True,
    )
    return e


def pick_k(
    args: argparse.Namespace, variants: list[Variant], trace_dir: str, base: list[WorkloadRequest]
) -> tuple[list[Variant], dict[str, Any], dict[Variant, SpecEngine]]:
    """``--pick-k METHOD=K1,K2,...``: each candidate k runs the untimed pass; the fastest one
    replaces the method's k in ``variants`` (its sync variant too). Returns the variants, what
    was tried, and the kept engines."""
    tried: dict[str, Any] = {}
    kept: dict[Variant, SpecEngine] = {}
    for item in args.pick_k:
        method, _, ks = item.partition("=")
        cands = {}
        for k in [int(x) for x in ks.split(",") if x]:
            e = build(args, Variant(method, k), trace_dir, base)
            cands[k] = e
        best = max(cands, key=lambda k: cands[k].passes[0].tok_s)
        tried[method] = {"tok_s": {k: e.passes[0].tok_s for k, e in cands.items()}, "chose": best}
        for k, e in cands.items():
            if k == best:
                kept[e.variant] = e
            else:
                e.close()
        variants = [dataclasses.replace(v, k=best) if v.method == method else v for v in variants]
    return list(dict.fromkeys(variants)), tried, kept


RUN_MARGIN = 1.25


def measured_repeat(args: argparse.Namespace, engines: list[SpecEngine]) -> tuple[int, str]:
    """``--repeat``, or the copies that make the fastest variant's run last ``--min-run-s``
    (from the untimed passes' tok/s and tokens per copy), lowered where ``--time-budget-s``
    cannot hold every round at that size; returns it and how it was chosen."""
    if args.repeat:
        return args.repeat, "--repeat"
    warm = [e.passes[0] for e in engines]
    per_copy = max(p.output_tokens for p in warm) / args.warm_repeat
    # The untimed passes are short, so their tok/s is rough (on the H200 a timed run went up to
    # 1.06x of the fastest untimed pass, another 1.5x of its own): size for 1.25x of the fastest.
    need = math.ceil(RUN_MARGIN * args.min_run_s * max(p.tok_s for p in warm) / per_copy)
    how = f"fastest untimed pass {max(p.tok_s for p in warm):,.0f} tok/s x {RUN_MARGIN:g} x {args.min_run_s:g} s"
    if args.time_budget_s:
        round_s_per_copy = sum(per_copy / p.tok_s for p in warm)
        fits = math.floor(args.time_budget_s / (args.rounds * round_s_per_copy))
        if fits < need:
            need = fits
            how += f"; LOWERED to fit --time-budget-s {args.time_budget_s:g}: runs shorter than {args.min_run_s:g} s"
    if need > args.max_repeat:
        how += f"; CAPPED at --max-repeat {args.max_repeat}: runs shorter than {args.min_run_s:g} s"
        need = args.max_repeat
    return max(1, need), how


def run_rounds(
    args: argparse.Namespace,
    engines: list[SpecEngine],
    repeat: int,
    base: list[WorkloadRequest],
    out: dict[str, Any],
) -> dict[str, list[dict[str, Any]]]:
    """Every variant once per round, the order rotated each round; JSON rewritten after each."""
    rows: dict[str, list[dict[str, Any]]] = {e.variant.name: [] for e in engines}
    for r in range(args.rounds):
        workload = copies(base, repeat, f"r{r}")
        order = engines[r % len(engines) :] + engines[: r % len(engines)]
        for e in order:
            wall_start = time.time()
            p = e.run(f"round {r + 1}", workload, traced=args.traced == "every")
            rows[e.variant.name].append(
                {
                    "round": r + 1,
                    # epoch seconds: to line the pass up with the GPU clock log (h200_session.sh)
                    "wall_start": wall_start,
                    "wall_end": time.time(),
                    "tok_s": p.tok_s,
                    "elapsed_s": p.elapsed_s,
                    "output_tokens": p.output_tokens,
                }
            )
            print(
                f"  round {r + 1}/{args.rounds} {e.variant.name:<16} {p.tok_s:>10,.0f} tok/s  {p.elapsed_s:6.2f} s",
                flush=True,
            )
        none_tok_s = rows["none"][-1]["tok_s"]
        for name in rows:
            rows[name][-1]["ratio_to_none"] = rows[name][-1]["tok_s"] / none_tok_s
        out["rounds_done"] = r + 1
        write_json(args, out | {"rounds": rows})
    return rows


def traced_pass(
    args: argparse.Namespace, engines: list[SpecEngine], repeat: int, base: list[WorkloadRequest]
) -> dict[str, dict[str, Any]]:
    """``--traced extra``: after the untraced rounds, one traced pass per variant (a quarter of
    the measured workload) for the trace's numbers; its tok/s is the traced speed."""
    workload = copies(base, max(1, repeat // 4), "traced")
    out: dict[str, dict[str, Any]] = {}
    for e in engines:
        p = e.run("traced", workload, traced=True)
        out[e.variant.name] = {
            "tok_s": p.tok_s,
            "elapsed_s": p.elapsed_s,
            "output_tokens": p.output_tokens,
        }
        print(
            f"  traced pass {e.variant.name:<16} {p.tok_s:>10,.0f} tok/s  {p.elapsed_s:6.2f} s",
            flush=True,
        )
    for row in out.values():
        row["ratio_to_none"] = row["tok_s"] / out["none"]["tok_s"]
    return out


def _traced_passes(e: SpecEngine) -> list[PassRecord]:
    """The passes the trace holds: the traced pass where there is one, else the rounds."""
    extra = [p for p in e.passes if p.label == "traced"]
    return extra or [p for p in e.passes if p.label.startswith("round")]


def add_trace_metrics(
    engines: list[SpecEngine], rows: dict[str, list[dict[str, Any]]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Close every engine, then analyse each traced pass's steps in its trace (one worker
    process per trace): the measured rounds (``--traced every``) or the one traced pass
    (``extra``: ``rows`` are then that pass's, one per variant). Returns the untimed passes'
    build time and tok/s by variant, and per sync variant ``stepscope compare``'s exposed-wait
    comparison of its first traced pass against the same method and k without sync."""
    for e in engines:
        e.close()
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds a CUDA context
    workers = max(1, min(len(engines), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        jobs = {
            e.variant: pool.submit(
                analyse_passes,
                e.trace_path,
                [dataclasses.replace(p, tokens={}) for p in _traced_passes(e)],
            )
            for e in engines
        }
        for v, job in jobs.items():
            for row, metrics in zip(rows[v.name], job.result(), strict=True):
                row |= metrics
    warm = {e.variant.name: {"build_s": e.build_s, "tok_s": e.passes[0].tok_s} for e in engines}
    pairs = {}
    for v in jobs:
        other = dataclasses.replace(v, sync=False)
        if v.sync and other in jobs:
            cmp = compare_output_waits(
                rows[v.name][0]["output_wait"], rows[other.name][0]["output_wait"]
            )
            pairs[f"{v.name} vs {other.name}"] = cmp | {"line": exposed_wait_line(cmp)}
    return warm, pairs


def token_agreement(engines: list[SpecEngine]) -> dict[str, Any]:
    """Per variant against ``none``, round by round: :func:`divergence` of the first round (the
    rounds repeat one workload), the worst identical share over rounds, and whether the variant
    gave the same tokens in every round."""

    def measured(e: SpecEngine) -> list[PassRecord]:
        return [p for p in e.passes[1:] if p.label.startswith("round")]

    ref = measured(engines[0])
    out = {}
    for e in engines[1:]:
        mine = measured(e)
        per_round = [divergence(a.tokens, b.tokens) for a, b in zip(ref, mine, strict=True)]
        stable = all(list(p.tokens.values()) == list(mine[0].tokens.values()) for p in mine[1:])
        out[e.variant.name] = {
            **per_round[0],
            "identical_share_min": min(d["identical_share"] for d in per_round),
            "same_tokens_every_round": stable,
        }
    return out


# A divergence counts as a near-tie when the run without speculation chose between its two
# most likely tokens by at most this logit gap: float32 logits of one token computed in steps of
# different shapes (a 1-row decode, a (1 + k)-row verify) differed by up to 5.7e-6 on the CPU
# (bench/README.md, "bf16 tokens"), so a gap of that order can flip either way.
NEAR_TIE_GAP = {"float32": 1e-4, "fp32": 1e-4, "bfloat16": 0.125, "bf16": 0.125}


def first_divergences(engines: list[SpecEngine]) -> dict[str, dict[str, tuple[int, int, int]]]:
    """Per variant, per base request id (copy label stripped): the first differing output
    position of the first measured round and the two tokens there (``none``'s, the variant's)."""
    ref = engines[0].passes[1].tokens
    out: dict[str, dict[str, tuple[int, int, int]]] = {}
    for e in engines[1:]:
        got = e.passes[1].tokens
        diffs: dict[str, tuple[int, int, int]] = {}
        for rid, a in ref.items():
            b = got[rid]
            if a == b:
                continue
            pos = first_difference(a, b)
            base_id = rid.split("-", 2)[2]  # "<label>-c<copy>-<id>"
            diffs.setdefault(
                base_id,
                (pos, a[pos] if pos < len(a) else -1, b[pos] if pos < len(b) else -1),
            )
        out[e.variant.name] = diffs
    return out


def explain_divergences(
    args: argparse.Namespace,
    none: SpecEngine,
    base: list[WorkloadRequest],
    diffs: dict[str, dict[str, tuple[int, int, int]]],
) -> dict[str, list[dict[str, Any]]]:
    """Rerun every diverging prompt on the ``none`` engine (greedy, top-2 logprobs, up to the
    divergence) and report the top-2 logit gap there: a near-tie (``NEAR_TIE_GAP``) where the two
    tokens are ``none``'s two most likely ones explains a divergence by rounding alone."""
    by_id = {w.id: w for w in base}
    todo = sorted({bid for d in diffs.values() for bid in d})
    if not todo:
        return {name: [] for name in diffs}
    deepest = {bid: max(d[bid][0] for d in diffs.values() if bid in d) for bid in todo}
    reqs = [
        dataclasses.replace(
            by_id[bid],
            id=f"explain-{bid}",
            params=dataclasses.replace(
                by_id[bid].params, max_tokens=deepest[bid] + 1, logprobs=2, ignore_eos=True
            ),
        )
        for bid in todo
    ]
    outs = {o.id.removeprefix("explain-"): o for o in none.llm.run_workload(reqs)}
    limit = NEAR_TIE_GAP.get(args.dtype, 0.0)
    report: dict[str, list[dict[str, Any]]] = {}
    for name, d in diffs.items():
        rows = []
        for bid, (pos, tok_none, tok_spec) in sorted(d.items()):
            lps = outs[bid].logprobs or []
            top = sorted(lps[pos][1:], key=lambda t: -t[1]) if pos < len(lps) else []
            gap = top[0][1] - top[1][1] if len(top) >= 2 else None
            top2 = {t[0] for t in top[:2]}
            rows.append(
                {
                    "request": bid,
                    "position": pos,
                    "token_none": tok_none,
                    "token_spec": tok_spec,
                    "top2_gap": gap,
                    "top2": [t[0] for t in top[:2]],
                    "near_tie": gap is not None and gap <= limit and {tok_none, tok_spec} <= top2,
                }
            )
        report[name] = rows
    return report


def _fmt(s: dict[str, float | None], spec: str, pct: bool = False) -> str:
    if s["median"] is None:
        return "-"
    k = 100.0 if pct else 1.0
    return f"{s['median'] * k:{spec}} ({s['min'] * k:{spec}}..{s['max'] * k:{spec}})"


def print_table(
    summary: dict[str, Any], agreement: dict[str, Any], rounds: dict[str, list[dict[str, Any]]]
) -> None:
    print(
        f"\n{'variant':<16} {'output tok/s median (min..max)':>32} {'x none (min..max)':>22} "
        f"{'accept':>6} {'tok/req-step':>12} {'exposed wait µs/step (share)':>30} "
        f"{'read µs/step':>12} {'same tokens':>11} {'1st diff med/min':>16}"
    )
    for name, s in summary.items():
        a = agreement.get(name)
        same = "-" if a is None else f"{100 * a['identical_share']:.0f}%"
        first = (
            "-"
            if a is None or a["first_divergence_median"] is None
            else f"{a['first_divergence_median']:g}/{a['first_divergence_min']}"
        )
        kinds = ",".join(rounds[name][0].get("wait_kinds", {})) or "-"
        wait = s["exposed_wait_us_per_step"]["median"]
        share = s["exposed_wait_share"]["median"]
        wait_s = "-" if wait is None else f"{wait:,.0f} {kinds} ({100 * (share or 0):.1f}%)"
        acc = s["acceptance"]["median"]
        tps = s["tokens_per_request_step"]["median"]
        read = s["read_output_us_per_step"]["median"]  # host work after the wait (not wait)
        print(
            f"{name:<16} {_fmt(s['tok_s'], ',.0f'):>32} {_fmt(s['ratio_to_none'], '.2f'):>22} "
            f"{'-' if acc is None else f'{acc:.3f}':>6} {'-' if tps is None else f'{tps:.2f}':>12} "
            f"{wait_s:>30} {'-' if read is None else f'{read:,.0f}':>12} {same:>11} {first:>16}"
        )


def write_json(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    if not args.json:
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1, default=str)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=TARGET)
    p.add_argument("--workload", default="samples/workloads/pycode_prompts.jsonl")
    p.add_argument("--limit", type=int, default=None, help="only the first N sample prompts")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        help="output tokens per request (greedy, EOS ends it earlier)",
    )
    p.add_argument(
        "--variants",
        default=DEFAULT_VARIANTS,
        help="METHOD:K[:sync] list; 'none' is always run (default %(default)s)",
    )
    p.add_argument(
        "--pick-k",
        action="append",
        default=[],
        metavar="METHOD=K1,K2",
        help="try these k on the untimed pass and keep the fastest (repeatable)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--warm-repeat", type=int, default=4, help="copies of the prompts in each untimed pass"
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="copies of the prompts in each measured pass (default: sized by --min-run-s)",
    )
    p.add_argument(
        "--min-run-s",
        type=float,
        default=10.0,
        help="the fastest variant's measured run lasts at least this long",
    )
    p.add_argument("--max-repeat", type=int, default=256)
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="seconds all measured rounds may take (estimated from the untimed passes); "
        "--min-run-s yields to it, and the output says so",
    )
    p.add_argument(
        "--check-tokens",
        action="store_true",
        help="exit 1 unless every variant emits none's tokens, or differs only where the run "
        "without speculation chose at a near-tie (on by default in float32)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="every engine with --batch-invariant (a token's logits independent of its batch: "
        "with --strict-tokens, greedy speculation must emit none's tokens exactly)",
    )
    p.add_argument(
        "--strict-tokens",
        action="store_true",
        help="with --check-tokens: exit 1 on any difference, near-ties included",
    )
    p.add_argument(
        "--traced",
        choices=("extra", "every"),
        default="extra",
        help="extra (default): the measured rounds run with the tracer muted (speed as without "
        "--trace), then one traced pass per variant (a quarter of the workload) gives the trace's "
        "numbers; every: every measured round is traced",
    )
    p.add_argument(
        "--trace-dir", default=None, help="where the traces go (default: a temporary folder)"
    )
    p.add_argument(
        "--json", default=None, help="default on CUDA: bench/results/h200/spec_<dtype>.json"
    )
    args = p.parse_args(argv)
    if args.json is None and args.device.startswith("cuda"):
        args.json = f"bench/results/h200/spec_{args.dtype}.json"
    args.check_tokens = args.check_tokens or args.dtype in ("float32", "fp32")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    variants = parse_variants(args.variants)
    base = base_workload(args)
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="stepscope-spec-")
    print(f"building and warming every variant (traces in {trace_dir})", flush=True)
    variants, tried, kept = pick_k(args, variants, trace_dir, base)
    engines = [kept.get(v) or build(args, v, trace_dir, base) for v in variants]
    repeat, how = measured_repeat(args, engines)
    out: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k != "pick_k"}
        | {
            "repeat": repeat,
            "num_requests": repeat * len(base),
            "variants": [v.name for v in variants],
        },
        "picked_k": tried,
    }
    print(
        f"measured pass: {repeat} x {len(base)} requests ({how}), {args.rounds} rounds", flush=True
    )
    rows = run_rounds(args, engines, repeat, base, out)
    # before the engines close (add_trace_metrics): the explanation reruns prompts on `none`
    explained = explain_divergences(args, engines[0], base, first_divergences(engines))
    traced = traced_pass(args, engines, repeat, base) if args.traced == "extra" else None
    trace_rows = rows if traced is None else {name: [row] for name, row in traced.items()}
    warm, pairs = add_trace_metrics(engines, trace_rows)
    summary = {name: summarise_variant(r) for name, r in rows.items()}
    if traced is not None:  # the trace's numbers come from the traced pass
        for name, r in trace_rows.items():
            summary[name] |= {
                k: v
                for k, v in summarise_variant(r).items()
                if k not in ("tok_s", "ratio_to_none", "elapsed_s")
            }
    agreement = token_agreement(engines)
    print_table(summary, agreement, trace_rows)
    if traced is not None:
        print(
            "tok/s and x none: the untraced rounds; accept .. exposed wait: one traced pass per "
            "variant, whose speed was: "
            + ", ".join(
                f"{n} {r['tok_s']:,.0f} ({r['ratio_to_none']:.2f}x)" for n, r in traced.items()
            )
        )
    for name, pair in pairs.items():
        print(f"\n{name}, round 1, as `stepscope compare` says it (A = sync, B = async):")
        print(f"  {pair['line']}")
    differ = [n for n, a in agreement.items() if a["identical_share_min"] < 1.0]
    for name, rows_ in explained.items():
        for r in rows_:
            gap = "?" if r["top2_gap"] is None else f"{r['top2_gap']:.3g}"
            print(
                f"  {name}: {r['request']} first differs at output {r['position']} "
                f"(none {r['token_none']}, spec {r['token_spec']}); none's top-2 logit gap there "
                f"{gap}: {'a near-tie' if r['near_tie'] else 'NOT a near-tie'}"
            )
    out |= {
        "rounds": rows,
        "traced_pass": traced,
        "untimed_pass": warm,
        "summary": summary,
        "tokens_vs_none": agreement,
        "sync_vs_async": pairs,
        "divergences": explained,
        "near_tie_gap": NEAR_TIE_GAP.get(args.dtype),
        "trace_dir": trace_dir,
    }
    write_json(args, out)
    if args.json:
        print(f"JSON: {args.json}")
    unexplained = [n for n in differ if not all(r["near_tie"] for r in explained[n])]
    if args.check_tokens and differ:
        print(
            f"TOKENS DIFFER from the run without speculation ({args.dtype}): {', '.join(differ)}; "
            + (
                f"not explained by a near-tie: {', '.join(unexplained)}"
                if unexplained
                else f"every first divergence is at a near-tie (top-2 logit gap <= "
                f"{NEAR_TIE_GAP.get(args.dtype)}) of the run without speculation"
            ),
            file=sys.stderr,
        )
        return 1 if unexplained or args.strict_tokens else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
