"""Path safety: only regular files inside the trace root are resolved, listed or served."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dashboard.paths import TraceDirectory, UnsafePathError, resolve_inside


@pytest.fixture
def root(tmp_path: Path) -> Path:
    base = tmp_path / "root"
    (base / "sub").mkdir(parents=True)
    (base / "a.pftrace").write_bytes(b"\x0a\x00")
    (base / "sub" / "b.json.gz").write_bytes(b"x")
    (base / "notes.txt").write_text("not a trace")
    (tmp_path / "outside.pftrace").write_bytes(b"secret")
    os.symlink(tmp_path / "outside.pftrace", base / "escape.pftrace")
    os.symlink(base / "a.pftrace", base / "alias.pftrace")
    os.symlink(tmp_path, base / "up")
    return base


@pytest.mark.parametrize(
    "name",
    [
        "",
        "../outside.pftrace",
        "sub/../../outside.pftrace",
        "escape.pftrace",  # symlink leading outside
        "up/outside.pftrace",  # directory symlink leading outside
        "up/root/a.pftrace/..",
        "sub",  # a directory
        "missing.pftrace",
        "a.pftrace\x00.png",
        "/etc/passwd",
        "\\etc\\passwd",
    ],
)
def test_refused(root: Path, name: str) -> None:
    with pytest.raises(UnsafePathError):
        resolve_inside(root, name)


def test_absolute_path_to_a_file_inside_is_still_refused(root: Path) -> None:
    with pytest.raises(UnsafePathError):
        resolve_inside(root, str(root / "a.pftrace"))


@pytest.mark.parametrize(
    "name,expected",
    [
        ("a.pftrace", "a.pftrace"),
        ("sub/b.json.gz", "sub/b.json.gz"),
        ("sub/../a.pftrace", "a.pftrace"),  # resolves inside: fine
        ("alias.pftrace", "a.pftrace"),  # symlink staying inside
        ("up/root/a.pftrace", "a.pftrace"),  # goes out and comes back: the real path is inside
    ],
)
def test_allowed(root: Path, name: str, expected: str) -> None:
    assert resolve_inside(root, name) == (root / expected).resolve()


def test_listing_skips_escapes_and_non_traces(root: Path) -> None:
    names = TraceDirectory(root).list_names()
    assert "escape.pftrace" not in names
    assert "notes.txt" not in names
    assert {"a.pftrace", "alias.pftrace", "sub/b.json.gz"} <= set(names)
    assert all(
        not n.startswith("up/") or (root / n).resolve().is_relative_to(root.resolve())
        for n in names
    )
