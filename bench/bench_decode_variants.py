"""Decode-attention variants on the GPU: where the decode kernel's fixed cost per call goes.

Times the engine's decode kernel and the variants of ``bench/_decode_variants.py`` (tensor-core
or CUDA-core scores, flash-decoding splits, persistent programs) on batches of decodes with
Qwen3-0.6B heads (16 query / 8 KV heads of 128, bf16, block size 16). Each config is checked
against the float32 ``paged_attention_torch`` first (max abs error <= 2e-2, else reported wrong
and left out), then timed as ``--launches`` launches captured in one CUDA graph (median of 15
replays, so no launch gaps). Prints µs per launch and KV TB/s per shape, each config's
registers and shared memory, and a straight-line fit over the batch-256 shapes, time = fixed +
ctx / slope, to separate a per-call cost from bandwidth. ``e2e`` is the mean over the
contexts 128..640 that a 1024 x (128->512) run walks through (bench_e2e.py's long workload).

Usage (CUDA): python bench/bench_decode_variants.py [--shapes 256x128,...] [--budget-s 200]
              [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._decode_variants import decode_variant, item_bounds  # noqa: E402
from bench.tune_decode_attention import BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, _batch  # noqa: E402
from engine.kernels.attention import (  # noqa: E402
    paged_attention_torch,
    paged_decode_attention_triton,
)

E2E_SHAPES = ["256x128", "256x256", "256x384", "256x512", "256x640"]
DEFAULT_SHAPES = ",".join([*E2E_SHAPES, "256x1024", "64x640", "256x256s"])


def configs(num_sms: int) -> list[dict[str, Any]]:
    """The variants timed: the engine's kernel first, then grid, split and persistent ones."""
    out: list[dict[str, Any]] = [{"name": "engine"}]
    for bn, w, st in [(32, 4, 2), (16, 4, 2), (16, 2, 3), (64, 4, 3)]:
        out.append({"dot": True, "block_n": bn, "num_warps": w, "num_stages": st})
    for bn in (16, 32, 64):
        for w in (2, 4):
            for st in (1, 2, 3):
                out.append({"dot": False, "block_n": bn, "num_warps": w, "num_stages": st})
    out += [{"dot": False, "block_n": 16, "num_warps": 1, "num_stages": st} for st in (2, 3)]
    for splits in (2, 4):
        for bn, w, st in [(32, 2, 2), (32, 4, 2), (16, 2, 3)]:
            out.append({"dot": False, "block_n": bn, "num_warps": w, "num_stages": st,
                        "splits": splits})  # fmt: skip
        out.append({"dot": True, "block_n": 32, "num_warps": 4, "num_stages": 2, "splits": splits})
    for per_sm in (2, 4, 8, 16):
        for dot, bn, w, st in [(False, 32, 2, 2), (False, 16, 2, 3), (True, 32, 4, 2)]:
            out.append({"dot": dot, "block_n": bn, "num_warps": w, "num_stages": st,
                        "programs": per_sm * num_sms})  # fmt: skip
    for c in out[1:]:
        kind = "pers" if c.get("programs") else f"split{c['splits']}" if c.get("splits") else "grid"
        extra = f"/P{c['programs']}" if c.get("programs") else ""
        c["name"] = (f"{kind}-{'dot' if c['dot'] else 'ew'} n{c['block_n']} w{c['num_warps']} "
                     f"s{c['num_stages']}{extra}")  # fmt: skip
    return out


def graph_us(fn: Callable[[], Any], launches: int) -> float:
    """µs per call of ``fn``: ``launches`` calls captured in one CUDA graph, median of 15."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(15):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(times)


def _runner(c: dict[str, Any], q, kv, md, scale, num_items: int):  # type: ignore[no-untyped-def]
    """A zero-argument call of config ``c`` on one batch (buffers made once, outside graphs)."""
    if c["name"] == "engine":
        return lambda: (paged_decode_attention_triton(q, kv, md, scale), [])
    kw = {k: c[k] for k in ("block_n", "num_warps", "num_stages", "dot")}
    if c.get("programs"):
        bounds = item_bounds(md, NUM_KV_HEADS, num_items, c["programs"], c["block_n"])
        return lambda: decode_variant(q, kv, md, scale, programs=c["programs"], bounds=bounds,
                                      **kw)  # fmt: skip
    splits = c.get("splits", 1)
    scratch: dict[str, torch.Tensor] = {}
    if splits > 1:
        n = num_items * splits * (16 if c["dot"] else 2)
        scratch = {"m": torch.empty(n, device="cuda"), "l": torch.empty(n, device="cuda"),
                   "acc": torch.empty(n * HEAD_DIM, device="cuda")}  # fmt: skip
    return lambda: decode_variant(q, kv, md, scale, splits=splits, scratch=scratch or None, **kw)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="BATCHxCTX, suffix s: shuffled tables")
    p.add_argument("--launches", type=int, default=20, help="launches per CUDA graph")
    p.add_argument("--budget-s", type=float, default=240.0, help="stop starting configs after")
    p.add_argument("--only", default="", help="comma-separated substrings of config names")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_variants.py needs a CUDA device")
    t0 = time.monotonic()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfgs = configs(num_sms)
    if args.only:
        keep = args.only.split(",")
        cfgs = [c for c in cfgs if c["name"] == "engine" or any(k in c["name"] for k in keep)]
    scale = HEAD_DIM**-0.5
    shapes = args.shapes.split(",")
    batches = {}
    for shape in shapes:
        batch, ctx = map(int, shape.rstrip("s").split("x"))
        q, kv, md = _batch(batch, ctx, shuffled=shape.endswith("s"))
        ref = paged_attention_torch(q, kv, md, scale).float()
        kv_bytes = batch * ctx * NUM_KV_HEADS * HEAD_DIM * 2 * 2
        batches[shape] = (q, kv, md, ref, kv_bytes, batch, ctx)
    print(f"{num_sms} SMs; {len(cfgs)} configs; shapes {shapes}; block size {BLOCK_SIZE}")
    rows = []
    for c in cfgs:
        if time.monotonic() - t0 > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent: {c['name']} and later not run")
            break
        row: dict[str, Any] = {"config": c, "us": {}, "TBps": {}}
        try:
            for shape, (q, kv, md, ref, kv_bytes, batch, _ctx) in batches.items():
                run = _runner(c, q, kv, md, scale, batch * NUM_KV_HEADS)
                out, kernels = run()
                err = float((out.float() - ref).abs().max())
                if err > 2e-2:
                    row["wrong"] = f"{shape}: max abs error {err:.3e}"
                    break
                for k in kernels[:1]:
                    row["regs"] = getattr(k, "n_regs", None)
                    row["smem"] = getattr(getattr(k, "metadata", None), "shared", None)
                us = graph_us(run, args.launches)
                row["us"][shape] = us
                row["TBps"][shape] = kv_bytes / us / 1e6
        except Exception as exc:  # noqa: BLE001 -- a config the compiler rejects is reported
            row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        fit = [(batches[s][6], row["us"][s]) for s in shapes if s in row["us"]
               and batches[s][5] == 256 and not s.endswith("s")]  # fmt: skip
        if len(fit) >= 2:
            xs, ys = zip(*fit, strict=True)
            mx, my = statistics.mean(xs), statistics.mean(ys)
            slope = sum((x - mx) * (y - my) for x, y in fit) / sum((x - mx) ** 2 for x in xs)
            row["fixed_us"] = my - slope * mx
            row["marginal_TBps"] = 256 * NUM_KV_HEADS * HEAD_DIM * 4 / slope / 1e6
        e2e = [row["us"][s] for s in E2E_SHAPES if s in row["us"]]
        if len(e2e) == len(E2E_SHAPES):
            row["e2e_us"] = statistics.mean(e2e)
        rows.append(row)
        status = row.get("wrong") or row.get("error") or ""
        cells = " ".join(f"{row['us'][s]:7.1f}" for s in shapes if s in row["us"])
        print(f"{c['name']:<32} regs {row.get('regs')} smem {row.get('smem')} | {cells} | "
              f"e2e {row.get('e2e_us', float('nan')):6.1f} fixed {row.get('fixed_us', float('nan')):5.1f} "
              f"marg {row.get('marginal_TBps', float('nan')):4.2f} TB/s {status}", flush=True)  # fmt: skip
    ranked = sorted((r for r in rows if "e2e_us" in r), key=lambda r: r["e2e_us"])
    print("\nby e2e mean (µs per layer call over ctx 128..640 at batch 256):")
    base = next((r["e2e_us"] for r in rows if r["config"]["name"] == "engine" and "e2e_us" in r),
                None)  # fmt: skip
    for r in ranked[:12]:
        rel = f" ({base / r['e2e_us']:.2f}x the engine)" if base else ""
        tb = " ".join(f"{s}:{r['TBps'][s]:.2f}" for s in shapes if s in r["TBps"])
        print(f"  {r['e2e_us']:7.1f} {r['config']['name']}{rel}  TB/s {tb}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shapes": shapes, "num_sms": num_sms, "launches": args.launches,
                       "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
