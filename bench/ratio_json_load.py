"""Wall-time ratio of `stepscope analyze FILE --json` to stdlib `json.load` of FILE (issue 14).

Whole processes, alternated round by round on the same machine, so that both see the same load:
`python -c "import json,gzip; json.load(gzip.open(FILE))"` (plain `open` for a .json file) and
`stepscope analyze FILE --json` run as the console script does (`from stepscope.cli import main`,
stdout to a file). Prints each round's times, its ratio and the 1-minute load average at its
start, then the median ratio and its range (and the ratio of CPU times: user + sys of the
whole process tree, which says what the CLI costs when other jobs hold the cores). Each `--root` is a checkout whose code the CLI runs
(PYTHONPATH=root; byte-compiled first, as `pip install` does, since this machine sets
PYTHONDONTWRITEBYTECODE); two roots give an A/B of the same trace in the same rounds.

    python bench/ratio_json_load.py /tmp/vllm_x10.json.gz --rounds 7
    python bench/ratio_json_load.py FILE --root /tmp/before --root . --rounds 9

The 193k-event vLLM trace is built by `bench/bench_analysis.py` (bench/README.md, issue 14);
`--build PATH` writes it to PATH first.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_JSON_LOAD = "import json,gzip,sys; p=sys.argv[1]; json.load(gzip.open(p) if p.endswith('.gz') else open(p, 'rb'))"
_CLI = "import sys; from stepscope.cli import main; sys.exit(main())"


def _env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root)
    return env


def _timed(cmd: list[str], root: Path, stdout) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + sys of the process and the children it waited for)
    of ``cmd`` run in ``root`` (``python -c`` puts the working directory first on sys.path)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(
        cmd, env=_env(root), cwd=root, stdout=stdout, stderr=subprocess.DEVNULL, check=True
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def peak_mb(root: Path, trace: Path) -> float:
    """Peak memory of ``stepscope analyze --json TRACE`` run from ``root`` (see --memory)."""
    sys.path.insert(0, str(ROOT))
    from bench._kineto_vs_hta import _tree_mb

    cmd = [sys.executable, "-c", _CLI, "analyze", str(trace), "--json"]
    proc = subprocess.Popen(cmd, env=_env(root), cwd=root, stdout=subprocess.DEVNULL)
    peak = 0.0
    while proc.poll() is None:
        peak = max(peak, _tree_mb(proc.pid))
        time.sleep(0.005)
    return peak


def build(path: Path) -> None:
    """The ~193k-event vLLM serving trace of bench/README.md (issue 14), written to ``path``."""
    sys.path.insert(0, str(ROOT))
    from bench._kineto_vs_hta import SOURCE, build_large

    print(f"{build_large(ROOT / 'tests' / 'data' / 'real' / SOURCE, path)} events in {path}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--root", type=Path, action="append", help="checkout the CLI runs from (repeatable)"
    )
    parser.add_argument("--build", action="store_true", help="build the large trace at TRACE first")
    parser.add_argument(
        "--memory",
        action="store_true",
        help="then one untimed run per root: peak MB of the CLI's process tree (its RSS plus "
        "its forked children's private pages, sampled every 5 ms, as bench_analysis.py --real)",
    )
    args = parser.parse_args()
    roots = [r.resolve() for r in (args.root or [ROOT])]
    args.trace = args.trace.resolve()
    if args.build:
        build(args.trace)
    for root in roots:
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", "analysis", "instrument", "stepscope"],
            cwd=root,
            check=True,
            env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
        )
    ratios: dict[Path, list[float]] = {r: [] for r in roots}
    cpu_ratios: dict[Path, list[float]] = {r: [] for r in roots}
    loads: list[float] = []
    with tempfile.TemporaryFile() as out:
        for i in range(args.rounds):
            load = os.getloadavg()[0]
            loads.append(load)
            t_json, c_json = _timed([sys.executable, "-c", _JSON_LOAD, str(args.trace)], ROOT, None)
            cells = []
            for root in roots:
                out.seek(0)
                out.truncate()
                cmd = [sys.executable, "-c", _CLI, "analyze", str(args.trace), "--json"]
                t_cli, c_cli = _timed(cmd, root, out)
                ratios[root].append(t_cli / t_json)
                cpu_ratios[root].append(c_cli / c_json)
                cells.append(
                    f"cli {t_cli:.2f} s ratio {t_cli / t_json:.2f} (cpu {c_cli:.2f} s, {c_cli / c_json:.2f})"
                )
            print(
                f"round {i + 1}: load {load:.2f}  json.load {t_json:.2f} s (cpu {c_json:.2f} s)  "
                + "  ".join(cells)
            )
    for root in roots:
        rs = ratios[root]
        if args.memory:
            print(f"{root}: peak {peak_mb(root, args.trace):.0f} MB")
        print(
            f"{root}: median wall ratio {statistics.median(rs):.2f} ({min(rs):.2f}..{max(rs):.2f}), "
            f"CPU ratio {statistics.median(cpu_ratios[root]):.2f}, "
            f"{len(rs)} rounds, load {min(loads):.2f}..{max(loads):.2f}"
        )


if __name__ == "__main__":
    main()
