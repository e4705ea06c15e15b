"""Host time per engine phase in steady decode steps: schedule, prepare, launch, update, output.

Builds the engine as ``stepscope run`` does (its parser and ``EngineConfig``), runs a warm-up
workload, then ``--runs`` timed runs of ``--batch`` requests that arrive together (decode-heavy:
``--out-len`` output tokens each). Each phase is timed around the engine's own methods:

* ``schedule``: ``Scheduler.schedule``;
* ``prepare``: ``ModelRunner._prepare_step`` (state-table diffs, the packed batch);
* ``launch``: the rest of ``ModelRunner.execute_model`` (enqueueing device work);
* ``update``: ``Scheduler.update_from_output`` (commit tokens, stop checks, free requests);
* ``output``: the rest of ``EngineCore._update`` (request timeline, counters) plus the driver's
  ``collect`` (appending tokens to the results, detokenizing finished requests);
* ``read``: ``AsyncOutput._build``, the host work of reading a step's copied-out output into a
  ``ModelRunnerOutput`` once its event fired (inside ``wait_output`` before the trace's
  ``read_output`` span existed; the wait for the event itself is not host work and not counted).

Only steady decode steps count: every one of the ``--batch`` requests decodes (no prefill);
without speculation that is one token each, with ``--spec METHOD:K`` one token plus up to ``K``
drafts each. Per run, the median over those steps; the table shows the median over runs, and
``tok/step`` (output tokens a steady step returns, median) with ``host/tok`` (host µs per output
token: what decides whether speculation pays on a launch-bound device).

``--spec METHOD:K`` runs speculative decoding with the sample proposers (bench/_spec_engines.py;
``--spec-model`` another one). ``--force-graphs`` resolves ``cuda_graphs`` and
``spec_cuda_graphs`` on as a CUDA device would: on the CPU the padded decode and speculative
graph bodies then run eagerly (``replay_eagerly``), the host path a CUDA run replays. Two clocks: ``cpu`` is the
engine thread's CPU time (``time.thread_time_ns``: other processes on a shared machine and waits
for the GIL do not count), ``wall`` is ``perf_counter`` time.

``--baseline-tree DIR`` runs this script on another source tree too (a checkout of an older
commit) in subprocesses, alternating baseline and this tree ``--rounds`` times, and prints both
tables side by side (before / after).

CPU:  python bench/host_phases.py --model samples/models/pycoder-draft-2m --batch 256
      python bench/host_phases.py --model samples/models/pycoder-14m --batch 64 \\
          --force-graphs --spec eagle:3
CUDA: python bench/host_phases.py --device cuda --dtype bfloat16 --model-config qwen3-0.6b \\
          --random-weights --tokenizer samples/models/pycoder-14m --batch 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

PHASES = ("schedule", "prepare", "launch", "read", "update", "output")
CLOCKS = ("cpu", "wall")


class PhaseTimer:
    """Per engine step, the host time of each phase (both clocks); installed on an LLM."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.steps: dict[int, dict[str, list[int]]] = {}  # step -> phase -> [cpu_ns, wall_ns]
        self.steady: set[int] = set()
        self.tokens: dict[int, int] = {}  # step -> output tokens it returned
        self._last_update_step: int | None = None

    def _add(self, step: int, phase: str, cpu_ns: int, wall_ns: int) -> None:
        books = self.steps.setdefault(step, {})
        cpu, wall = books.get(phase, [0, 0])
        books[phase] = [cpu + cpu_ns, wall + wall_ns]

    def _timed(self, fn: Callable[..., Any], phase: str, step_of: Callable[..., int | None]):
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            result = fn(*args, **kwargs)
            c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
            step = step_of(*args, result=result)
            if step is not None:
                self._add(step, phase, c1 - c0, w1 - w0)
            return result

        return wrapped

    def install(self, llm: Any) -> None:
        engine = llm.engine
        sched, runner = engine.scheduler, engine.runner

        def on_schedule(*args: Any, result: Any) -> int:
            so = result
            if so.num_decode_reqs == self.batch and so.num_prefill_reqs == 0:
                self.steady.add(so.step)
            return so.step

        def step_of_so(so: Any, *rest: Any, result: Any) -> int:
            return so.step

        def on_update(so: Any, *rest: Any, result: Any) -> int:
            self._last_update_step = so.step
            self.tokens[so.step] = sum(len(o.new_token_ids) for o in result)
            return so.step

        def after_update(*args: Any, result: Any) -> int | None:
            return self._last_update_step

        sched.schedule = self._timed(sched.schedule, "schedule", on_schedule)
        runner._prepare_step = self._timed(runner._prepare_step, "prepare", step_of_so)
        # launch = execute_model minus prepare (subtracted in per_step)
        runner.execute_model = self._timed(runner.execute_model, "execute", step_of_so)
        sched.update_from_output = self._timed(sched.update_from_output, "update", on_update)
        engine._update = self._timed(engine._update, "engine_update", step_of_so)
        self._after_update = after_update

    def install_collect(self) -> Callable[[], None]:
        """Time the driver's ``collect`` (class-level: the driver is made per run) and
        ``AsyncOutput._build`` (class-level: one handle per step)."""
        from engine import llm as llm_module
        from engine.runner.async_output import AsyncOutput

        original = llm_module._Run.collect
        llm_module._Run.collect = self._timed(original, "collect", self._after_update)  # type: ignore[method-assign]
        build = AsyncOutput._build

        def step_of_handle(handle: Any, *rest: Any, result: Any) -> int:
            return int(handle.step)

        AsyncOutput._build = self._timed(build, "read", step_of_handle)  # type: ignore[method-assign]

        def restore() -> None:
            llm_module._Run.collect = original  # type: ignore[method-assign]
            AsyncOutput._build = build  # type: ignore[method-assign]

        return restore

    def per_step(self) -> dict[str, dict[str, list[float]]]:
        """clock -> phase -> µs per steady step."""
        out: dict[str, dict[str, list[float]]] = {c: {p: [] for p in PHASES} for c in CLOCKS}
        for step in sorted(self.steady):
            books = self.steps.get(step, {})
            if not all(k in books for k in ("schedule", "prepare", "execute", "update")):
                continue
            for i, clock in enumerate(CLOCKS):
                value = {k: v[i] / 1e3 for k, v in books.items()}
                row = {
                    "schedule": value["schedule"],
                    "prepare": value["prepare"],
                    "launch": value["execute"] - value["prepare"],
                    "read": value.get("read", 0.0),
                    "update": value["update"],
                    "output": value.get("engine_update", value["update"])
                    - value["update"]
                    + value.get("collect", 0.0),
                }
                for phase in PHASES:
                    out[clock][phase].append(row[phase])
        return out

    def tokens_per_step(self) -> list[int]:
        """Output tokens each steady step returned (the steps ``per_step`` counts)."""
        return [self.tokens[s] for s in sorted(self.steady) if s in self.tokens]


def force_graphs() -> None:
    """Resolve ``cuda_graphs`` and ``spec_cuda_graphs`` on as a CUDA device would: on the CPU the
    padded decode and speculative graph bodies then run eagerly, the host path of a CUDA run."""
    import engine.core
    from engine.config import FeatureDecision

    resolve = engine.core.resolve_features

    def forced(config: Any, cuda_available: bool | None = None) -> Any:
        features = resolve(config, cuda_available)
        spec = config.spec.spec_method is not None
        features.decisions = tuple(
            FeatureDecision(d.feature, None, True, "forced on (--force-graphs)")
            if d.feature == "cuda_graphs" or (d.feature == "spec_cuda_graphs" and spec)
            else d
            for d in features.decisions
        )
        return features

    engine.core.resolve_features = forced


def _spec_argv(args: argparse.Namespace) -> list[str]:
    """``--spec METHOD:K`` as ``stepscope run`` flags (the sample proposer unless
    ``--spec-model``)."""
    if args.spec is None:
        return []
    from _spec_engines import SPEC_MODELS

    method, k = args.spec
    model = args.spec_model or SPEC_MODELS[method]
    argv = ["--spec-method", method, "--num-spec-tokens", str(k)]
    return argv + (["--spec-model", model] if model else [])


def _engine_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--workload", "synthetic:n=1", "--device", args.device, "--dtype", args.dtype]
    argv += ["--model", args.model] if args.model else ["--model-config", args.model_config]
    if args.random_weights:
        argv.append("--random-weights")
    if args.tokenizer:
        argv += ["--tokenizer", args.tokenizer]
    k = args.spec[1] if args.spec else 0
    num_blocks = args.batch * (args.max_prompt_len + args.out_len + k + 16) // 16 + 64
    argv += ["--max-num-seqs", str(args.batch), "--num-kv-blocks", str(num_blocks)]
    argv += ["--async", args.async_scheduling]
    return argv + _spec_argv(args) + args.engine_args


def _workload(args: argparse.Namespace, seed: int, out_len: int) -> list[Any]:
    from engine.sampling_params import SamplingParams
    from engine.workload import WorkloadRequest

    if args.workload is not None:
        # Its prompts (cycled to --batch), all at once, greedy as bench/bench_spec.py runs them
        # (the requests' logprobs kept).
        import dataclasses

        from engine.workload import load_workload

        base = load_workload(args.workload)
        return [
            dataclasses.replace(
                w,
                id=f"s{seed}-{i}",
                arrival_time_s=0.0,
                params=dataclasses.replace(
                    w.params, temperature=0.0, max_tokens=out_len, seed=None, ignore_eos=True
                ),
            )
            for i, w in enumerate(base[i % len(base)] for i in range(args.batch))
        ]
    vocab = args.vocab
    return [
        WorkloadRequest(
            f"s{seed}-{i}",
            None,
            tuple((7 * i + 13 * j + 31 * seed) % (vocab - 2) + 2 for j in range(args.in_len)),
            SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True),
        )
        for i in range(args.batch)
    ]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """This tree's runs: per run, per clock and phase, the median µs over steady steps."""
    from engine.cli import build_parser, config_from_args
    from engine.llm import LLM

    if args.force_graphs:
        force_graphs()
    config = config_from_args(build_parser().parse_args(_engine_argv(args)))
    llm = LLM(config)
    llm.run_workload(_workload(args, 0, 8))  # warm-up
    runs = []
    for r in range(args.runs):
        timer = PhaseTimer(args.batch)
        timer.install(llm)
        restore = timer.install_collect()
        try:
            llm.run_workload(_workload(args, r + 1, args.out_len))
        finally:
            restore()
            for name in ("schedule", "update_from_output"):
                vars(llm.engine.scheduler).pop(name, None)
            for name in ("_prepare_step", "execute_model"):
                vars(llm.engine.runner).pop(name, None)
            vars(llm.engine).pop("_update", None)
        per_step = timer.per_step()
        tokens = timer.tokens_per_step()
        runs.append(
            {
                "steady_steps": len(per_step["cpu"]["schedule"]),
                "tok_per_step": statistics.median(tokens) if tokens else 0.0,
                **{
                    clock: {p: statistics.median(v) if v else 0.0 for p, v in phases.items()}
                    for clock, phases in per_step.items()
                },
            }
        )
    llm.close()
    return {"runs": runs}


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """clock -> phase (and ``host``: their sum; ``tok/step``: output tokens per steady step;
    ``host/tok``: host µs per output token) -> median over runs."""
    out: dict[str, dict[str, float]] = {}
    for clock in CLOCKS:
        med = {p: statistics.median(r[clock][p] for r in runs) for p in PHASES}
        med["host"] = statistics.median(sum(r[clock][p] for p in PHASES) for r in runs)
        tok = [r.get("tok_per_step", 0.0) for r in runs]
        med["tok/step"] = statistics.median(tok)
        med["host/tok"] = (
            statistics.median(
                sum(r[clock][p] for p in PHASES) / t for r, t in zip(runs, tok, strict=True) if t
            )
            if any(tok)
            else 0.0
        )
        out[clock] = med
    return out


def print_table(columns: dict[str, dict[str, dict[str, float]]], num_runs: dict[str, int]) -> None:
    names = list(columns)
    for clock in CLOCKS:
        print(f"\nµs per steady decode step ({clock} clock; median over steps, then over runs)")
        print(f"{'phase':<10}" + "".join(f"{n + f' ({num_runs[n]} runs)':>22}" for n in names))
        for phase in (*PHASES, "host", "tok/step", "host/tok"):
            cells = "".join(f"{columns[n][clock][phase]:>22.1f}" for n in names)
            if len(names) == 2:
                a, b = columns[names[0]][clock][phase], columns[names[1]][clock][phase]
                cells += f"{(b - a) / a * 100 if a else 0.0:>+9.1f}%"
            print(f"{phase:<10}{cells}")


def run_alternating(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Baseline tree and this tree in subprocesses, alternated ``--rounds`` times."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"before": os.path.abspath(args.baseline_tree), "after": here}
    child_argv = [a for a in argv if a not in ("--baseline-tree", args.baseline_tree)]
    child_argv = [a for a in child_argv if a != f"--baseline-tree={args.baseline_tree}"]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for round_ in range(args.rounds):
        for name, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=tree)
            cmd = [sys.executable, os.path.abspath(__file__), "--child-json", *child_argv]
            proc = subprocess.run(cmd, env=env, cwd=here, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{name} run failed:\n{proc.stderr[-4000:]}")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            runs[name].extend(result["runs"])
            print(f"round {round_ + 1}: {name} done ({len(result['runs'])} runs)", flush=True)
    columns = {name: summarise(r) for name, r in runs.items()}
    print_table(columns, {n: len(r) for n, r in runs.items()})
    return {"trees": trees, "runs": runs, "summary": columns}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _args import add_model_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--in-len", type=int, default=32)
    p.add_argument("--out-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=4000, help="prompt token ids below this")
    p.add_argument(
        "--workload",
        default=None,
        help="prompts from this workload file (cycled to --batch; greedy, --out-len each, "
        "logprobs as asked) instead of synthetic ids (--in-len, --vocab)",
    )
    p.add_argument(
        "--max-prompt-len",
        type=int,
        default=None,
        help="KV pool sizing: the longest prompt (default --in-len; 256 with --workload)",
    )
    p.add_argument(
        "--spec",
        type=_parse_spec,
        default=None,
        metavar="METHOD:K",
        help="speculative decoding: eagle|mtp|draft|ngram with K draft tokens "
        "(the sample proposers of bench/_spec_engines.py)",
    )
    p.add_argument("--spec-model", default=None, help="with --spec: another proposer folder")
    p.add_argument(
        "--force-graphs",
        action="store_true",
        help="resolve cuda_graphs (and spec_cuda_graphs with --spec) on as CUDA would: the CPU "
        "runs the padded graph bodies eagerly",
    )
    p.add_argument("--async-scheduling", default="on", choices=("auto", "on", "off"))
    p.add_argument("--runs", type=int, default=3, help="timed runs (per round)")
    p.add_argument("--baseline-tree", default=None, help="also run another source tree")
    p.add_argument("--rounds", type=int, default=3, help="with --baseline-tree: alternations")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--child-json", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("engine_args", nargs="*", help="more `stepscope run` flags, after --")
    args = p.parse_args(argv)
    if args.model is None and args.model_config is None:
        args.model = "samples/models/pycoder-draft-2m"
    if args.max_prompt_len is None:
        args.max_prompt_len = 256 if args.workload else args.in_len
    return args


def _parse_spec(text: str) -> tuple[str, int]:
    """``METHOD:K`` -> (method, k)."""
    from _spec_engines import SPEC_MODELS

    method, _, k = text.partition(":")
    if method not in SPEC_MODELS or not k.isdigit() or int(k) < 1:
        raise argparse.ArgumentTypeError(
            f"--spec {text!r}: write METHOD:K, METHOD one of {sorted(SPEC_MODELS)}, K >= 1"
        )
    return method, int(k)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    if args.child_json:
        result = measure(args)
        print(json.dumps(result))
        return result
    if args.baseline_tree:
        result = run_alternating(args, raw)
    else:
        result = measure(args)
        result["summary"] = {"this tree": summarise(result["runs"])}
        print_table(result["summary"], {"this tree": len(result["runs"])})
    result["config"] = vars(args)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
