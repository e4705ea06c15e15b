"""A mixed (prefill + decode) step, eager vs replayed from a mixed-step CUDA graph (issue 17).

One step of ``--tokens`` tokens (default 2048): ``--decode-reqs`` requests decoding one token each
at context ~``--decode-ctx``, plus one fresh request prefilling the rest in one chunk (a new one
every step; the previous one finishes). Both modes run the same steps through the model runner
(``ModelRunner.execute_model``, the engine's code path: packed batch, h2d, input prep, forward,
logits, greedy sample, d2h), with random weights of ``--model-config``'s shape, alternating
eager / graph step by step after ``--warmup`` untimed steps each. Per step:

* ``host_ms``: CPU time of ``execute_model`` (prepare + launch), perf_counter;
* ``step_ms``: CUDA events on the compute stream around the launch, steps isolated (synchronised
  before each): the device span of the step, gaps waiting for the CPU's launches included;
* ``device_ms``: the same events with the compute stream held by a ``torch.cuda._sleep`` first,
  so the CPU enqueues the whole step before the device starts: device work only (a sample is
  dropped if the sleep ended before the launch did: ``device_valid`` counts the kept ones);
* ``wall_ms``: perf_counter from the launch to the sampled tokens on the host.

Medians (p10/p90) over ``--steps`` steps (>= 50). ``prefill tok/s`` = tokens / step_ms. The
target of issue 17: a 2048-token mixed step <= 4 ms on the H200 for the Qwen3-0.6B shape.
``--profile``: top kernels of one eager step (torch.profiler device time), per eager mode.
``--modes``: the modes timed, alternately (default ``eager,graph``); a ``+split`` suffix runs
that mode with the varlen launch's ``split_decodes`` key on (the step's one-token requests
attended by the decode kernel; docs/design.md §2.6), e.g. ``--modes graph,graph+split``.

Usage (CUDA): python bench/bench_mixed_step.py [--json bench/results/h200/mixed_step.json]
CPU smoke test (graph mode = the padded path run eagerly):
  python bench/bench_mixed_step.py --device cpu --model-config tiny.json --tokens 64 \
      --decode-reqs 4 --decode-ctx 16 --steps 3 --warmup 1 --json /tmp/m.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.config import CacheConfig, SchedulerConfig  # noqa: E402
from engine.device import CpuDevice, CudaDevice, Device  # noqa: E402
from engine.engine_parts import DTYPES, load_model_config  # noqa: E402
from engine.kernels.attention import VARLEN_LAUNCH  # noqa: E402
from engine.kernels.backend import create_kernel_backend  # noqa: E402
from engine.model.loader import build_random_model  # noqa: E402
from engine.runner.model_runner import ModelRunner  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402

BLOCK_SIZE = 16
TARGET_MS = 4.0
GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
SLEEP_CYCLES = 200_000_000  # ~0.1 s at 2 GHz: longer than any eager launch measured (27 ms)


@dataclass
class Workload:
    """The step sequence one mode runs: decode requests with fixed block tables, and fresh
    prompts of ``prompt_len`` tokens (the last one shorter) filling the rest of each step; each
    step's prompts finish at the next step, and the prompt block sets alternate between two."""

    tokens: int
    decode_reqs: int
    decode_ctx: int
    prompt_len: int
    num_steps: int  # timed + warm-up
    vocab: int
    frontier: dict[str, int] = field(default_factory=dict)
    step: int = 0
    num_mixed: int = 0
    live_prompts: list[str] = field(default_factory=list)

    @property
    def prefill_len(self) -> int:
        return self.tokens - self.decode_reqs

    @property
    def prompt_lens(self) -> list[int]:
        full, rest = divmod(self.prefill_len, self.prompt_len)
        return [self.prompt_len] * full + ([rest] if rest else [])

    @property
    def decode_blocks(self) -> int:
        return -(-(self.decode_ctx + self.num_steps + 1) // BLOCK_SIZE)

    @property
    def prompt_blocks(self) -> int:
        return -(-(self.prompt_len + 1) // BLOCK_SIZE)

    @property
    def prefill_blocks(self) -> int:
        return len(self.prompt_lens) * self.prompt_blocks

    @property
    def num_blocks(self) -> int:
        return self.decode_reqs * self.decode_blocks + 2 * self.prefill_blocks + 1

    @property
    def max_model_len(self) -> int:
        return max(self.decode_ctx + self.num_steps + 2, self.prompt_len + 2)

    def describe(self) -> str:
        lens = self.prompt_lens
        return (
            f"{self.tokens} tokens = {self.decode_reqs} decodes at context ~{self.decode_ctx} + "
            f"{len(lens)} prompt(s) of {lens[0]}" + (f" (last {lens[-1]})" if len(lens) > 1 else "")
        )

    def prompt(self, salt: int, length: int) -> list[int]:
        return [(7 * salt + 13 * j) % (self.vocab - 2) + 2 for j in range(length)]

    def setup_steps(self) -> list[SchedulerOutput]:
        """Prefill the decode requests, ``tokens`` tokens per step at most (untimed)."""
        outs, batch, used = [], [], 0
        for i in range(self.decode_reqs):
            if used + self.decode_ctx > self.tokens and batch:
                outs.append(self._out(batch, {}, set()))
                batch, used = [], 0
            blocks = list(range(i * self.decode_blocks, (i + 1) * self.decode_blocks))
            batch.append(_new(f"d{i}", self.prompt(i, self.decode_ctx), blocks))
            used += self.decode_ctx
        if batch:
            outs.append(self._out(batch, {}, set()))
        return outs

    def mixed_step(self) -> SchedulerOutput:
        """Every decode request runs one token; fresh prompts fill the rest of the step."""
        k = self.num_mixed
        self.num_mixed += 1
        base = self.decode_reqs * self.decode_blocks + (k % 2) * self.prefill_blocks
        new = []
        for j, length in enumerate(self.prompt_lens):
            first = base + j * self.prompt_blocks
            blocks = list(range(first, first + self.prompt_blocks))
            new.append(_new(f"p{k}.{j}", self.prompt(1000 + 37 * k + j, length), blocks))
        cached = {f"d{i}": 1 for i in range(self.decode_reqs)}
        finished = set(self.live_prompts)
        self.live_prompts = [n.req_id for n in new]
        return self._out(new, cached, finished)

    def _out(
        self, new: list[NewRequestData], cached: dict[str, int], finished: set[str]
    ) -> SchedulerOutput:
        tokens = {r: self.frontier.get(r, 0) for r in cached}  # frontier before this step
        num = {n.req_id: len(n.prompt_token_ids) for n in new} | cached
        out = SchedulerOutput(
            step=self.step,
            scheduled_new_reqs=new,
            scheduled_cached_reqs=CachedRequestData(
                req_ids=list(cached),
                new_block_ids=[[] for _ in cached],
                num_computed_tokens=list(tokens.values()),
            ),
            num_scheduled_tokens=num,
            total_num_scheduled_tokens=sum(num.values()),
            finished_req_ids=finished,
        )
        for req_id, n in num.items():
            self.frontier[req_id] = self.frontier.get(req_id, 0) + n
        self.step += 1
        return out


def _new(req_id: str, prompt: list[int], blocks: list[int]) -> NewRequestData:
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=prompt,
        output_token_ids=[],
        sampling_params=GREEDY,
        block_ids=blocks,
        num_computed_tokens=0,
    )


@dataclass
class Mode:
    name: str
    runner: ModelRunner
    work: Workload
    split: bool  # the varlen launch's split_decodes key, set around every call of this mode
    samples: dict[str, list[float]] = field(default_factory=dict)
    tokens: list[list[int]] = field(default_factory=list)  # decode tokens per timed step
    error: str | None = None


@contextlib.contextmanager
def _split_decodes(on: bool) -> Iterator[None]:
    """The bf16 varlen launch entry with ``split_decodes`` set to ``on`` for the block (captures
    and eager launches alike read the table when they launch)."""
    entry = VARLEN_LAUNCH[2]
    before = entry.get("split_decodes", False)
    entry["split_decodes"] = on
    try:
        yield
    finally:
        entry["split_decodes"] = before


def _time_step(mode: Mode, device: Device, hold: bool) -> dict[str, float]:
    """One isolated step: host, step (or device, with ``hold``) and wall time."""
    with _split_decodes(mode.split):
        return _time_step_in(mode, device, hold)


def _time_step_in(mode: Mode, device: Device, hold: bool) -> dict[str, float]:
    out = mode.work.mixed_step()
    cuda = device.is_cuda
    device.synchronize()
    start = end = None
    if cuda:
        stream = device.compute_stream
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            if hold:
                torch.cuda._sleep(SLEEP_CYCLES)
            start.record(stream)
    t0 = time.perf_counter()
    handle = mode.runner.execute_model(out)
    t1 = time.perf_counter()
    held = False
    if cuda:
        assert end is not None and start is not None
        end.record(device.compute_stream)
        held = not start.query()  # the device had not started the step when the CPU finished
    result = handle.get()
    t2 = time.perf_counter()
    device.synchronize()
    row = {"host_ms": (t1 - t0) * 1e3, "wall_ms": (t2 - t0) * 1e3}
    span = start.elapsed_time(end) if cuda and start is not None else row["wall_ms"]
    if not hold:
        row["step_ms"] = span
    elif held:
        row["device_ms"] = span
    decode = [
        toks[0] for r, toks in zip(result.req_ids, result.sampled_token_ids, strict=True) if toks
    ]
    mode.tokens.append(decode)
    return row


def _stats(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    v = sorted(values)

    def q(p: float) -> float:
        return v[min(len(v) - 1, int(p * (len(v) - 1) + 0.5))]

    return {"n": len(v), "p10": q(0.1), "p50": q(0.5), "p90": q(0.9), "mean": sum(v) / len(v)}


def _build(args: argparse.Namespace) -> tuple[Device, Any, Any, Any]:
    """The device, one model of ``--model-config`` (random weights), the kernels, its config."""
    cuda = args.device == "cuda"
    device: Device = CudaDevice(0) if cuda else CpuDevice()
    cfg = load_model_config(args.model_config)
    kernels = create_kernel_backend("triton" if cuda or args.triton else "torch")
    dtype = DTYPES[args.dtype if cuda else "float32"]
    model = build_random_model(cfg, dtype, device.torch_device, seed=0, kernels=kernels)
    return device, model, kernels, cfg


def _make_mode(
    name: str, args: argparse.Namespace, device: Device, model: Any, kernels: Any, work: Workload
) -> Mode:
    split = name.endswith("+split")
    with _split_decodes(split):
        return _make_mode_in(name, split, args, device, model, kernels, work)


def _make_mode_in(
    name: str,
    split: bool,
    args: argparse.Namespace,
    device: Device,
    model: Any,
    kernels: Any,
    work: Workload,
) -> Mode:
    limits = SchedulerConfig(
        max_num_seqs=max(args.max_num_seqs, args.decode_reqs + len(work.prompt_lens) + 1),
        max_model_len=work.max_model_len,
        max_num_batched_tokens=args.tokens,
    )
    t0 = time.perf_counter()
    runner = ModelRunner(
        model,
        device,
        limits,
        CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=work.num_blocks),
        kernels=kernels,
        cuda_graphs=True,  # decode graphs on in both modes, as the engine runs them
        mixed_graph_max_tokens=args.tokens if name.startswith("graph") else 0,
    )
    graphs = runner.graphs
    print(f"[{name}] runner built in {time.perf_counter() - t0:.1f} s: decode sizes "
          f"{len(graphs.sizes)}, mixed buckets {graphs.buckets}, failure={graphs.failure}, "
          f"mixed_failure={graphs.mixed_failure}", flush=True)  # fmt: skip
    mode = Mode(name, runner, dataclasses.replace(work, frontier={}, live_prompts=[]), split)
    for out in mode.work.setup_steps():
        runner.execute_model(out).get()
    for _ in range(args.warmup):
        runner.execute_model(mode.work.mixed_step()).get()
    device.synchronize()
    return mode


def _profile_eager_step(mode: Mode, device: Device, top: int = 15) -> list[dict[str, Any]]:
    """Top kernels of one step by device time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    device.synchronize()
    with (
        _split_decodes(mode.split),
        profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof,
    ):
        mode.runner.execute_model(mode.work.mixed_step()).get()
        device.synchronize()
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            entry = by_name.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.time_range.elapsed_us()
    rows = [{"kernel": n[:90], "count": int(c), "us": t} for n, (c, t) in by_name.items()]
    rows.sort(key=lambda r: -r["us"])
    total = sum(r["us"] for r in rows)
    print(f"\none {mode.name} step under torch.profiler: {sum(r['count'] for r in rows)} device "
          f"ops, {total / 1e3:.2f} ms of kernel time; top {top}:")  # fmt: skip
    for r in rows[:top]:
        print(f"  {r['count']:>5} x {r['us']:>9.1f} us  {r['kernel']}")
    return rows[:top] + [{"kernel": "TOTAL", "count": len(rows), "us": total}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model-config", default="qwen3-0.6b")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the mixed step")
    p.add_argument("--decode-reqs", type=int, default=64)
    p.add_argument("--decode-ctx", type=int, default=256)
    p.add_argument(
        "--prompt-lens",
        default="128,1984",
        help="one scenario per length: the step's prefill part as prompts of this length "
        "(128: the issue's end-to-end workloads; 1984: one long prompt, attention-heavy)",
    )
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--steps", type=int, default=60, help="timed steps per mode and pass")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--triton", action="store_true", help="Triton kernels on the CPU (interpret)")
    p.add_argument("--profile", action="store_true", help="top kernels of one eager step")
    p.add_argument(
        "--modes",
        default="eager,graph",
        help="modes timed alternately: eager, graph, and either with +split (the varlen "
        "launch's split_decodes key on)",
    )
    p.add_argument(
        "--json", default=None, help="default on CUDA: bench/results/h200/mixed_step.json"
    )
    args = p.parse_args()
    if not 0 <= args.decode_reqs < args.tokens or args.decode_ctx > args.tokens:
        p.error("need 0 <= --decode-reqs < --tokens and --decode-ctx <= --tokens")
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or any(
        m.removesuffix("+split") not in ("eager", "graph") for m in args.modes
    ):
        p.error("--modes: a comma list of eager, graph, eager+split, graph+split")
    prompt_lens = [int(x) for x in args.prompt_lens.split(",") if x]
    if any(n < 1 for n in prompt_lens):
        p.error("--prompt-lens must be positive integers")
    path = args.json or (
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "results/h200/mixed_step.json")
        if args.device == "cuda"
        else None
    )
    report: dict[str, Any] = {"args": vars(args), "machine": _machine(args.device)}
    report["scenarios"] = {}
    try:
        device, model, kernels, cfg = _build(args)
        for prompt_len in prompt_lens:
            scenario: dict[str, Any] = {"modes": {}}
            report["scenarios"][f"prompt_len={prompt_len}"] = scenario
            try:
                _run(args, scenario, device, model, kernels, cfg, prompt_len)
            except Exception:  # noqa: BLE001 -- one shot: keep the other scenarios
                scenario["error"] = traceback.format_exc()
                print(scenario["error"], file=sys.stderr)
            if device.is_cuda:
                torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 -- one shot: keep whatever was measured
        report["error"] = traceback.format_exc()
        print(report["error"], file=sys.stderr)
    finally:
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=1, default=str)
            print(f"\nwrote {path}")
    failed = "error" in report or any("error" in s for s in report["scenarios"].values())
    if failed:
        sys.exit(1)


def _run(
    args: argparse.Namespace,
    report: dict[str, Any],
    device: Device,
    model: Any,
    kernels: Any,
    cfg: Any,
    prompt_len: int,
) -> None:
    """One scenario: both modes built, timed alternately, summarised into ``report``."""
    num_steps = args.warmup + args.steps * 2 + 4
    work = Workload(
        args.tokens, args.decode_reqs, args.decode_ctx, min(prompt_len, args.tokens - args.decode_reqs),
        num_steps, cfg.vocab_size,
    )  # fmt: skip
    report["workload"] = work.describe()
    dtype = args.dtype if device.is_cuda else "float32"
    print(f"\n=== mixed step: {work.describe()}; {args.model_config} {dtype} on "
          f"{_machine(args.device)['device']}", flush=True)  # fmt: skip
    modes: list[Mode] = []
    for name in args.modes:
        try:
            modes.append(_make_mode(name, args, device, model, kernels, work))
        except Exception:  # noqa: BLE001 -- report the other mode anyway
            report["modes"][name] = {"error": traceback.format_exc()}
            print(f"[{name}] failed:\n{report['modes'][name]['error']}", file=sys.stderr)
    for hold in (False, True):  # pass 1: step time; pass 2: device time behind a sleep
        if hold and not device.is_cuda:
            break
        for _ in range(args.steps):
            for mode in modes:
                if mode.error is not None:
                    continue
                try:
                    for key, value in _time_step(mode, device, hold).items():
                        mode.samples.setdefault(key, []).append(value)
                except Exception:  # noqa: BLE001
                    mode.error = traceback.format_exc()
                    print(f"[{mode.name}] step failed:\n{mode.error}", file=sys.stderr)
    for mode in modes:
        graphs = mode.runner.graphs
        report["modes"][mode.name] = {
            "stats": {k: _stats(v) for k, v in mode.samples.items()},
            "samples": mode.samples,
            "mixed_replays": graphs.num_mixed_replays,
            "mixed_eager": graphs.num_mixed_eager,
            "buckets": graphs.buckets,
            "mixed_failure": graphs.mixed_failure,
            "error": mode.error,
        }
    _agreement(modes, report)
    _print_table(args, report)
    for mode in modes if args.profile and device.is_cuda else []:
        if not mode.name.startswith("eager") or mode.error is not None:
            continue
        key = "profile_" + mode.name.replace("+", "_")
        try:
            report[key] = _profile_eager_step(mode, device)
        except Exception:  # noqa: BLE001
            report[key + "_error"] = traceback.format_exc()
            print(report[key + "_error"], file=sys.stderr)
    for mode in modes:
        mode.runner.close()


def _agreement(modes: list[Mode], report: dict[str, Any]) -> None:
    """Greedy sampled tokens of the same steps, the first mode vs the second (bf16: a few may
    differ)."""
    if len(modes) < 2:
        return
    pairs = list(zip(modes[0].tokens, modes[1].tokens, strict=False))
    same = sum(a == b for step in pairs for a, b in zip(step[0], step[1], strict=False))
    total = sum(min(len(a), len(b)) for a, b in pairs)
    report["decode_tokens_equal"] = {"equal": same, "total": total}


def _print_table(args: argparse.Namespace, report: dict[str, Any]) -> None:
    print(f"\n{report['workload']}: median (p10-p90) over {args.steps} steps per mode (ms)")
    head = f"{'mode':<11} {'host launch':>20} {'step (events)':>20} {'device only':>20} " \
        f"{'wall':>20} {'prefill tok/s':>14} {'replays':>8}"  # fmt: skip
    print(head)
    print("-" * len(head))
    for name, m in report["modes"].items():
        if "stats" not in m:
            print(f"{name:<11} failed (see the JSON)")
            continue
        s = m["stats"]
        cells = [_cell(s, k) for k in ("host_ms", "step_ms", "device_ms", "wall_ms")]
        step = s.get("step_ms", {}).get("p50")
        rate = f"{args.tokens / step * 1e3:,.0f}" if step else "-"
        print(f"{name:<11} {cells[0]:>20} {cells[1]:>20} {cells[2]:>20} {cells[3]:>20} "
              f"{rate:>14} {m['mixed_replays']:>8}")  # fmt: skip
    graph = report["modes"].get("graph", {}).get("stats", {}).get("step_ms", {}).get("p50")
    eager = report["modes"].get("eager", {}).get("stats", {}).get("step_ms", {}).get("p50")
    if graph and eager:
        report["speedup"] = eager / graph
        print(f"graph vs eager step: {eager / graph:.2f}x")
        if args.tokens == 2048:
            report["target_met"] = graph <= TARGET_MS
            print(f"target (2048-token step <= {TARGET_MS} ms): "
                  f"{'met' if graph <= TARGET_MS else 'NOT met'} ({graph:.2f} ms)")  # fmt: skip
    for name in report["modes"]:
        base = name.removesuffix("+split")
        split = report["modes"][name].get("stats", {}).get("device_ms", {}).get("p50")
        plain = report["modes"].get(base, {}).get("stats", {}).get("device_ms", {}).get("p50")
        if name != base and split and plain:
            report[f"split_decodes_{base}"] = plain / split
            print(f"{base}: split_decodes on vs off, device only: {plain:.3f} -> {split:.3f} ms "
                  f"({plain / split:.3f}x)")  # fmt: skip
    agree = report.get("decode_tokens_equal")
    if agree:
        first, second = list(report["modes"])[:2]
        print(f"greedy sampled tokens equal {first} vs {second}: "
              f"{agree['equal']}/{agree['total']}")  # fmt: skip


def _cell(stats: dict[str, Any], key: str) -> str:
    """``p50 (p10-p90)`` of one timing, or ``-`` when it has no samples."""
    st = stats.get(key, {"n": 0})
    if not st.get("n"):
        return "-"
    return f"{st['p50']:.2f} ({st['p10']:.2f}-{st['p90']:.2f})"


def _machine(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device == "cuda" and torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    else:
        info["device"] = f"cpu ({os.cpu_count()} cores)"
    return info


if __name__ == "__main__":
    main()
