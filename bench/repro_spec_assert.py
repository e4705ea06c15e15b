"""Find what makes a second speculative engine in one process hit a device-side assert on CUDA
(docs/design.md §9, "Two live spec engines on CUDA").

``bench/bench_spec.py`` builds ``none``, runs it, then builds ``eagle`` (or ``ngram``) beside it;
on the H200 that build aborted with ``ScatterGatherKernel: index out of bounds``. Each case
below changes one thing against that sequence and runs in its own process with
``CUDA_LAUNCH_BLOCKING=1`` (so the failing launch is the one the traceback names); cases run
side by side (the assert is what is looked for, not speed). Prints one line per case (ok / FAILED
with the last lines of its output) and writes them as JSON.

Usage: python bench/repro_spec_assert.py [--cases bench,notrace,...] [--json PATH]
       python bench/repro_spec_assert.py --case NAME   (one case, in this process)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# case -> (engines built in order, as bench_spec variants; options)
CASES: dict[str, tuple[list[str], dict[str, Any]]] = {
    "bench": (["none", "eagle:3"], {}),
    "notrace": (["none", "eagle:3"], {"trace": False}),
    "closefirst": (["none", "eagle:3"], {"close_first": True}),
    "eagle_only": (["eagle:3"], {}),
    "nographs": (["none", "eagle:3"], {"spec_cuda_graphs": False}),
    "nowarmup": (["none", "eagle:3"], {"warmup": False}),
    "ngram": (["none", "ngram:1"], {}),
    "eagle_eagle": (["eagle:3", "mtp:3"], {}),
}


def run_case(name: str) -> None:
    """Build the case's engines in order (each runs the sample workload once) and report."""
    from bench._spec_engines import SpecEngine, Variant
    from bench.bench_spec import base_workload, copies

    variants, opts = CASES[name]
    args = argparse.Namespace(
        workload="samples/workloads/pycode_prompts.jsonl", limit=None, max_tokens=64
    )
    base = base_workload(args)
    trace_dir = tempfile.mkdtemp(prefix=f"stepscope-repro-{name}-")
    kwargs: dict[str, Any] = {
        "model": "samples/models/pycoder-14m",
        "device": os.environ.get("STEPSCOPE_REPRO_DEVICE", "cuda"),
        "dtype": "bfloat16",
        "max_num_seqs": 64,
    }
    if opts.get("spec_cuda_graphs") is False:
        kwargs["spec_cuda_graphs"] = False
    if opts.get("warmup") is False:
        kwargs["warmup"] = False
    live: list[Any] = []
    for text in variants:
        method, _, k = text.partition(":")
        v = Variant(None) if method == "none" else Variant(method, int(k))
        start = time.perf_counter()
        if opts.get("trace", True):
            e = SpecEngine(v, trace_dir, **kwargs)
            rec = e.run("warm", copies(base, 2, "warm"))
            closer = e.close
        else:
            from engine.llm import LLM

            llm = LLM(**kwargs, **v.engine_kwargs())
            outs = llm.run_workload(copies(base, 2, "warm"))
            rec = sum(len(o.output_token_ids) for o in outs)
            closer = llm.close
        print(
            f"[{name}] {v.name}: built and ran in {time.perf_counter() - start:.1f} s ({rec})",
            flush=True,
        )
        if opts.get("close_first"):
            closer()
        else:
            live.append(closer)
    for close in live:
        close()
    print(f"[{name}] ok", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=sorted(CASES), help="run one case in this process")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated cases to run")
    p.add_argument("--timeout-s", type=float, default=420)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.case:
        run_case(args.case)
        return 0
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", PYTHONUNBUFFERED="1")
    procs = {}
    for name in [c for c in args.cases.split(",") if c]:
        if name not in CASES:
            p.error(f"unknown case {name!r}: one of {sorted(CASES)}")
        procs[name] = subprocess.Popen(
            [sys.executable, __file__, "--case", name],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    results = {}
    deadline = time.monotonic() + args.timeout_s
    for name, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            out += "\n[timed out]"
        ok = proc.returncode == 0 and out.rstrip().endswith("ok")
        results[name] = {"ok": ok, "returncode": proc.returncode, "tail": out[-6000:]}
        print(f"== {name}: {'ok' if ok else 'FAILED'} (rc {proc.returncode})", flush=True)
        if not ok:
            print("\n".join(out.splitlines()[-60:]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cases": {k: CASES[k][0] for k in results}, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
