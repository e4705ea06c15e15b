"""Path safety: every file the dashboard lists or serves is resolved inside one root directory.

Names come from the browser, so they are untrusted: absolute paths, ``..`` components and
symlinks that lead outside the root are refused after resolving real paths, not by string checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dashboard.config import TRACE_SUFFIXES

__all__ = ["UnsafePathError", "TraceDirectory", "resolve_inside"]


class UnsafePathError(ValueError):
    """A requested name that does not name a regular file inside the root."""


def resolve_inside(root: Path, name: str) -> Path:
    """The real path of ``root/name``, refusing anything that ends up outside ``root``.

    Raises :class:`UnsafePathError` for empty or absolute names, NUL bytes, names whose resolved
    real path (symlinks followed) is not under the resolved ``root``, and non-files.
    """
    if not name or "\x00" in name:
        raise UnsafePathError("empty or malformed trace name")
    if Path(name).is_absolute() or name.startswith(("/", "\\")):
        raise UnsafePathError(f"{name!r}: absolute paths are not served")
    real_root = root.resolve(strict=True)
    try:
        target = (real_root / name).resolve(strict=True)
    except (FileNotFoundError, RuntimeError, OSError):
        raise UnsafePathError(f"{name!r}: no such trace") from None
    if not target.is_relative_to(real_root):
        raise UnsafePathError(f"{name!r}: outside the trace directory")
    if not target.is_file():
        raise UnsafePathError(f"{name!r}: not a file")
    return target


@dataclass(frozen=True)
class TraceDirectory:
    """A directory of trace files, listed and opened only through :func:`resolve_inside`."""

    root: Path
    max_files: int = 1000
    suffixes: tuple[str, ...] = TRACE_SUFFIXES  # empty: list every file

    def list_names(self) -> list[str]:
        """Relative POSIX names of trace files under the root, newest first.

        Symlinked files are listed only when they resolve inside the root.
        """
        real_root = self.root.resolve(strict=True)
        found: list[tuple[float, str]] = []
        for path in real_root.rglob("*"):
            if len(found) >= self.max_files:
                break
            if self.suffixes and not path.name.endswith(self.suffixes):
                continue
            name = path.relative_to(real_root).as_posix()
            try:
                real = resolve_inside(real_root, name)
            except UnsafePathError:
                continue
            found.append((real.stat().st_mtime, name))
        found.sort(key=lambda item: (-item[0], item[1]))
        return [name for _, name in found]

    def resolve(self, name: str) -> Path:
        """The real path of ``name``; :class:`UnsafePathError` when it is not a trace in here."""
        return resolve_inside(self.root, name)
