"""The engine's import graph keeps its layers (docs/design.md §1.2).

Every module under ``engine/`` is parsed with ``ast``; every ``import`` counts, lazy ones inside
functions and ``TYPE_CHECKING`` blocks included. A node is a sub-package (``engine/runner/``) or a
top-level module (``engine/core.py``). The test fails on an import cycle between nodes, on a mutual
pair, and on any import that does not go strictly down the layer table below.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "engine"

# Ground floor first. A node may import only nodes of a strictly lower layer. The runner sits
# above the scheduler because it consumes the scheduler's typed records (``SchedulerOutput``);
# ``core`` is the first node that owns both.
LAYERS: list[set[str]] = [
    {"kernels", "config", "device", "fields"},  # import nothing of the engine
    {"distributed", "sampling_params", "kv_sizing"},  # + the KV pool arithmetic
    {"request", "workload"},
    {"model", "scheduler"},
    {"sample", "structured", "request_timeline", "warmup"},  # warmup: dummy scheduler outputs
    {"spec"},
    {"runner"},
    {"engine_parts"},  # the factories EngineCore and every TP worker build through
    {"memory_profile"},  # a probe runner built through engine_parts, measured
    {"executor"},  # the tensor-parallel ranks
    {"core"},
    {"llm", "interrupt", "output_writer"},  # the run driver and the CLI's helpers
    {"cli"},
]

Edge = tuple[str, str, str, int]  # (from node, to node, file, line)


def _node_of(module: str) -> str | None:
    """``engine.runner.states`` -> ``runner``; ``engine.core`` -> ``core``; else None."""
    parts = module.split(".")
    if parts[0] != "engine" or len(parts) < 2:
        return None
    return parts[1]


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported_modules(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The absolute module names one import statement names."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:  # relative: resolve against this module's package
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = package[: len(package) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    # ``from engine import kernels`` names the sub-package itself.
    if target == "engine":
        return [f"engine.{alias.name}" for alias in node.names]
    return [target]


def import_edges(root: Path) -> list[Edge]:
    """Every cross-node import under ``root`` (an ``engine``-shaped package folder)."""
    edges: list[Edge] = []
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        source = _node_of(module) if "." in module else None
        if source is None:  # engine/__init__.py
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for stmt in ast.walk(tree):  # walks into functions: lazy imports count
            for target in _imported_modules(stmt, module, path.name == "__init__.py"):
                dest = _node_of(target)
                if dest is not None and dest != source:
                    edges.append((source, dest, str(path.relative_to(root.parent)), stmt.lineno))
    return edges


def cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    graph: dict[str, set[str]] = defaultdict(set)
    for src, dst, _, _ in edges:
        graph[src].add(dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_violations(edges: list[Edge], layers: list[set[str]]) -> list[str]:
    """Imports that do not go strictly down ``layers``, and nodes the table does not place."""
    rank = {node: i for i, layer in enumerate(layers) for node in layer}
    problems = []
    for src, dst, file, line in edges:
        if src not in rank or dst not in rank:
            missing = src if src not in rank else dst
            problems.append(f"{file}:{line}: node {missing!r} is in no layer of the table")
        elif rank[dst] >= rank[src]:
            problems.append(
                f"{file}:{line}: {src} (layer {rank[src]}) imports {dst} (layer {rank[dst]})"
            )
    return problems


def _describe(edges: list[Edge], nodes: set[str]) -> str:
    return "\n".join(f"  {f}:{n}: {s} -> {d}" for s, d, f, n in edges if s in nodes and d in nodes)


# ---- the engine ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_edges() -> list[Edge]:
    return import_edges(ENGINE)


def test_engine_has_no_import_cycle(engine_edges: list[Edge]) -> None:
    found = cycles(engine_edges)
    details = "\n".join(f"{c}:\n{_describe(engine_edges, set(c))}" for c in found)
    assert not found, f"import cycles between engine sub-packages:\n{details}"


def test_engine_has_no_mutual_imports(engine_edges: list[Edge]) -> None:
    pairs = {(s, d) for s, d, _, _ in engine_edges}
    mutual = sorted({tuple(sorted(p)) for p in pairs if (p[1], p[0]) in pairs})
    assert not mutual, f"sub-packages importing each other: {mutual}"


def test_engine_imports_go_down_the_layers(engine_edges: list[Edge]) -> None:
    problems = layer_violations(engine_edges, LAYERS)
    assert not problems, "imports against the layer order:\n" + "\n".join(problems)


def test_every_engine_node_is_placed(engine_edges: list[Edge]) -> None:
    placed = set().union(*LAYERS)
    nodes = {p.name for p in ENGINE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    nodes |= {p.stem for p in ENGINE.glob("*.py") if p.stem != "__init__"}
    assert nodes <= placed, f"add these to LAYERS: {sorted(nodes - placed)}"
    assert {s for s, _, _, _ in engine_edges} <= nodes


def test_kernels_is_the_ground_floor(engine_edges: list[Edge]) -> None:
    assert [e for e in engine_edges if e[0] == "kernels"] == []


# ---- the checker itself, on a small tree with known faults --------------------------------
def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def test_checker_sees_lazy_relative_and_package_imports(tmp_path: Path) -> None:
    root = tmp_path / "engine"
    _write(root, "__init__.py", "")
    _write(root, "low/__init__.py", "")
    _write(root, "low/a.py", "def f():\n    from engine.high import b  # lazy, upward\n")
    _write(root, "high/__init__.py", "")
    _write(root, "high/b.py", "from ..low import a\nfrom engine import top\n")
    _write(root, "top.py", "import engine.low.a\n")
    edges = import_edges(root)
    assert sorted((s, d) for s, d, _, _ in edges) == [
        ("high", "low"),
        ("high", "top"),
        ("low", "high"),
        ("top", "low"),
    ]
    assert cycles(edges) == [["high", "low", "top"]]
    problems = layer_violations(edges, [{"low"}, {"high"}, {"top"}])
    assert len(problems) == 2  # low -> high and high -> top go up
    assert any("engine/low/a.py:2: low (layer 0) imports high (layer 1)" in p for p in problems)
    assert layer_violations(edges, [{"low"}, {"high"}]) == [
        "engine/high/b.py:2: node 'top' is in no layer of the table",
        "engine/low/a.py:2: low (layer 0) imports high (layer 1)",
        "engine/top.py:1: node 'top' is in no layer of the table",
    ]
