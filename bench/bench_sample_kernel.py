"""Sampling kernels: the one-program-per-row kernels vs the split-vocab kernels (issue 17).

For batches of 1..256 rows over a 151,936-token vocab (Qwen3), bf16 and fp32 logits, times
``sample_commit`` (greedy, and random: Gumbel-max with each row's seed) and ``row_logsumexp``
(logprobs' normaliser), old (``engine.kernels.sampling``) against new
(``engine.kernels.sampling_split``), checks that both give the same tokens and commits (column
``same``; they score every element with the same compiled code) and counts the rows where the new
tokens differ from the torch reference's (``ref!=``: greedy 0; random may differ in a rare row,
as the device's ``log`` and torch's may differ by an ulp near a tie), and prints per case:

* ``dev_us``: device time per call: the call captured in a CUDA graph, replayed, timed with CUDA
  events (median of ``--iters`` replays after warm-up); what a captured step pays;
* ``eager_us``: CUDA events around one eager call after a sync (launch latency included): what the
  engine's eager sampling pays when the device waits for it;
* ``host_us``: the host's enqueue time of one eager call (perf_counter, no sync);
* ``GB/s``: logits bytes read / ``dev_us`` (the H200 reads ~4.2 TB/s).

Then a sweep of the split kernels' launch constants (chunk, block, warps) at a few batch sizes,
fp32 logits (the engine's), with the best constants per batch and overall: set
``engine.kernels.sampling_split.SPLIT_CHUNK / SPLIT_BLOCK / SPLIT_WARPS`` from it.

Usage (CUDA, about 3 minutes with the sweep):
    python bench/bench_sample_kernel.py --device cuda [--json bench/results/h200/sample_kernel.json]
CPU smoke test (TRITON_INTERPRET=1, a tiny vocab, wall-clock times that mean nothing):
    python bench/bench_sample_kernel.py --device cpu
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
OPS = ("greedy", "random", "lse")
SWEEP_CHUNKS = (1024, 2048, 4096, 8192, 16384)
SWEEP_BLOCKS = (512, 1024, 2048)
SWEEP_WARPS = (4, 8)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--vocab", type=int, default=None, help="default: 151936 (cuda), 1000 (cpu)")
    p.add_argument("--batches", default=None, help="comma-separated; default 1,8,32,64,128,256")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--iters", type=int, default=None, help="timed repeats (default 50; cpu 2)")
    p.add_argument("--sweep-batches", default=None, help="default 1,64,256 (cpu: 4); '' = none")
    p.add_argument("--sweep-chunks", default=None, help="default 1024,..,16384 (cpu: 128,256)")
    p.add_argument("--json", default=None, help="write every measured row here")
    a = p.parse_args(argv)
    cpu = a.device == "cpu"
    a.vocab = a.vocab or (1000 if cpu else 151_936)
    a.batches = _ints(
        a.batches if a.batches is not None else ("1,4" if cpu else "1,8,32,64,128,256")
    )
    a.iters = a.iters or (2 if cpu else 50)
    a.sweep_batches = _ints(
        a.sweep_batches if a.sweep_batches is not None else ("4" if cpu else "1,64,256")
    )
    a.sweep_chunks = _ints(
        a.sweep_chunks or ("128,256" if cpu else ",".join(map(str, SWEEP_CHUNKS)))
    )
    a.dtypes = [d for d in a.dtypes.split(",") if d]
    for d in a.dtypes:
        if d not in DTYPES:
            p.error(f"unknown dtype {d!r}; choose from {sorted(DTYPES)}")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no CUDA device (use --device cpu for the smoke test)")
    return a  # fmt: skip


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


class Timer:
    """Median timings of one callable: device (graph replay), eager and host enqueue, in us."""

    def __init__(self, device: str, iters: int) -> None:
        self.cuda = device == "cuda"
        self.iters = iters

    def host_us(self, fn: Callable[[], Any]) -> float:
        times = []
        for _ in range(self.iters):
            if self.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)

    def eager_us(self, fn: Callable[[], Any]) -> float:
        if not self.cuda:
            return self.host_us(fn)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(self.iters):
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    def device_us(self, fn: Callable[[], Any]) -> float:
        """The call captured in a CUDA graph (which also checks that it is capturable), replayed."""
        if not self.cuda:
            return float("nan")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm-up: compile outside the capture
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for _ in range(5):
            graph.replay()
        return self.eager_us(graph.replay)


def _commit_args(logits: torch.Tensor, op: str, seed: int = 0) -> Any:
    from engine.kernels.sampling import SampleCommitArgs

    dev = logits.device
    n = logits.shape[0]
    gen = torch.Generator(device=dev).manual_seed(seed)
    rows, max_len = n + 1, 1024
    table = torch.rand(rows, 6, device=dev, generator=gen) + 0.2  # temperatures in [0.2, 1.2)
    if op == "greedy":
        table[:, 0] = 0.0
    return SampleCommitArgs(
        logits=logits,
        logit_rows=torch.randperm(n, device=dev, generator=gen).to(torch.int32),
        commit_rows=torch.randperm(n, device=dev, generator=gen).to(torch.int32),
        logits_indices=torch.arange(n, device=dev),
        positions=torch.randint(0, max_len - 1, (n,), device=dev, generator=gen),
        temperature=table[:, 0],
        seeds=torch.randint(0, 2**62, (rows, 1), device=dev, generator=gen)[:, 0],
        keep_threshold=None,
        last_sampled=torch.zeros(rows, dtype=torch.int64, device=dev),
        token_ids=torch.zeros(rows, max_len, dtype=torch.int64, device=dev),
        all_greedy=op == "greedy",
    )


def _fresh(a: Any) -> Any:
    return dataclasses.replace(
        a, last_sampled=a.last_sampled.clone(), token_ids=a.token_ids.clone()
    )


def _logits(n: int, vocab: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(n)
    # bf16 logits tie often (8 mantissa bits): the tie rule is exercised at full size too.
    return (torch.randn(n, vocab, device=device, generator=gen) * 2).to(dtype)


def _old_new(op: str, logits: torch.Tensor, **launch: int) -> tuple[Callable, Callable, bool, int]:
    """(old call, new call, whether old and new agree (the same tokens and commits; logsumexp:
    both within 1e-4 of torch's), rows whose new token differs from the torch reference's)."""
    from engine.kernels import sampling as sk
    from engine.kernels import sampling_split as ss

    if op == "lse":
        old = sk.row_logsumexp_triton(logits)
        new = ss.row_logsumexp_split_triton(logits, **launch)
        ref = sk.row_logsumexp_torch(logits.float())
        same = all(torch.allclose(x, ref, atol=1e-4, rtol=1e-5) for x in (old, new))
        return (
            lambda: sk.row_logsumexp_triton(logits),
            lambda: ss.row_logsumexp_split_triton(logits, **launch),
            same,
            0,
        )
    a = _commit_args(logits, op)
    ref_args, old_args, new_args = _fresh(a), _fresh(a), _fresh(a)
    want = sk.sample_commit_torch(ref_args)
    got = ss.sample_commit_split_triton(new_args, **launch)
    same = torch.equal(sk.sample_commit_triton(old_args), got)
    # commit_rows is a permutation: no two rows race for a slot
    same = same and torch.equal(old_args.token_ids, new_args.token_ids)
    same = same and torch.equal(old_args.last_sampled, new_args.last_sampled)
    ref_rows = int((got != want).sum())
    return (
        lambda: sk.sample_commit_triton(a),
        lambda: ss.sample_commit_split_triton(a, **launch),
        same,
        ref_rows,
    )  # fmt: skip


def compare(args: argparse.Namespace, timer: Timer) -> list[dict[str, Any]]:
    """Old vs new at the default launch constants, every (dtype, batch, op)."""
    rows = []
    print(f"{'dtype':>5} {'batch':>5} {'op':>6} | {'dev_us old':>10} {'new':>8} {'x':>5} | "
          f"{'eager_us old':>12} {'new':>8} | {'host_us old':>11} {'new':>6} | "
          f"{'new GB/s':>8} same ref!=")  # fmt: skip
    for dname in args.dtypes:
        for n in args.batches:
            logits = _logits(n, args.vocab, DTYPES[dname], args.device)
            nbytes = logits.numel() * logits.element_size()
            for op in OPS:
                old, new, same, ref_rows = _old_new(op, logits)
                row: dict[str, Any] = {"dtype": dname, "batch": n, "op": op, "same": same}
                row["ref_rows_differ"] = ref_rows
                for name, fn in (("old", old), ("new", new)):
                    row[f"{name}_dev_us"] = timer.device_us(fn)
                    row[f"{name}_eager_us"] = timer.eager_us(fn)
                    row[f"{name}_host_us"] = timer.host_us(fn)
                row["new_gbps"] = nbytes / row["new_dev_us"] / 1e3
                rows.append(row)
                _print_compare(row)
    return rows


def _print_compare(r: dict[str, Any]) -> None:
    speedup = r["old_dev_us"] / r["new_dev_us"] if r["new_dev_us"] else float("nan")
    print(f"{r['dtype']:>5} {r['batch']:>5} {r['op']:>6} | {r['old_dev_us']:10.1f} "
          f"{r['new_dev_us']:8.1f} {speedup:5.1f} | {r['old_eager_us']:12.1f} "
          f"{r['new_eager_us']:8.1f} | {r['old_host_us']:11.1f} {r['new_host_us']:6.1f} | "
          f"{r['new_gbps']:8.0f} {'yes' if r['same'] else ' NO'} {r['ref_rows_differ']:5}",
          flush=True)  # fmt: skip


def sweep(args: argparse.Namespace, timer: Timer) -> list[dict[str, Any]]:
    """The split kernels' device time over (chunk, block, warps), fp32 logits."""
    rows = []
    configs = [
        (c, b, w)
        for c in args.sweep_chunks
        for b in SWEEP_BLOCKS
        for w in SWEEP_WARPS
        if b <= c or (b == SWEEP_BLOCKS[0] and c < b)
    ]
    for n in args.sweep_batches:
        logits = _logits(n, args.vocab, torch.float32, args.device)
        for op in ("greedy", "random"):
            for chunk, block, warps in configs:
                launch = {"chunk": chunk, "block": min(block, chunk), "num_warps": warps}
                _, new, same, _ = _old_new(op, logits, **launch)
                us = timer.device_us(new) if timer.cuda else timer.host_us(new)
                rows.append({"batch": n, "op": op, **launch, "dev_us": us, "same": same})
            best = min((r for r in rows if r["batch"] == n and r["op"] == op), key=_us)
            print(f"sweep batch {n:>4} {op:>6}: best chunk {best['chunk']} block {best['block']} "
                  f"warps {best['num_warps']}: {best['dev_us']:.1f} us  (" + ", ".join(
                      f"{r['chunk']}/{r['block']}/{r['num_warps']}:{r['dev_us']:.0f}"
                      for r in rows if r["batch"] == n and r["op"] == op) + ")", flush=True)  # fmt: skip
    return rows


def _us(r: dict[str, Any]) -> float:
    return r["dev_us"]


def best_overall(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The constants with the least total device time over every swept (batch, op), relative to
    each case's best (so batch 256 does not drown batch 1)."""
    if not rows:
        return None
    cases = {(r["batch"], r["op"]) for r in rows}
    floor = {c: min(_us(r) for r in rows if (r["batch"], r["op"]) == c) for c in cases}
    score: dict[tuple[int, int, int], float] = {}
    for r in rows:
        key = (r["chunk"], r["block"], r["num_warps"])
        score[key] = score.get(key, 0.0) + _us(r) / floor[(r["batch"], r["op"])]
    (chunk, block, warps), total = min(score.items(), key=lambda kv: kv[1])
    return {"chunk": chunk, "block": block, "num_warps": warps, "mean_vs_best": total / len(cases)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel file is imported
    from engine.kernels import sampling_split as ss

    timer = Timer(args.device, args.iters)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)"
    print(f"device {device_name}, vocab {args.vocab}, split defaults chunk {ss.SPLIT_CHUNK} "
          f"block {ss.SPLIT_BLOCK} warps {ss.SPLIT_WARPS}, median of {args.iters}")  # fmt: skip
    result: dict[str, Any] = {"device": device_name, "vocab": args.vocab, "iters": args.iters}
    result["compare"] = compare(args, timer)
    result["sweep"] = sweep(args, timer)
    result["best"] = best_overall(result["sweep"])
    if result["best"] is not None:
        print(f"best overall (mean device time / each case's best): {result['best']}")
    if not all(r["same"] for r in result["compare"] + result["sweep"]):
        print("MISMATCH: old and new kernels disagree on some case (column 'same')")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
