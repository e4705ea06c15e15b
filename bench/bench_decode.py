"""Decode step time against the memory-bandwidth floor, Qwen3-0.6B shape (random weights).

floor = (weight bytes + KV bytes read per step) / measured device copy bandwidth, where the
bandwidth comes from a large device-to-device copy counting bytes read plus bytes written.
Device step time is the union of a decode step's compute slices (CUDA events).

Usage (CUDA): python bench/bench_decode.py [--batches 1,32,256] [--prompt-len 128]
              [--output-len 64] [--json out.json]

``--profile`` skips the engine and measures the model's decode step alone (``profile_main``
below): kernels per step and per layer from torch.profiler, the top kernels by
device time, and the CUDA-graph replay time of the forward against the same floor. On a machine
without CUDA it counts the ops of a small ``--model-config`` (aten ops + Triton launches).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _engine_run import decode_steps, decode_workload, run_engine  # noqa: E402


def copy_bandwidth_bytes_per_s(nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * nbytes / times[len(times) // 2]


# Ops that launch no kernel (views, allocations): not counted on the CPU.
_NO_KERNEL_OPS = {
    "view", "_unsafe_view", "reshape", "slice", "select", "unsqueeze", "squeeze", "expand",
    "as_strided", "t", "transpose", "permute", "detach", "alias", "empty", "empty_like",
    "empty_strided", "new_empty", "lift_fresh", "split", "split_with_sizes", "unbind", "narrow",
}  # fmt: skip


def count_kernels(fn: Callable[[], object], cuda: bool) -> tuple[Counter[str], dict[str, float]]:
    """Kernels one call of ``fn`` launches: ``(count by name, device us by name)``.

    CUDA: torch.profiler's device events (kernels, memsets, memcpys). CPU: aten ops below
    autograd that are not views/allocations, plus Triton launches (interpreter)."""
    counts: Counter[str] = Counter()
    times: dict[str, float] = {}
    if cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                counts[e.name] += 1
                times[e.name] = times.get(e.name, 0.0) + e.time_range.elapsed_us()
        return counts, times
    import triton.runtime.interpreter as interp
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    class _Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func._schema.name.split("::")[1] not in _NO_KERNEL_OPS:
                counts[func._schema.name] += 1
            return func(*args, **(kwargs or {}))

    run = interp.InterpretedFunction.run

    def counted_run(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        counts["triton:" + self.fn.__name__] += 1
        with _disable_current_modes():  # the interpreter's own tensor ops are not kernels
            return run(self, *args, **kwargs)

    interp.InterpretedFunction.run = counted_run  # type: ignore[method-assign]
    try:
        with _Ops():
            fn()
    finally:
        interp.InterpretedFunction.run = run  # type: ignore[method-assign]
    return counts, times


def _decode_inputs(model: Any, batch: int, ctx_len: int, device: str) -> tuple[Any, ...]:
    """ids, positions, metadata, KV caches of one decode step at context ``ctx_len``."""
    from engine.model.paged_batch import build_attention_metadata

    block_size = 16
    per_req = -(-ctx_len // block_size)
    kv_caches = model.allocate_kv_caches(batch * per_req + 1, block_size)
    tables = [[r * per_req + j for j in range(per_req)] for r in range(batch)]
    md, positions = build_attention_metadata(
        [ctx_len - 1] * batch, [1] * batch, tables, block_size, device
    )
    ids = torch.arange(batch, device=device) % model.config.vocab_size
    return ids, positions, md, kv_caches


def _graph_replay_us(fn: Callable[[], object], iters: int = 50) -> float:
    """Median device time of one replay of ``fn`` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def _eager_us(fn: Callable[[], object], iters: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _profile_batch(model: Any, batch: int, ctx_len: int, cuda: bool, bw: float) -> dict:
    """One batch size: kernel counts (printed with the top kernels), graph time vs floor."""
    cfg = model.config
    device = "cuda" if cuda else "cpu"
    ids, positions, md, kv = _decode_inputs(model, batch, ctx_len, device)
    forward = functools.partial(model, ids, positions, md, kv)
    hidden = forward()
    logits_fn = functools.partial(model.compute_logits, hidden)
    fwd_counts, fwd_times = count_kernels(forward, cuda)
    head_counts, _ = count_kernels(logits_fn, cuda)
    num_kernels = sum(fwd_counts.values())
    row: dict[str, Any] = {"batch": batch, "ctx_len": ctx_len, "forward_kernels": num_kernels,
                           "kernels_per_layer": num_kernels / cfg.num_hidden_layers,
                           "logits_kernels": sum(head_counts.values())}  # fmt: skip
    print(f"batch {batch}: the forward launches {num_kernels} kernels "
          f"({row['kernels_per_layer']:.1f} per layer, embedding and final norm included); "
          f"compute_logits {row['logits_kernels']}. Top kernels (count, device us):")  # fmt: skip
    for name, count in sorted(
        fwd_counts.items(), key=lambda item: -fwd_times.get(item[0], item[1])
    )[:12]:
        print(f"    {count:>4} x {fwd_times.get(name, float('nan')):>9.1f} us  {name[:100]}")
    if cuda:
        weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
        kv_bytes = batch * ctx_len * cfg.num_hidden_layers * 2 * cfg.kv_size * 2
        row["floor_us"] = (weight_bytes + kv_bytes) / bw * 1e6
        row["graph_forward_us"] = _graph_replay_us(forward)
        row["eager_logits_us"] = _eager_us(logits_fn)
        row["x_floor"] = (row["graph_forward_us"] + row["eager_logits_us"]) / row["floor_us"]
        # the KV read is most of the floor at large batch: how close does attention get?
        attn_us = sum(t for n, t in fwd_times.items() if "attention" in n)
        row["attention_us"] = attn_us
        row["attention_TBps"] = kv_bytes / (attn_us * 1e-6) / 1e12 if attn_us else float("nan")
        print(f"    attention: {attn_us:.0f} us for {kv_bytes / 1e6:.0f} MB of KV "
              f"({row['attention_TBps']:.2f} TB/s read; copy bandwidth {bw / 1e12:.2f} TB/s)")  # fmt: skip
    return row


def profile_main(args: argparse.Namespace) -> None:
    """Model-only decode step per batch: kernel counts, top kernels, graph replay vs floor.

    floor as in the engine table; x floor = (graph forward + eager compute_logits) / floor (the
    sampler is not included here; the engine table above includes it)."""
    from engine.engine_parts import load_model_config
    from engine.kernels.backend import create_kernel_backend
    from engine.model.loader import build_random_model

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    cfg = load_model_config(args.model_config)
    model = build_random_model(cfg, dtype, device, seed=0, kernels=create_kernel_backend("triton"))
    ctx_len = args.prompt_len + args.output_len // 2
    bw = copy_bandwidth_bytes_per_s() if cuda else float("nan")
    with torch.no_grad():
        rows = [_profile_batch(model, int(b), ctx_len, cuda, bw) for b in args.batches.split(",")]
    if cuda:
        print(f"copy bandwidth (read+write): {bw / 1e12:.2f} TB/s")
        print(f"{'batch':>5} {'ctx':>4} {'kernels':>7} {'graph fwd us':>12} {'logits us':>9} "
              f"{'floor us':>9} {'x floor':>7}")  # fmt: skip
        for r in rows:
            print(f"{r['batch']:>5} {r['ctx_len']:>4} {r['forward_kernels']:>7} "
                  f"{r['graph_forward_us']:>12.1f} {r['eager_logits_us']:>9.1f} "
                  f"{r['floor_us']:>9.1f} {r['x_floor']:>7.2f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth_Bps": bw, "profile_rows": rows}, f, indent=2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batches", default="1,32,256")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--model-config", default="qwen3-0.6b")
    p.add_argument("--cuda-graphs", choices=["on", "off"], default="on")
    p.add_argument("--async-scheduling", default="off,on", help="comma list of on/off")
    p.add_argument("--kineto-dir", default=None, help="also write a torch.profiler trace per run")
    p.add_argument("--json", default=None)
    p.add_argument("--profile", action="store_true", help="model-only step: kernels and graph time")
    args = p.parse_args()
    if args.profile:
        profile_main(args)
        return
    bw = copy_bandwidth_bytes_per_s()
    configs = [
        (int(b), a == "on")
        for b in args.batches.split(",")
        for a in args.async_scheduling.split(",")
    ]
    # Timed runs first: once torch.profiler has run, CUPTI stays attached to the process and
    # slows every later launch, so the profiled runs (CUPTI columns only) come after them all.
    rows = [_engine_row(args, batch, async_on, bw, profile=False) for batch, async_on in configs]
    if args.kineto_dir:
        for row, (batch, async_on) in zip(rows, configs, strict=True):
            profiled = _engine_row(args, batch, async_on, bw, profile=True)
            row.update({k: v for k, v in profiled.items() if k not in row})
    print(f"copy bandwidth (read+write): {bw / 1e12:.2f} TB/s")
    print(
        f"{'batch':>5} {'async':>5} {'steps':>5} {'device us':>10} {'wall us':>9} "
        f"{'floor us':>9} {'x floor':>7}  device us per stage"
    )
    for r in rows:
        stages = ", ".join(f"{k} {v:.0f}" for k, v in r["stage_us"].items())
        stages += "; CPU us: " + ", ".join(f"{k} {v:.0f}" for k, v in r["cpu_us"].items())
        if "device_busy_cupti_us" in r:
            stages += (f"; CUPTI busy {r['device_busy_cupti_us']:.0f} us = "
                       f"{r['x_floor_cupti']:.2f} x its floor {r['floor_cupti_us']:.0f} us "
                       f"(ctx {r['kineto_mean_ctx']:.0f})")  # fmt: skip
        print(
            f"{r['batch']:>5} {r['async']:>5} {r['steps']:>5} {r['device_step_us']:>10.1f} "
            f"{r['wall_step_us']:>9.1f} {r['floor_us']:>9.1f} {r['x_floor']:>7.2f}  {stages}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth_Bps": bw, "rows": rows}, f, indent=2)


KINETO_STEPS = (40, 60)  # engine steps of the measured run recorded with torch.profiler


def _engine_row(
    args: argparse.Namespace, batch: int, async_on: bool, bw: float, profile: bool
) -> dict:
    """One engine run: steady decode steps of ``batch`` requests vs the floor. ``profile``:
    record engine steps ``KINETO_STEPS`` with torch.profiler and add the CUPTI columns."""
    from analysis import load_trace

    tag = f"decode_b{batch}_async_{'on' if async_on else 'off'}"
    kineto = os.path.join(args.kineto_dir, f"{tag}.json") if profile else None
    res = run_engine(
        decode_workload(batch, args.prompt_len, args.output_len, 151936),
        model_config=args.model_config,
        random_weights=True,
        device="cuda",
        dtype="bfloat16",
        async_scheduling=async_on,
        cuda_graphs=args.cuda_graphs == "on",
        max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(2048, batch * args.prompt_len),
        num_kv_blocks=max(256, batch * (args.prompt_len + args.output_len) // 16 + 64),
        max_model_len=args.prompt_len + args.output_len + 16,
        tag=tag,
        kineto_path=kineto,
        kineto_steps=KINETO_STEPS,
    )
    cfg = res.model.config
    weight_bytes = sum(t.numel() * t.element_size() for t in res.model.parameters())
    mean_ctx = args.prompt_len + args.output_len / 2
    kv_size = cfg.num_key_value_heads * cfg.head_dim
    kv_per_token = cfg.num_hidden_layers * 2 * kv_size * 2  # K and V, bf16, every layer
    kv_bytes = int(batch * mean_ctx * kv_per_token)
    floor_us = (weight_bytes + kv_bytes) / bw * 1e6
    steps = decode_steps(res.steps, batch)
    if res.first_profiled_step is not None:  # CUPTI slows launches: time only the steps before
        steps = steps[steps["step"] < res.first_profiled_step - 1]
    dev_us = float(steps["device_busy_ns"].median()) / 1e3
    # Per device stage (input_prep, forward, sample, ...): median over the same steps.
    sl = load_trace(res.trace).slices
    comp = sl[(sl["role"] == "compute") & sl["step"].isin(steps["step"])]
    per_stage = comp.groupby(["step", "name"])["dur_ns"].sum().groupby(level=1).median()
    row = {
        "batch": batch,
        "async": "on" if async_on else "off",
        "steps": len(steps),
        "device_step_us": dev_us,
        "wall_step_us": float(steps["step_ns"].median()) / 1e3,
        "floor_us": floor_us,
        "x_floor": dev_us / floor_us,
        "weight_MB": weight_bytes / 1e6,
        "kv_MB": kv_bytes / 1e6,
        "stage_us": {str(k): float(v) / 1e3 for k, v in per_stage.items()},
        "cpu_us": {
            c[: -len("_ns")]: float(steps[c].median()) / 1e3
            for c in (
                "schedule_ns",
                "prepare_inputs_ns",
                "launch_ns",
                "wait_output_ns",
                "update_from_output_ns",
            )
            if c in steps.columns
        },  # fmt: skip
    }
    if kineto and res.kineto_steps > 0:
        busy_us, top = _kineto_per_step(kineto, res.kineto_steps)
        # The profiled steps come late in the run: their floor counts their own (longer) context.
        first = KINETO_STEPS[0]  # the window may end early if the run has fewer steps
        ctx = args.prompt_len + first + (res.kineto_steps - 1) / 2 + 1
        window_floor_us = (weight_bytes + batch * ctx * kv_per_token) / bw * 1e6
        row["kineto_steps"] = res.kineto_steps
        row["kineto_mean_ctx"] = ctx
        row["device_busy_cupti_us"] = busy_us
        row["floor_cupti_us"] = window_floor_us
        row["x_floor_cupti"] = busy_us / window_floor_us
        row["top_kernels"] = top
    return row


def _kineto_per_step(path: str, num_steps: int, top: int = 15) -> tuple[float, list]:
    """From a Kineto trace of ``num_steps`` steady decode steps: the device's busy time per step
    (union of every kernel, memset and memcpy interval, any stream, over the window) and the
    most expensive kernels as (name, launches per step, device us per step)."""
    from analysis.intervals import measure, union

    with open(path) as f:
        events = json.load(f)["traceEvents"]
    count: Counter[str] = Counter()
    total: dict[str, float] = {}
    starts, ends = [], []
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and e.get("ph") == "X":
            count[e["name"]] += 1
            total[e["name"]] = total.get(e["name"], 0.0) + float(e.get("dur", 0.0))
            starts.append(int(float(e["ts"]) * 1000))
            ends.append(int((float(e["ts"]) + float(e.get("dur", 0.0))) * 1000))
    busy_ns = measure(union(np.asarray(starts, np.int64), np.asarray(ends, np.int64)))
    n = max(num_steps, 1)
    ranked = sorted(total.items(), key=lambda kv: -kv[1])[:top]
    print(f"{path}: {n} steps, device busy {busy_ns / 1e3 / n:.1f} us per step (CUPTI); "
          "top kernels (launches per step, device us per step):")  # fmt: skip
    for name, us in ranked:
        print(f"    {count[name] / n:7.1f} x {us / n:9.1f} us  {name[:110]}")
    return busy_ns / 1e3 / n, [(name, count[name] / n, us / n) for name, us in ranked]


if __name__ == "__main__":
    main()
