"""Every bench script that imports from ``bench.`` puts the repository root on ``sys.path``
first, so ``python bench/X.py`` works from a clone without PYTHONPATH (as bench/README.md says).
``bench_spec.py`` once failed its own ``--help`` that way."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _scripts_importing_bench() -> list[Path]:
    out = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        if path.name.startswith("_"):
            continue
        tree = ast.parse(path.read_text())
        if any(
            isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench")
            for node in ast.walk(tree)
        ):
            out.append(path)
    return out


def test_scripts_that_import_bench_put_the_root_on_sys_path_first() -> None:
    scripts = _scripts_importing_bench()
    assert len(scripts) >= 5
    for path in scripts:
        body = ast.parse(path.read_text()).body
        top = [
            i for i, node in enumerate(body)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench")
        ]  # fmt: skip
        # A bench import inside a function runs after the module body: any top-level insert.
        limit = top[0] if top else len(body)
        inserts = [
            i for i, node in enumerate(body[:limit]) if "sys.path.insert" in ast.unparse(node)
        ]
        assert inserts, f"{path.name}: imports bench.* without sys.path.insert before it"


def test_bench_spec_help_runs_from_the_root_without_pythonpath() -> None:
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "bench/bench_spec.py", "--help"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: bench_spec.py" in done.stdout
