"""The ``stepscope`` command: one entry point dispatching to each package's own CLI.

Subcommands are imported lazily, so ``stepscope lint`` does not import torch and a subcommand
whose package has not landed says so plainly instead of failing with a traceback.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

__all__ = ["main", "SUBCOMMANDS"]

# subcommand -> (module, function taking argv and returning an exit status, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "run": ("engine.cli", "run_main", "run a workload on the engine, optionally with --trace"),
    "analyze": ("analysis.cli", "analyze_main", "diagnose one trace: verdicts, then tables"),
    "compare": ("analysis.cli", "compare_main", "A/B two traces: contract check, then deltas"),
    "dashboard": ("dashboard.cli", "dashboard_main", "serve the web dashboard"),
    "lint": ("instrument.lint", "main", "static check for syncs in hot-path functions"),
}

_USAGE = (
    "usage: stepscope {"
    + ",".join(SUBCOMMANDS)
    + "} ...\n\n"
    + "\n".join(f"  {name:<10} {help_}" for name, (_, _, help_) in SUBCOMMANDS.items())
    + "\n\nRun 'stepscope <command> --help' for a command's options."
)


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
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"stepscope: unknown command {name!r}\n\n{_USAGE}", file=sys.stderr)
        return 2
    func = _resolve(name)
    if func is None:
        print(f"stepscope {name}: not available yet in this build", file=sys.stderr)
        return 2
    try:
        return int(func(rest) or 0)
    except BrokenPipeError:  # output piped into `head` and closed: not an error
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
