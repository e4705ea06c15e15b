"""The training corpus: the ``.py`` sources of the running interpreter's standard library.

Every machine with Python has this corpus, so the sample models can be retrained anywhere. Files
are listed in a deterministic order (sorted relative paths) and split into train/val by a hash of
the relative path, so the split does not depend on the file system or on which files exist.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CorpusFile", "stdlib_root", "list_stdlib_files", "read_texts", "is_val_file"]

# Folders that are not the standard library proper (installed packages) or not Python source.
_ALWAYS_SKIPPED = frozenset({"site-packages", "dist-packages", "__pycache__"})
# Test folders: huge, full of deliberately odd code; the tokenizer skips them to stay code-like.
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


@dataclass(frozen=True)
class CorpusFile:
    """One source file: its path relative to the stdlib root, and its text."""

    rel_path: str
    text: str


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder (``sysconfig.get_paths()["stdlib"]``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_stdlib_files(root: Path | None = None, include_tests: bool = False) -> list[Path]:
    """All ``*.py`` files under ``root`` (default: the stdlib), sorted by relative path."""
    base = root if root is not None else stdlib_root()
    skipped = _ALWAYS_SKIPPED if include_tests else _ALWAYS_SKIPPED | _TEST_DIRS
    files = [
        path
        for path in base.rglob("*.py")
        if path.is_file() and not skipped.intersection(path.relative_to(base).parts[:-1])
    ]
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def read_texts(files: list[Path], root: Path | None = None) -> Iterator[CorpusFile]:
    """The UTF-8 text of each file, in order; files that are not valid UTF-8 are skipped
    (the test suite holds some on purpose)."""
    base = root if root is not None else stdlib_root()
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            yield CorpusFile(rel_path=path.relative_to(base).as_posix(), text=text)


def is_val_file(rel_path: str, val_percent: int) -> bool:
    """Whether ``rel_path`` belongs to the held-out split (stable across machines)."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "little") % 100 < val_percent
