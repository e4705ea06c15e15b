"""Decode-step GEMMs: the library GEMM (``F.linear``) vs the skinny Triton GEMM, per shape.

A decode step of the Qwen3-0.6B shape runs four projections per layer (qkv, o, gate_up, down)
and the lm_head with ``M`` = the batch. On the H200 at batch 256 the four took ~28 µs a layer
(7 µs each; the session-7 kernel window), against ~10 µs a layer of compute or memory floor. This
bench times each shape as ``--reps`` launches captured in one CUDA graph (median over
``--replays`` replays, µs per launch): ``F.linear`` with torch's default BLAS backend and with
cuBLASLt preferred, and the Triton kernel of ``bench/_gemm_triton.py`` over a sweep of launch
constants (tile rows/cols/depth, stages, K splits). Each Triton config is first checked against
a float64 product (relative max error ≤ 1e-2 of the output scale, else listed as wrong and left
out). Prints per shape the library time, the best Triton config and the ratio, then per ``M``
the sum over a layer's four GEMMs (× layers = per step); ``--json`` writes every timing and the
``GEMM_LAUNCH`` table to paste.

H200:  python bench/bench_gemm.py --json bench/results/h200/gemm.json
CPU:   python bench/bench_gemm.py --smoke        (interpreter, tiny shapes, checks only)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from bench._gemm_triton import GemmLaunch, gemm_torch, gemm_triton  # noqa: E402

# (name, N, K) of the Qwen3-0.6B decode step: hidden 1024, 16 q / 8 kv heads of 128, inter 3072.
QWEN3_06B = [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)]
LM_HEAD = ("lm_head", 151936, 1024)
LAYERS = 28


def _time_graph(fn, reps: int, replays: int) -> float:
    """µs per launch: ``reps`` calls of ``fn`` captured in one CUDA graph, median of replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / reps)
    del graph
    return statistics.median(times)


def _configs(m: int, k: int, smoke: bool) -> list[GemmLaunch]:
    if smoke:
        return [GemmLaunch(16, 32, 32, s, 4, 2) for s in (1, 2)]
    rows = [bm for bm in (16, 32, 64, 128) if bm <= max(16, m) and (bm >= 64 or m <= 64)]
    out = []
    for bm, bn, bk, stages, split in itertools.product(
        rows, (32, 64, 128), (64, 128), (3, 4), (1, 2, 4, 8)
    ):
        if k // split < bk or (bm == 128 and bn == 128 and bk == 128):
            continue
        out.append(GemmLaunch(bm, bn, bk, split, 4, stages))
    return out


def _check(y: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item() or 1.0
    return (y.double() - ref).abs().max().item() / scale


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--m", default="256,128,64", help="rows (decode batch sizes), comma-separated")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--replays", type=int, default=15)
    ap.add_argument("--lm-head", action="store_true", help="also time the lm_head GEMM")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop the sweep after this long")
    ap.add_argument(
        "--smoke", action="store_true", help="CPU interpreter: tiny shapes, correctness only"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.smoke:
        torch.manual_seed(0)
        bad = 0
        for m, n, k in [(8, 96, 128), (3, 64, 256)]:
            x, w = torch.randn(m, k), torch.randn(n, k)
            ref = x.double() @ w.double().T
            for cfg in _configs(m, k, True):
                err = _check(gemm_triton(x, w, cfg), ref)
                print(f"smoke m={m} n={n} k={k} {cfg}: rel err {err:.2e}")
                bad += err > 1e-4
        return 1 if bad else 0
    if not torch.cuda.is_available():
        print("bench_gemm: needs CUDA (or --smoke)", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    shapes = QWEN3_06B + ([LM_HEAD] if args.lm_head else [])
    ms = [int(v) for v in args.m.split(",")]
    t0 = time.monotonic()
    results: list[dict] = []
    torch.manual_seed(0)
    for m in ms:
        for name, n, k in shapes:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
            ref = x.double() @ w.double().T
            row: dict = {"m": m, "name": name, "n": n, "k": k, "triton": [], "wrong": []}
            torch.backends.cuda.preferred_blas_library("cublas")
            row["cublas_us"] = _time_graph(
                lambda x=x, w=w: gemm_torch(x, w), args.reps, args.replays
            )
            torch.backends.cuda.preferred_blas_library("cublaslt")
            row["cublaslt_us"] = _time_graph(
                lambda x=x, w=w: gemm_torch(x, w), args.reps, args.replays
            )
            torch.backends.cuda.preferred_blas_library("cublas")
            for cfg in _configs(m, k, False):
                if time.monotonic() - t0 > args.budget_s:
                    row["budget_hit"] = True
                    break
                try:
                    err = _check(gemm_triton(x, w, cfg), ref)
                except Exception as exc:  # a config that does not compile on this device
                    row["wrong"].append({"cfg": cfg.__dict__, "error": str(exc)[:200]})
                    continue
                if err > 1e-2:
                    row["wrong"].append({"cfg": cfg.__dict__, "rel_err": err})
                    continue
                us = _time_graph(
                    lambda x=x, w=w, cfg=cfg: gemm_triton(x, w, cfg), args.reps, args.replays
                )
                row["triton"].append({"cfg": cfg.__dict__, "us": us, "rel_err": err})
            lib = min(row["cublas_us"], row["cublaslt_us"])
            best = min(row["triton"], key=lambda r: r["us"]) if row["triton"] else None
            row["best"] = best
            tag = f"{best['us']:7.2f} {best['cfg']}" if best else "   none"
            ratio = f"{lib / best['us']:.2f}x" if best else "-"
            print(
                f"M={m:4d} {name:8s} N={n:6d} K={k:5d}  cublas {row['cublas_us']:7.2f}  "
                f"cublaslt {row['cublaslt_us']:7.2f}  triton best {tag}  lib/triton {ratio}  "
                f"({len(row['triton'])} ok, {len(row['wrong'])} wrong)",
                flush=True,
            )
            results.append(row)
    print("\nper layer (the four projections; x28 = per decode step):")
    for m in ms:
        rows = [r for r in results if r["m"] == m and r["name"] != "lm_head"]
        lib = sum(min(r["cublas_us"], r["cublaslt_us"]) for r in rows)
        mixed = sum(
            min(r["cublas_us"], r["cublaslt_us"], r["best"]["us"] if r["best"] else 1e9)
            for r in rows
        )
        print(
            f"  M={m:4d}: library {lib:7.2f} µs, best of both {mixed:7.2f} µs  "
            f"(per step {lib * LAYERS / 1000:.3f} -> {mixed * LAYERS / 1000:.3f} ms)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "dtype": args.dtype, "results": results},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
