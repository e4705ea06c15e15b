"""The ``stepscope`` command: one entry point dispatching to each package's own CLI.

Subcommands are imported lazily, so ``stepscope lint`` does not import torch and a subcommand
whose package has not landed says so plainly instead of failing with a traceback.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["main", "SUBCOMMANDS"]

# subcommand -> (module, function taking argv and returning an exit status, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "run": ("engine.cli", "run_main", "run a workload on the engine, optionally with --trace"),
    "analyze": ("analysis.cli", "analyze_main", "diagnose one trace: verdicts, then tables"),
    "compare": ("analysis.cli", "compare_main", "A/B two traces: contract check, then deltas"),
    "dashboard": ("dashboard.cli", "dashboard_main", "serve the web dashboard"),
    "lint": ("instrument.lint", "main", "static check for syncs in hot-path functions"),
}

# One-shot commands that run with the cyclic garbage collector paused (see _no_cycle_collection).
ONE_SHOT = frozenset({"analyze", "compare"})

_USAGE = (
    "usage: stepscope {"
    + ",".join(SUBCOMMANDS)
    + "} ...\n\n"
    + "\n".join(f"  {name:<10} {help_}" for name, (_, _, help_) in SUBCOMMANDS.items())
    + "\n\nRun 'stepscope <command> --help' for a command's options."
)


@contextmanager
def _no_cycle_collection(paused: bool, whole_process: bool) -> Iterator[None]:
    """The cyclic garbage collector paused while a one-shot command imports and runs.

    ``stepscope analyze`` allocates millions of objects while importing numpy and pandas and
    building frames; each allocation burst starts a collection that walks the tracked objects
    (the imported modules' included): about 160 collections and a full one at exit, 0.2-0.3 s of
    CPU on a 195k-event trace. Reference counting frees nearly everything meanwhile; a forked
    child (docs/design.md §6, two-core CLI) inherits the pause. Afterwards the survivors are
    frozen (``gc.freeze``), so that the collection at exit does not walk them again; when the
    command is not the whole process (``main(argv)`` called in-process), they are then unfrozen
    and the collector resumes as before.
    """
    was_enabled = gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused and was_enabled:
            gc.freeze()
            gc.enable()
            if not whole_process:
                gc.unfreeze()


def _resolve(name: str) -> Callable[[list[str]], int] | None:
    module_name, func_name, _ = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and module_name.startswith(err.name.split(".")[0]):
            return None
        raise
    return getattr(module, func_name, None)


def main(argv: list[str] | None = None) -> int:
    argv_given = argv
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"stepscope: unknown command {name!r}\n\n{_USAGE}", file=sys.stderr)
        return 2
    whole_process = argv_given is None
    with _no_cycle_collection(name in ONE_SHOT, whole_process):
        func = _resolve(name)
        if func is None:
            print(f"stepscope {name}: not available yet in this build", file=sys.stderr)
            return 2
        try:
            status = int(func(rest) or 0)
        except BrokenPipeError:  # output piped into `head` and closed: not an error
            sys.stderr.close()
            return 0
    if name in ONE_SHOT and whole_process:
        _exit_without_teardown(status)
    return status


def _exit_without_teardown(status: int) -> None:
    """End a one-shot command's process now: flush the output, run the ``atexit`` handlers,
    then ``os._exit``, skipping the interpreter's teardown (freeing pandas, numpy and the
    report object by object: ~80 ms after ``stepscope analyze`` of a 195k-event trace,
    docs/design.md §6). Returns, leaving the usual shutdown to report it, when the output
    cannot be flushed (a closed pipe)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return
    atexit._run_exitfuncs()  # what a normal exit runs first (coverage, logging, ...)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
