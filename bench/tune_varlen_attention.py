"""Varlen (prefill / mixed) paged attention on the GPU: launch parameters vs FlashAttention.

For Qwen3-0.6B heads (16 query, 8 KV heads of 128, bf16, KV block size 16, shuffled block
tables) and the batches of a 2048-token mixed step (issue 17), times the varlen kernel
(``engine.kernels.attention.paged_varlen_attention_triton``) over a grid of launch parameters:

* ``mix128``: 64 decodes at context 256 + 16 prompts of 128 tokens (2048 tokens);
* ``mix1984``: 64 decodes at context 256 + one prompt of 1984 tokens;
* ``prefill2048``: one prompt of 2048 tokens;
* ``chunks``: 8 chunks of 256 tokens, each after 1024 cached tokens.

Every config is checked first: max abs error of its bf16 output against a float32
``paged_attention_torch`` (the inputs upcast; > 2e-2 is a failure and stops the bench). Times
are device times of 10 launches captured in one CUDA graph (the way the engine replays mixed
steps), median of ``--reps`` replays, divided by 10; KV and q are not flushed from L2 between
launches. TFLOP/s counts the causal (query, key) pairs only: ``4 * head_dim * q_heads * pairs``.

The speed bar is ``torch.nn.functional.scaled_dot_product_attention`` on the FlashAttention
backend over the same problem made contiguous (K/V expanded to the 16 query heads, one call per
group of requests with equal lengths, all calls in one graph): causal where the query is the
whole sequence, non-causal where it follows a cached context (decodes, chunks), which
over-counts the masked triangle, so the bar is then an upper bound on flash's time.

The sweep: phase 1 over (BLOCK_M, BLOCK_N, num_warps, num_stages) with the small-request path
at its default; phase 2 over the small path (SMALL_M, SMALL_N) and the program order (reverse)
around phase 1's best; phase 3 the grid order (head_major: a q block's KV heads adjacent) and
``split_decodes`` (the one-token requests attended by the decode kernel in a second launch) around
the best so far. ``--budget-s`` stops the sweep (what was not timed is listed). The bench prints
the config with the lowest mean of (time / that shape's best time) as a ``VARLEN_LAUNCH[2]``
entry to paste into engine/kernels/attention.py.

Usage (CUDA, ~3 minutes on the H200): python bench/tune_varlen_attention.py [--json out.json]
CPU smoke test of the script (tiny shapes in fp32, TRITON_INTERPRET=1, three configs, no graphs):
  TRITON_INTERPRET=1 python bench/tune_varlen_attention.py --smoke
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.kernels.attention import (  # noqa: E402
    VARLEN_FALLBACK,
    VARLEN_LAUNCH,
    paged_attention_torch,
    paged_varlen_attention_triton,
)
from engine.kernels.attention_metadata import AttentionMetadata  # noqa: E402
from engine.model.paged_batch import build_attention_metadata  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 16, 8, 128, 16, 28
MAX_ERR = 2e-2
LAUNCHES_PER_GRAPH = 10
# name -> list of (number of requests, query tokens each, cached context each)
SHAPES: dict[str, list[tuple[int, int, int]]] = {
    "mix128": [(64, 1, 255), (16, 128, 0)],
    "mix1984": [(64, 1, 255), (1, 1984, 0)],
    "prefill2048": [(1, 2048, 0)],
    "chunks": [(8, 256, 1024)],
}
SMOKE_SHAPES: dict[str, list[tuple[int, int, int]]] = {
    "mix": [(3, 1, 20), (2, 24, 0)],
    "chunks": [(2, 16, 40)],
}
WRONG: list[dict[str, Any]] = []  # configs whose output failed the check
KEYS = ("BLOCK_M", "BLOCK_N", "SMALL_M", "SMALL_N", "num_warps", "num_stages", "reverse",
        "head_major", "split_decodes")  # fmt: skip


@dataclass
class Batch:
    name: str
    groups: list[tuple[int, int, int]]
    q: torch.Tensor  # [T, Hq, D]
    kv: torch.Tensor  # [2, blocks, BLOCK_SIZE, Hkv, D]
    md: AttentionMetadata
    q_lens: list[int]
    ctx_lens: list[int]
    tables: list[list[int]]

    @property
    def pairs(self) -> int:
        """Causal (query, key) pairs: each query sees its context and the queries up to it."""
        return sum(
            q * c + q * (q + 1) // 2 for q, c in zip(self.q_lens, self.ctx_lens, strict=True)
        )

    @property
    def flops(self) -> float:
        return 4.0 * HEAD_DIM * NUM_HEADS * self.pairs


def make_batch(
    name: str, groups: list[tuple[int, int, int]], device: str, seed: int, dtype: torch.dtype
) -> Batch:
    """Random q and KV; block tables drawn from a shuffled pool (a long-running server's)."""
    q_lens = [q for n, q, _ in groups for _ in range(n)]
    ctx_lens = [c for n, _, c in groups for _ in range(n)]
    need = [-(-(q + c) // BLOCK_SIZE) for q, c in zip(q_lens, ctx_lens, strict=True)]
    pool = list(range(sum(need)))
    random.Random(seed).shuffle(pool)
    tables = []
    for n in need:
        tables.append(pool[:n])
        pool = pool[n:]
    gen = torch.Generator(device=device).manual_seed(seed)
    kv = torch.randn(2, sum(need), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device,
                     generator=gen).to(dtype)  # fmt: skip
    md, _ = build_attention_metadata(ctx_lens, q_lens, tables, BLOCK_SIZE, device)
    q = torch.randn(md.num_tokens, NUM_HEADS, HEAD_DIM, device=device, generator=gen)
    return Batch(name, groups, q.to(dtype), kv, md, q_lens, ctx_lens, tables)


def reference(b: Batch, scale: float) -> torch.Tensor:
    """float32 ``paged_attention_torch`` of the upcast inputs, one call per group of requests
    (so the padded [requests, max_query, max_seq] grid stays small)."""
    out = torch.empty(b.q.shape, dtype=torch.float32, device=b.q.device)
    kv = b.kv.float()
    first_req, first_tok = 0, 0
    for n, q_len, ctx in b.groups:
        reqs = range(first_req, first_req + n)
        md, _ = build_attention_metadata([ctx] * n, [q_len] * n, [b.tables[r] for r in reqs],
                                         BLOCK_SIZE, b.q.device)  # fmt: skip
        toks = slice(first_tok, first_tok + n * q_len)
        out[toks] = paged_attention_torch(b.q[toks].float(), kv, md, scale)
        first_req, first_tok = first_req + n, first_tok + n * q_len
    return out


def sdpa_calls(b: Batch, smoke: bool) -> Callable[[], None]:
    """The contiguous problem for ``scaled_dot_product_attention``: per group, q
    [n, Hq, q_len, D] and K/V [n, Hq, ctx + q_len, D] (KV heads expanded)."""
    gen = torch.Generator(device=b.q.device).manual_seed(1)
    args = []
    for n, q_len, ctx in b.groups:
        shape = (n, NUM_HEADS, q_len, HEAD_DIM)
        q = torch.randn(shape, device=b.q.device, generator=gen).to(b.q.dtype)
        kv_shape = (n, NUM_KV_HEADS, ctx + q_len, HEAD_DIM)
        k = torch.randn(kv_shape, device=b.q.device, generator=gen).to(b.q.dtype)
        v = torch.randn(kv_shape, device=b.q.device, generator=gen).to(b.q.dtype)
        group = NUM_HEADS // NUM_KV_HEADS
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        args.append((q, k, v, ctx == 0 and q_len > 1))

    def run() -> None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = [SDPBackend.MATH] if smoke else [SDPBackend.FLASH_ATTENTION]
        with sdpa_kernel(backends):
            for q, k, v, causal in args:
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def time_us(fn: Callable[[], Any], reps: int, smoke: bool) -> float:
    """Device time of one call: ``LAUNCHES_PER_GRAPH`` calls in one CUDA graph, median of
    ``reps`` replays (CPU smoke: wall time of one call)."""
    if smoke:
        t_start = time.perf_counter()
        fn()
        return (time.perf_counter() - t_start) * 1e6
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAUNCHES_PER_GRAPH):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / LAUNCHES_PER_GRAPH)
    del graph
    return sorted(times)[len(times) // 2]


def label(c: dict[str, Any]) -> str:
    return (f"M{c['BLOCK_M']} N{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']} "
            f"small{c['SMALL_M']}x{c['SMALL_N']} rev{int(c['reverse'])} "
            f"hm{int(c.get('head_major', False))} split{int(c.get('split_decodes', False))}")  # fmt: skip


def phase1(args: argparse.Namespace, base: dict[str, Any]) -> list[dict[str, Any]]:
    ints = [[int(x) for x in a.split(",")] for a in (args.block_m, args.block_n, args.warps,
                                                      args.stages)]  # fmt: skip
    configs = [dict(base, BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
               for m, n, w, s in itertools.product(*ints)]  # fmt: skip
    # The table's entry first, then the usual pairings of tile rows and warps (128/8, 64/4), KV
    # tiles of 64, 128, 32 in that order (so a budget cut drops the least likely ones).
    usual = ((128, 8), (64, 4))
    n_rank = {64: 0, 128: 1, 32: 2}
    configs.sort(
        key=lambda c: (
            c != base,
            (c["BLOCK_M"], c["num_warps"]) not in usual,
            n_rank.get(c["BLOCK_N"], 3),
        )
    )
    return configs + [dict(VARLEN_FALLBACK, head_major=False)]


def phase2(args: argparse.Namespace, best: dict[str, Any]) -> list[dict[str, Any]]:
    smalls = [tuple(int(x) for x in s.split("x")) for s in args.small.split(",")]
    return [dict(best, SMALL_M=m, SMALL_N=n, reverse=bool(r))
            for (m, n), r in itertools.product(smalls, (1, 0))]  # fmt: skip


def run_config(
    config: dict[str, Any], batches: list[Batch], refs: list[torch.Tensor], args: argparse.Namespace
) -> dict[str, Any] | None:
    """Check then time one config on every batch; None if it does not compile or launch."""
    scale = HEAD_DIM**-0.5
    row: dict[str, Any] = {"config": config, "us": {}, "err": {}}
    for b, ref in zip(batches, refs, strict=True):

        def call(b: Batch = b) -> torch.Tensor:
            return paged_varlen_attention_triton(b.q, b.kv, b.md, scale, config)

        try:
            got = call().float()
        except Exception as exc:  # noqa: BLE001 -- a config the compiler rejects is skipped
            print(f"  {label(config)}: {type(exc).__name__}: {str(exc)[:120]}")
            return None
        err = (got - ref).abs().max().item()
        if not err <= MAX_ERR:
            print(f"  {label(config)}: WRONG on {b.name}: max abs error {err:.3e} vs float32 torch")
            WRONG.append({"config": config, "shape": b.name, "max_abs_err": err})
            return None
        row["err"][b.name] = err
        row["us"][b.name] = time_us(call, args.reps, args.smoke)
    print(f"  {label(config):44s} " + "  ".join(f"{row['us'][b.name]:8.1f}" for b in batches))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--block-m", default="64,128", help="phase 1: rows per prefill tile")
    p.add_argument("--block-n", default="32,64,128", help="phase 1: KV positions per tile")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="2,3")
    p.add_argument("--small", default="0x32,16x32,16x64,16x128,32x64",
                   help="phase 2: SMALL_MxSMALL_N of the small-request path (0: off)")  # fmt: skip
    p.add_argument("--reps", type=int, default=15, help="graph replays per timing")
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="stop sweeping after this (phase 1 after 60%% of it)")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, three configs")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    t0 = time.perf_counter()
    device = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --smoke on the CPU with TRITON_INTERPRET=1)")
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    # The Triton interpreter computes bf16 wrongly (numpy has no bf16): the smoke test runs fp32
    # with the bf16 launch table entries.
    dtype = torch.float32 if args.smoke else torch.bfloat16
    batches = [make_batch(name, groups, device, seed=i, dtype=dtype)
               for i, (name, groups) in enumerate(shapes.items())]  # fmt: skip
    scale = HEAD_DIM**-0.5
    refs = [reference(b, scale) for b in batches]
    device_name = "cpu" if args.smoke else torch.cuda.get_device_name()
    print(f"varlen attention, Qwen3-0.6B heads ({NUM_HEADS}/{NUM_KV_HEADS}x{HEAD_DIM}), {dtype}, "
          f"block size {BLOCK_SIZE}, on {device_name}")  # fmt: skip
    bars = {}
    for b in batches:
        bars[b.name] = time_us(sdpa_calls(b, args.smoke), args.reps, args.smoke)
        print(f"  {b.name:12s} {b.md.num_tokens:5d} tokens, {len(b.q_lens):3d} requests, "
              f"{b.flops / 1e9:6.2f} GFLOP; sdpa flash {bars[b.name]:8.1f} us "
              f"({b.flops / bars[b.name] / 1e6:6.1f} TFLOP/s)")  # fmt: skip

    base = dict(VARLEN_LAUNCH[2])
    base.setdefault("head_major", False)
    base.setdefault("split_decodes", False)
    print("\nconfig" + " " * 40 + "  ".join(f"{b.name[:8]:>8s}" for b in batches) + "   (us)")
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    first = phase1(args, base)
    if args.smoke:
        first = first[:2]
    for config in first:
        if time.perf_counter() - t0 > 0.6 * args.budget_s:
            skipped.append(label(config))
            continue
        row = run_config(config, batches, refs, args)
        if row:
            rows.append(row)
    if not rows:
        raise SystemExit("no config compiled")

    def score(row: dict[str, Any]) -> float:
        best = {b.name: min(r["us"][b.name] for r in rows) for b in batches}
        return sum(row["us"][n] / best[n] for n in best) / len(best)

    best1 = min(rows, key=score)["config"]
    seen = [r["config"] for r in rows]
    second = [c for c in phase2(args, best1) if c not in seen]
    if args.smoke:
        second = second[:1]
    for config in second:
        if time.perf_counter() - t0 > 0.85 * args.budget_s:
            skipped.append(label(config))
            continue
        row = run_config(config, batches, refs, args)
        if row:
            rows.append(row)
    # Phase 3: the grid order (a q block's KV heads adjacent or not) around the best so far.
    best2 = min(rows, key=score)["config"]
    third = [dict(best2, head_major=not best2["head_major"], reverse=r)
             for r in (best2["reverse"], not best2["reverse"])]  # fmt: skip
    # ... and the one-token requests sent to the decode kernel (split_decodes), both grid orders.
    third += [dict(best2, split_decodes=True, head_major=h) for h in (False, True)]
    if args.smoke:
        third = third[:1] + third[2:3]  # the grid order, and split decodes
    for config in [c for c in third if c not in [r["config"] for r in rows]]:
        if time.perf_counter() - t0 > args.budget_s:
            skipped.append(label(config))
            continue
        row = run_config(config, batches, refs, args)
        if row:
            rows.append(row)
    if WRONG:
        print(f"\n{len(WRONG)} configs gave wrong results (see above): a kernel bug, report it")
    if skipped:
        print(f"\nbudget of {args.budget_s:.0f} s spent: {len(skipped)} configs not timed: "
              + "; ".join(skipped))  # fmt: skip

    best_row = min(rows, key=score)
    table_row = next((r for r in rows if r["config"] == base), None)
    print(f"\n{'shape':12s} {'sdpa flash':>16s} {'table entry':>16s} {'best overall':>16s} "
          f"{'best for shape':>16s}  x28 layers (best overall)   max abs err")  # fmt: skip
    summary = []
    for b in batches:
        shape_best = min(rows, key=lambda r: float(r["us"][b.name]))

        def cell(us: float | None, b: Batch = b) -> str:
            if us is None:
                return f"{'-':>16s}"
            return f"{us:7.1f} {b.flops / us / 1e6:5.0f} TF/s"

        t_row = table_row["us"][b.name] if table_row else None
        print(f"{b.name:12s} {cell(bars[b.name])} {cell(t_row)} {cell(best_row['us'][b.name])} "
              f"{cell(shape_best['us'][b.name])}  {best_row['us'][b.name] * NUM_LAYERS / 1e3:6.2f} ms"
              f"                 {best_row['err'][b.name]:.2e}")  # fmt: skip
        summary.append({"shape": b.name, "groups": b.groups, "tokens": b.md.num_tokens,
                        "gflop": b.flops / 1e9, "sdpa_flash_us": bars[b.name],
                        "table_us": t_row, "best_overall_us": best_row["us"][b.name],
                        "best_for_shape_us": shape_best["us"][b.name],
                        "best_for_shape": shape_best["config"],
                        "max_abs_err": best_row["err"][b.name]})  # fmt: skip
    entry = {k: best_row["config"][k] for k in KEYS}
    print(f"\nbest overall ({label(entry)}; mean {score(best_row):.3f}x of each shape's best); "
          f"paste into engine/kernels/attention.py:\nVARLEN_LAUNCH[2] = {entry!r}")  # fmt: skip
    print(f"bench took {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name, "host": platform.node(), "torch": torch.__version__,
                       "table_entry": base, "best_overall": entry, "summary": summary,
                       "skipped": skipped, "wrong": WRONG, "rows": rows}, f, indent=1)  # fmt: skip
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
