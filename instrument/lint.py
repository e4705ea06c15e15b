"""``stepscope lint``: a static check for host<-device syncs inside hot-path functions.

A function is hot when it is decorated with ``@hot`` (from this module, or any decorator named
``hot``/``hot_path``) or when the line above its ``def`` (or above its first decorator) is the
comment ``# stepscope: hot``. Inside hot functions (nested functions included) the lint reports
``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``.to("cpu")``/``.to(device="cpu")``,
``.synchronize()``, ``torch.cuda.synchronize()``, ``bool(...)``, ``.nonzero()``/``torch.nonzero``,
and ``.any()``/``.all()`` used as a condition (``if``/``while``/``assert``/``and``/``or``/``not``).
A line that ends with ``# stepscope: allow-sync`` is the one intended wait, and is not reported.

Host objects are not device tensors, so calls on them are not syncs. The lint knows a host object
by its name (STYLE.md's placement suffixes: ``*_cpu``, ``*_np``, ``*_host``; e.g.
``states.num_computed_cpu.tolist()``) or by an annotation in the function (a parameter or a local
annotated ``np.ndarray`` / ``NDArray`` / ``list`` / ``tuple`` / ``int`` / ``float`` / ``bool``).
Anything else is treated as possibly on the device.

Output: one line per finding, ``file:line: op``; exit status 1 when anything is found, else 0.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Finding", "hot", "lint_source", "lint_paths", "main"]

HOT_COMMENT = "# stepscope: hot"
ALLOW_COMMENT = "# stepscope: allow-sync"
_SYNC_METHODS = {"item", "tolist", "cpu", "numpy", "synchronize", "nonzero"}
_COND_METHODS = {"any", "all"}
F = TypeVar("F", bound=Callable[..., object])


def hot(fn: F) -> F:
    """Mark a function as hot-path for ``stepscope lint`` (no runtime effect)."""
    return fn


@dataclass(frozen=True, order=True)
class Finding:
    path: str
    line: int
    op: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.op}"


def _decorator_name(node: ast.expr) -> str:
    target = node.func if isinstance(node, ast.Call) else node
    if isinstance(target, ast.Attribute):
        return target.attr
    if isinstance(target, ast.Name):
        return target.id
    return ""


def _is_hot(fn: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> bool:
    if any(_decorator_name(d) in ("hot", "hot_path") for d in fn.decorator_list):
        return True
    first = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
    above = first - 2  # 0-based index of the line above
    while above >= 0 and lines[above].strip().startswith("#"):
        if lines[above].strip() == HOT_COMMENT:
            return True
        above -= 1
    return False


def _is_cpu_literal(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.startswith("cpu")
    if isinstance(node, ast.Call) and _decorator_name(node) == "device" and node.args:
        return _is_cpu_literal(node.args[0])
    return False


_HOST_SUFFIXES = ("_cpu", "_np", "_host")
_HOST_ANNOTATIONS = ("ndarray", "NDArray", "list", "tuple", "int", "float", "bool", "str")


def _base_name(node: ast.expr) -> str:
    """The name a receiver is known by: ``a.b_cpu[:n]`` -> ``b_cpu``."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def _is_host(node: ast.expr, host_names: frozenset[str]) -> bool:
    name = _base_name(node)
    return bool(name) and (name.endswith(_HOST_SUFFIXES) or name in host_names)


def _host_annotated(fn: ast.AST) -> frozenset[str]:
    """Names annotated as host types inside ``fn`` (its parameters and annotated locals)."""

    def is_host_type(annotation: ast.expr | None) -> bool:
        if annotation is None:
            return False
        text = ast.unparse(annotation)
        head = text.split("[", 1)[0].rsplit(".", 1)[-1]
        return head in _HOST_ANNOTATIONS

    names: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.arg) and is_host_type(node.annotation):
            names.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and is_host_type(node.annotation):
            names.add(_base_name(node.target))
    return frozenset(names)


def _call_op(call: ast.Call, host_names: frozenset[str] = frozenset()) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        if func.id == "bool" and not (call.args and _is_host(call.args[0], host_names)):
            return "bool()"
        return None
    if not isinstance(func, ast.Attribute):
        return None
    if func.attr == "synchronize":
        owner = ast.unparse(func.value)
        return f"{owner}.synchronize()" if owner.endswith("cuda") else ".synchronize()"
    if func.attr == "nonzero" and ast.unparse(func.value) == "torch":
        return "torch.nonzero()"
    if _is_host(func.value, host_names):
        return None  # a host mirror / numpy array: no device involved
    if func.attr in _SYNC_METHODS:
        return f".{func.attr}()"
    if func.attr == "to":
        dest = [a for a in call.args[:1]] + [k.value for k in call.keywords if k.arg == "device"]
        if any(_is_cpu_literal(d) for d in dest):
            return '.to("cpu")'
    return None


def _condition_exprs(node: ast.AST) -> Iterator[ast.expr]:
    if isinstance(node, (ast.If, ast.While, ast.IfExp)):
        yield node.test
    elif isinstance(node, ast.Assert):
        yield node.test
    elif isinstance(node, ast.BoolOp):
        yield from node.values
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield node.operand


def _scan_function(fn: ast.AST, path: str, lines: list[str]) -> Iterator[Finding]:
    host_names = _host_annotated(fn)
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            op = _call_op(node, host_names)
            if op is not None:
                yield Finding(path, node.lineno, op)
        for cond in _condition_exprs(node):
            if (
                isinstance(cond, ast.Call)
                and isinstance(cond.func, ast.Attribute)
                and cond.func.attr in _COND_METHODS
                and not _is_host(cond.func.value, host_names)
            ):
                yield Finding(path, cond.lineno, f".{cond.func.attr}() as a condition")


def lint_source(source: str, path: str = "<string>") -> list[Finding]:
    """Findings for one module's source text, sorted by line."""
    tree = ast.parse(source, filename=path)
    lines = source.splitlines()
    found: set[Finding] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_hot(node, lines):
            found.update(_scan_function(node, path, lines))
    return sorted(
        f
        for f in found
        if not (0 < f.line <= len(lines) and lines[f.line - 1].rstrip().endswith(ALLOW_COMMENT))
    )


def _python_files(paths: Iterable[str]) -> Iterator[str]:
    for path in paths:
        if os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
                yield from (os.path.join(root, f) for f in sorted(files) if f.endswith(".py"))
        elif os.path.exists(path):
            yield path
        else:
            raise FileNotFoundError(f"no such file or directory: {path}")


def lint_paths(paths: Iterable[str]) -> list[Finding]:
    """Lint every ``.py`` file under ``paths``."""
    findings: list[Finding] = []
    for path in _python_files(paths):
        with open(path, encoding="utf-8") as f:
            source = f.read()
        try:
            findings.extend(lint_source(source, path))
        except SyntaxError as err:
            raise SyntaxError(f"{path}:{err.lineno}: cannot parse: {err.msg}") from None
    return findings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="stepscope lint",
        description="Report host<-device syncs inside functions marked hot "
        f"(@hot, or '{HOT_COMMENT}' above the def). Exit 1 when anything is found.",
    )
    parser.add_argument("paths", nargs="+", help="files or directories to check")
    args = parser.parse_args(argv)
    try:
        findings = lint_paths(args.paths)
    except (FileNotFoundError, SyntaxError, UnicodeDecodeError) as err:
        print(f"stepscope lint: error: {err}", file=sys.stderr)
        return 2
    for finding in findings:
        print(finding)
    return 1 if findings else 0
