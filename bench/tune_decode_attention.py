"""Decode attention on the GPU: launch parameters of the decode kernel vs KV read bandwidth.

For Qwen3-0.6B heads (16 query, 8 KV heads of 128, bf16, block size 16) and several
(batch, context) shapes, times the decode kernel over a grid of (BLOCK_N, num_warps,
num_stages) and the varlen kernel on the same batch, and prints the KV bytes read per second
of each against the device's read bandwidth (a large ``sum``) and copy bandwidth. The best
launch parameters go into ``engine.kernels.attention.DECODE_LAUNCH`` by hand.

Usage (CUDA): python bench/tune_decode_attention.py [--shapes 256x160,256x1024,32x1024,1x4096]
              [--json out.json]   (suffix s: shuffled block tables)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.kernels.attention import (  # noqa: E402
    paged_attention_torch,
    paged_decode_attention_triton,
    paged_varlen_attention_triton,
)
from engine.model.paged_batch import build_attention_metadata  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16


def _batch(batch: int, ctx: int, shuffled: bool, seed: int = 0):  # type: ignore[no-untyped-def]
    """Block tables in allocation order (a fresh engine's) or shuffled (a long-running one's)."""
    per_req = -(-ctx // BLOCK_SIZE)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    perm = list(range(batch * per_req))
    if shuffled:
        perm = torch.randperm(batch * per_req, device="cuda", generator=gen).cpu().tolist()
    tables = [perm[r * per_req : (r + 1) * per_req] for r in range(batch)]
    kv = torch.randn(2, batch * per_req, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda",
                     dtype=torch.bfloat16, generator=gen)  # fmt: skip
    md, _ = build_attention_metadata([ctx - 1] * batch, [1] * batch, tables, BLOCK_SIZE, "cuda")
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, kv, md


def _time_us(fn, iters: int = 30) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def read_bandwidth() -> tuple[float, float]:
    """(read B/s of a 2 GiB bf16 sum, copy B/s counting read + write)."""
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    read = x.numel() * 2 / (_time_us(lambda: x.sum(), 10) * 1e-6)
    copy = 2 * x.numel() * 2 / (_time_us(lambda: y.copy_(x), 10) * 1e-6)
    return read, copy


def _tune_shape(shape: str, configs: list[tuple[int, ...]], scale: float) -> dict:
    """Time the varlen kernel and every decode config on one ``BATCHxCTX`` batch."""
    batch, ctx = map(int, shape.rstrip("s").split("x"))
    q, kv, md = _batch(batch, ctx, shuffled=shape.endswith("s"))
    kv_bytes = batch * ctx * NUM_KV_HEADS * HEAD_DIM * 2 * 2
    expected = paged_attention_torch(q, kv, md, scale).float()
    varlen_us = _time_us(lambda: paged_varlen_attention_triton(q, kv, md, scale))
    timed = []
    for bn, w, st, hm in configs:

        def run(bn: int = bn, w: int = w, st: int = st, hm: int = hm) -> torch.Tensor:
            return paged_decode_attention_triton(q, kv, md, scale, bn, w, st, bool(hm))

        try:
            got = run().float()
        except Exception as exc:  # noqa: BLE001 -- a config the compiler rejects is skipped
            print(f"  {shape} {bn},{w},{st},{hm}: {type(exc).__name__}")
            continue
        err = (got - expected).abs().max().item()
        if err > 2e-2:
            raise SystemExit(f"{shape} {bn},{w},{st},{hm}: max abs error {err:.3e} vs torch")
        timed.append((_time_us(run), bn, w, st, hm))
    timed.sort()
    best = timed[0]
    row = {"batch": batch, "ctx": ctx, "kv_MB": kv_bytes / 1e6, "varlen_us": varlen_us,
           "varlen_TBps": kv_bytes / varlen_us / 1e6, "best_us": best[0],
           "best_TBps": kv_bytes / best[0] / 1e6,
           "best": {"BLOCK_N": best[1], "num_warps": best[2], "num_stages": best[3],
                    "head_major": bool(best[4])},
           "all": [list(t) for t in timed]}  # fmt: skip
    print(f"{shape}: KV {row['kv_MB']:.0f} MB; varlen kernel {varlen_us:.1f} us "
          f"({row['varlen_TBps']:.2f} TB/s); decode best {best[0]:.1f} us "
          f"({row['best_TBps']:.2f} TB/s) at {row['best']}")  # fmt: skip
    for t in timed[:5]:
        print(f"    {t[0]:8.1f} us  BLOCK_N={t[1]:<3} warps={t[2]} stages={t[3]} head_major={t[4]}")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--shapes",
        default="256x160,256x160s,256x1024,32x1024,1x4096",
        help="BATCHxCTX, suffix s: shuffled block tables",
    )
    p.add_argument("--block-n", default="16,32,64,128")
    p.add_argument("--warps", default="1,2,4,8")
    p.add_argument("--stages", default="1,2,3,4")
    p.add_argument("--head-major", default="0,1", help="grid order: 1 = a request's heads adjacent")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    read_bw, copy_bw = read_bandwidth()
    print(f"read bandwidth {read_bw / 1e12:.2f} TB/s, copy (read+write) {copy_bw / 1e12:.2f} TB/s")
    scale = HEAD_DIM**-0.5
    configs = list(itertools.product(
        *(map(int, a.split(",")) for a in (args.block_n, args.warps, args.stages, args.head_major))
    ))  # fmt: skip
    rows = [_tune_shape(shape, configs, scale) for shape in args.shapes.split(",")]
    # One setting for all shapes: the config with the lowest sum of time / best time.
    score: dict[tuple[int, ...], float] = {}
    for row in rows:
        for us, *config in row["all"]:
            score[tuple(config)] = score.get(tuple(config), 0.0) + us / row["best_us"]
    common = [c for c, _ in sorted(score.items(), key=lambda kv: kv[1])
              if all(any(tuple(a[1:]) == c for a in r["all"]) for r in rows)]  # fmt: skip
    if common:
        c = common[0]
        print(f"best over all shapes: BLOCK_N={c[0]} warps={c[1]} stages={c[2]} "
              f"head_major={c[3]} (mean {score[c] / len(rows):.3f}x of each shape's best)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"read_Bps": read_bw, "copy_Bps": copy_bw, "rows": rows,
                       "overall": list(common[0]) if common else None}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
