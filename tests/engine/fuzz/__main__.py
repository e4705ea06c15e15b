"""``python -m tests.engine.fuzz``: run scenarios by seed; a failure prints its replay command."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from tests.engine.fuzz.check import Coverage, check_seed
from tests.engine.fuzz.runner import ScenarioFailure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.engine.fuzz", description=__doc__)
    parser.add_argument("--seed", type=int, help="replay this one seed")
    parser.add_argument("--count", type=int, default=100, help="seeds to run (default 100)")
    parser.add_argument("--start", type=int, default=0, help="first seed (default 0)")
    parser.add_argument(
        "--threaded", action="store_true", help="worker-thread CPU device (default: inline)"
    )
    parser.add_argument("--keep-going", action="store_true", help="run every seed, list failures")
    args = parser.parse_args(argv)
    logging.getLogger("stepscope").setLevel(logging.ERROR)  # refused grammars are expected
    seeds = [args.seed] if args.seed is not None else range(args.start, args.start + args.count)
    coverage = Coverage()
    failures: list[str] = []
    start = time.perf_counter()
    for done, seed in enumerate(seeds, 1):
        try:
            check_seed(seed, coverage, args.threaded)
        except ScenarioFailure as err:
            print(f"FAIL {err}", flush=True)
            failures.append(str(seed))
            if not args.keep_going:
                break
        if done % 100 == 0:
            elapsed = time.perf_counter() - start
            print(f"{done} seeds in {elapsed:.0f} s, {len(failures)} failed", flush=True)
    elapsed = time.perf_counter() - start
    print(coverage.summary())
    print(
        f"{coverage.scenarios} passed, {len(failures)} failed in {elapsed:.1f} s "
        f"({elapsed / max(1, coverage.scenarios + len(failures)) * 1000:.0f} ms/scenario)"
    )
    if failures:
        print("failed seeds: " + " ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
