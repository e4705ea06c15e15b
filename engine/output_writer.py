"""``--output``: one JSON line per request, written as each request finishes, so none is lost.

The path is checked (folder exists, file writable) before the first step. While the run goes on
lines are appended in *finish* order and flushed, rejected (``"error"``) and aborted requests
included, so an interrupted or killed run keeps every request that finished. At a clean end the
file is rewritten in the workload's order (a temporary file beside it, then an atomic rename),
so a complete file lists requests as the workload does. An interrupted run's file stays in finish
order (each line carries its ``id``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import IO, Any, Protocol

__all__ = ["OutputWriter", "OutputPathError", "check_output_path"]


class OutputPathError(ValueError):
    """``--output`` names a file that cannot be written."""


class _Output(Protocol):
    id: str

    def to_json(self) -> dict[str, Any]: ...


def check_output_path(path: str) -> None:
    """Raise :class:`OutputPathError` unless ``path`` can be created or overwritten."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise OutputPathError(f"--output {path}: folder {folder} does not exist")
    if os.path.isdir(path):
        raise OutputPathError(f"--output {path}: is a folder, expected a file")
    target = path if os.path.exists(path) else folder
    if not os.access(target, os.W_OK):
        raise OutputPathError(f"--output {path}: not writable")


class OutputWriter:
    """Streams finished requests to ``path`` (see the module docstring for the order)."""

    def __init__(self, path: str) -> None:
        check_output_path(path)
        try:
            self._file: IO[str] | None = open(path, "w", encoding="utf-8")  # noqa: SIM115
        except OSError as err:
            raise OutputPathError(f"--output {path}: {err.strerror}") from None
        self.path = path
        self.num_written = 0

    def write(self, output: _Output) -> None:
        """Append one finished request and flush it to the OS (it survives our death)."""
        if self._file is None:
            raise RuntimeError("OutputWriter is closed")
        self._file.write(json.dumps(output.to_json()) + "\n")
        self._file.flush()
        self.num_written += 1

    def finish_in_order(self, outputs: Sequence[_Output]) -> None:
        """Clean end: rewrite the file with ``outputs`` in the given (workload) order."""
        self.close()
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for out in outputs:
                f.write(json.dumps(out.to_json()) + "\n")
        os.replace(tmp, self.path)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
