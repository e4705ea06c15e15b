"""Cold start: is the first run on a fresh machine as fast as the second? (issue 17)

Runs ``stepscope run`` twice, each in a fresh subprocess: the first with an empty
``TRITON_CACHE_DIR`` (a fresh machine: every Triton kernel compiles), the second with the cache the
first one filled (as any later run on that machine). Prints each run's output tok/s, run time and
warm-up time (the engine's warm-up happens at start-up, before the run's clock starts), and the
ratio first / second. Target on the H200: >= 0.90 (warm-up compiles what the run reaches, so
nothing compiles inside the measured run). ``--without-warmup`` adds the same pair with
``--warmup off``, to show what warm-up buys.

    # H200 (defaults: Qwen3-0.6B shape, random bf16 weights, 1024 x (128 -> 512), default flags:
    # max_num_seqs sized to the device; each run lasts ~15 s)
    python bench/bench_cold_start.py --out bench/results/h200/cold_start.json
    # the CPU smoke check with the sample model
    python bench/bench_cold_start.py --cpu-smoke
    # any other run: everything after -- goes to `stepscope run`
    python bench/bench_cold_start.py -- --model-config qwen3-8b --random-weights ...
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
H200_ARGS = [
    "--model-config", "qwen3-0.6b", "--random-weights", "--dtype", "bfloat16",
    "--device", "cuda",
    "--workload", "synthetic:n=1024,in=128,out=512,vocab=151000,seed=0",
]  # fmt: skip
CPU_SMOKE_ARGS = [
    "--model", str(ROOT / "samples/models/pycoder-14m"), "--device", "cpu",
    "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--block-size", "8",
    "--num-kv-blocks", "64", "--warmup", "on",
    "--workload", "synthetic:n=8,in=8-16,out=8,vocab=1000,seed=0",
]  # fmt: skip
_TOKENS = re.compile(r"^output tokens\s+(\d+)\s+in ([\d.]+) s\s+=\s+([\d.]+) tok/s", re.M)
_WARMUP = re.compile(r"^warm-up\s+([\d.]+) s\s+\((\d+) dummy steps", re.M)
_TTFT = re.compile(r"^TTFT ms\s+p50\s+([\d.]+)", re.M)
_KV = re.compile(r"^KV cache:.*$", re.M)


@dataclass
class Run:
    label: str
    triton_cache: str  # "empty" or "warm"
    warmup: bool
    output_tokens: int
    run_s: float
    tok_s: float
    warmup_s: float
    warmup_steps: int
    ttft_p50_ms: float | None
    process_s: float  # the whole subprocess: imports, model build, warm-up, run
    kv_line: str


def run_once(label: str, run_args: list[str], cache_dir: str, fresh: bool, warmup: bool) -> Run:
    """One ``stepscope run`` in a fresh interpreter with ``TRITON_CACHE_DIR=cache_dir``."""
    args = list(run_args)
    if "--warmup" not in args:
        args += ["--warmup", "auto" if warmup else "off"]
    elif not warmup:
        i = args.index("--warmup")
        args[i + 1] = "off"
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "stepscope.cli", "run", *args, "--no-progress"]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, check=False)
    process_s = time.monotonic() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{label}: stepscope run exited {proc.returncode}")
    out = proc.stdout
    tokens = _TOKENS.search(out)
    if tokens is None:
        raise SystemExit(f"{label}: no 'output tokens' line in the run summary:\n{out[-2000:]}")
    warm = _WARMUP.search(out)
    ttft = _TTFT.search(out)
    kv = _KV.search(out)
    return Run(
        label=label,
        triton_cache="empty" if fresh else "warm",
        warmup=warmup,
        output_tokens=int(tokens.group(1)),
        run_s=float(tokens.group(2)),
        tok_s=float(tokens.group(3)),
        warmup_s=float(warm.group(1)) if warm else 0.0,
        warmup_steps=int(warm.group(2)) if warm else 0,
        ttft_p50_ms=float(ttft.group(1)) if ttft else None,
        process_s=process_s,
        kv_line=kv.group(0) if kv else "",
    )


def run_pair(run_args: list[str], warmup: bool) -> tuple[Run, Run]:
    """First run on an empty Triton cache, second on the cache it left."""
    tag = "warm-up on" if warmup else "warm-up off"
    with tempfile.TemporaryDirectory(prefix="stepscope-triton-") as cache:
        first = run_once(f"first ({tag})", run_args, cache, fresh=True, warmup=warmup)
        second = run_once(f"second ({tag})", run_args, cache, fresh=False, warmup=warmup)
    return first, second


def print_table(runs: list[Run]) -> None:
    print(
        f"{'run':<22} {'triton cache':>12} {'warm-up s':>10} {'steps':>6} {'run s':>8} "
        f"{'tok/s':>10} {'TTFT p50 ms':>12} {'process s':>10}"
    )
    for r in runs:
        ttft = f"{r.ttft_p50_ms:.1f}" if r.ttft_p50_ms is not None else "n/a"
        print(
            f"{r.label:<22} {r.triton_cache:>12} {r.warmup_s:>10.2f} {r.warmup_steps:>6} "
            f"{r.run_s:>8.2f} {r.tok_s:>10.1f} {ttft:>12} {r.process_s:>10.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="the sample model on the CPU")
    p.add_argument("--without-warmup", action="store_true", help="also the pair with --warmup off")
    p.add_argument("--target", type=float, default=0.90, help="first/second tok/s to pass")
    p.add_argument("--out", help="write the runs and ratios here (JSON)")
    args = p.parse_args(argv)
    run_args = passthrough or (CPU_SMOKE_ARGS if args.cpu_smoke else H200_ARGS)
    print("stepscope run " + " ".join(run_args))
    pairs = [run_pair(run_args, warmup=True)]
    if args.without_warmup:
        pairs.append(run_pair(run_args, warmup=False))
    runs = [r for pair in pairs for r in pair]
    if runs[0].kv_line:
        print(runs[0].kv_line)
    print_table(runs)
    ratios = {}
    for first, second in pairs:
        ratio = first.tok_s / second.tok_s if second.tok_s else float("nan")
        key = "warmup_on" if first.warmup else "warmup_off"
        ratios[key] = ratio
        print(f"first / second tok/s ({key.replace('_', ' ')}): {ratio:.3f}")
    passed = ratios["warmup_on"] >= args.target
    print(f"target first/second >= {args.target:.2f}: {'met' if passed else 'NOT met'}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(
                {"args": run_args, "runs": [asdict(r) for r in runs], "ratios": ratios}, f, indent=1
            )
        print(f"wrote {args.out}")
    return 0 if passed or args.cpu_smoke else 1


if __name__ == "__main__":
    raise SystemExit(main())
