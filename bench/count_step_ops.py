"""Device work launched per steady decode step: torch ops and Triton kernels, by submitted body.

Every piece of device work the engine enqueues goes through ``Device.submit(stream, fn)``. This
script wraps ``submit`` so that each body runs under a ``TorchDispatchMode`` that counts the aten
ops it dispatches (``aten``: a kernel launch, copy or fill on CUDA; ``view``: no device work;
``alloc``: ``empty*``) and counts Triton kernel
launches (``JITFunction[grid](...)``; torch ops inside a Triton launch, the interpreter's own, are
not counted). Bodies are grouped by name (``sample``, ``kernel`` = a staged-write apply,
``copy`` = an h2d copy, ``<lambda>`` = input prep, ...); ``forward`` is left out: on CUDA a
decode forward is one graph replay (on the CPU it runs eagerly, every layer's ops).

Only steady decode steps count (every one of ``--batch`` requests runs one token); the table is
the median per step. With ``--baseline-tree DIR`` it also runs an older checkout in a subprocess
and prints both columns.

CPU, torch kernels:   python bench/count_step_ops.py --batch 64
CPU, Triton kernels:  TRITON_INTERPRET=1 python bench/count_step_ops.py --batch 16 -- --triton on
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_phases import _engine_argv, _workload  # noqa: E402

SKIPPED = ("forward",)  # a graph replay on CUDA


def _kind(func: Any) -> str:
    """``view`` (no device work: slices, transposes), ``alloc`` (``empty*``: allocator calls)
    or ``aten`` (a kernel, copy or fill on the device)."""
    if func.is_view:
        return "view"
    if func.__name__.startswith("empty"):
        return "alloc"
    return "aten"


class _OpCounter(TorchDispatchMode):
    def __init__(self, books: collections.Counter[str], key: str, paused: threading.local) -> None:
        super().__init__()
        self.books, self.key, self.paused = books, key, paused

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not getattr(self.paused, "on", False):
            self.books[f"{self.key}:{_kind(func)}"] += 1
        return func(*args, **(kwargs or {}))


class StepOpCounter:
    """Counts, per engine step, aten ops and Triton launches of each submitted body."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.per_step: dict[int, collections.Counter[str]] = {}
        self._paused = threading.local()
        self._lock = threading.Lock()

    def wrap_submit(self, device: Any) -> None:
        original = device.submit

        def submit(stream: Any, fn: Callable[[], None]) -> None:
            step = self.step
            name = getattr(fn, "__name__", type(fn).__name__)
            if step is None or name in SKIPPED:
                return original(stream, fn)
            books = self.per_step.setdefault(step, collections.Counter())

            def counted() -> None:
                self._paused.books, self._paused.key = books, name
                with _OpCounter(books, name, self._paused):
                    fn()
                self._paused.books = None

            counted.__name__ = name
            return original(stream, counted)

        device.submit = submit

    def wrap_triton(self) -> None:
        """Count ``kernel[grid](...)`` launches (compiled or interpreted) as one op each."""
        import triton.runtime.interpreter as interp
        import triton.runtime.jit as jit

        paused = self._paused
        for cls in (jit.JITFunction, getattr(interp, "InterpretedFunction", None)):
            if cls is None:
                continue
            getitem = cls.__getitem__

            def patched(kernel: Any, grid: Any, _getitem: Any = getitem) -> Any:
                launch = _getitem(kernel, grid)

                @functools.wraps(launch)
                def counted(*args: Any, **kwargs: Any) -> Any:
                    books = getattr(paused, "books", None)
                    if books is not None and not getattr(paused, "on", False):
                        books[f"{paused.key}:triton"] += 1
                    paused.on = True
                    try:
                        return launch(*args, **kwargs)
                    finally:
                        paused.on = False

                return counted

            cls.__getitem__ = patched


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from engine.cli import build_parser, config_from_args
    from engine.llm import LLM

    config = config_from_args(build_parser().parse_args(_engine_argv(args)))
    llm = LLM(config)
    llm.run_workload(_workload(args, 0, 4))  # warm-up
    counter = StepOpCounter()
    counter.wrap_submit(llm.engine.runner.device)
    try:
        counter.wrap_triton()
    except ImportError:
        pass
    sched = llm.engine.scheduler
    schedule = sched.schedule
    steady: set[int] = set()

    def timed_schedule(*a: Any, **k: Any) -> Any:
        so = schedule(*a, **k)
        counter.step = so.step
        if so.num_decode_reqs == args.batch and so.total_num_scheduled_tokens == args.batch:
            steady.add(so.step)
        return so

    sched.schedule = timed_schedule
    llm.run_workload(_workload(args, 1, args.out_len))
    llm.engine.runner.device.synchronize()
    llm.close()
    keys = sorted({k for s in steady for k in counter.per_step.get(s, {})})
    table = {
        k: statistics.median(counter.per_step.get(s, {}).get(k, 0) for s in steady) for k in keys
    }
    table["launches"] = statistics.median(
        sum(v for k, v in counter.per_step.get(s, {}).items() if k.endswith((":aten", ":triton")))
        for s in steady
    )
    return {"steady_steps": len(steady), "ops": table}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _args import add_model_args

    add_model_args(p)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--in-len", type=int, default=16)
    p.add_argument("--out-len", type=int, default=24)
    p.add_argument("--vocab", type=int, default=4000)
    p.add_argument("--async-scheduling", default="on", choices=("auto", "on", "off"))
    p.add_argument("--baseline-tree", default=None)
    p.add_argument("--child-json", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("engine_args", nargs="*")
    raw = sys.argv[1:]
    args = p.parse_args(raw)
    if args.model is None and args.model_config is None:
        args.model = "samples/models/pycoder-draft-2m"
    if args.child_json:
        print(json.dumps(measure(args)))
        return
    columns = {}
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"after": here}
    if args.baseline_tree:
        trees = {"before": os.path.abspath(args.baseline_tree), **trees}
    child = [a for a in raw if a not in ("--baseline-tree", args.baseline_tree)]
    for name, tree in trees.items():
        env = dict(os.environ, PYTHONPATH=tree)
        cmd = [sys.executable, os.path.abspath(__file__), "--child-json", *child]
        proc = subprocess.run(cmd, env=env, cwd=here, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-4000:]}")
        columns[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    keys = sorted({k for c in columns.values() for k in c["ops"]} - {"launches"}) + ["launches"]
    print("ops per steady decode step (median; 'forward' left out; launches = aten + triton)")
    print(f"{'body:kind':<24}" + "".join(f"{n:>10}" for n in columns))
    for k in keys:
        print(f"{k:<24}" + "".join(f"{c['ops'].get(k, 0):>10g}" for c in columns.values()))


if __name__ == "__main__":
    main()
