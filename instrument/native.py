"""The compiled stage core (``instrument/_stagecore.c``): build it, load it, say why not.

The device timeline's per-stage work on the engine thread (``StageSite.stage`` and the stage
scope's exit) is the same logic in C, used by ``DeviceTimeline(core="auto")`` when this module
finds a current build (docs/design.md §4.3, "The compiled stage core"). The Python classes stay
the reference and the fallback: nothing else changes when the build is missing or stale.

    python -m instrument.native build     # compile it next to its source (needs a C compiler)
    python -m instrument.native status    # built? current? which compiler?

The build is one ``cc`` call with the interpreter's headers (``sysconfig``); the module records
the hash of the source it was built from, and :func:`load` refuses a build of another source
(a stale ``.so`` after a ``git pull``) and says so instead of running old code.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

__all__ = [
    "SOURCE",
    "CORES",
    "DEFAULT_CORE",
    "target",
    "source_hash",
    "build",
    "load",
    "resolve",
    "main",
]

SOURCE = Path(__file__).with_name("_stagecore.c")
MODULE = "instrument._stagecore"
# DeviceTimeline's and Tracer's ``core`` argument (``stepscope run --trace-core``): "auto" (the
# compiled core when it is built and current, else Python), "c" (the compiled core, or an error
# saying why not), "python".
CORES = ("auto", "c", "python")
# The ``core`` when none is given: STEPSCOPE_STAGE_CORE=python rules the compiled core out, =c
# requires it; else auto.
DEFAULT_CORE = os.environ.get("STEPSCOPE_STAGE_CORE") or "auto"

_loaded: tuple[ModuleType | None, str] | None = None


def target() -> Path:
    """Where the build goes: beside its source, named for this interpreter."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return SOURCE.with_name("_stagecore" + suffix)


def source_hash() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or "cc")


def build(out: Path | None = None, quiet: bool = False) -> Path:
    """Compile the core into ``out`` (default :func:`target`), atomically (a reader never sees
    half a file). Raises ``RuntimeError`` with the compiler's output when it fails."""
    out = out or target()
    include = sysconfig.get_paths()["include"]
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = Path(tmp) / out.name
        cmd = [*_compiler(), "-O2", "-fPIC", "-shared", "-Wall", "-Wno-missing-field-initializers",
               f"-I{include}", f'-DSTAGECORE_SOURCE_HASH="{source_hash()}"',
               str(SOURCE), "-o", str(partial)]  # fmt: skip
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except OSError as exc:
            raise RuntimeError(f"no C compiler ({shlex.join(_compiler())}): {exc}") from exc
        if done.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed:\n{done.stdout}{done.stderr}")
        if done.stderr and not quiet:
            print(done.stderr, file=sys.stderr, end="")
        os.replace(partial, out)
    global _loaded
    _loaded = None
    return out


def load() -> tuple[ModuleType | None, str]:
    """The compiled core and "", or None and why it cannot be used (not built, stale, broken).
    Cached after the first call that finds it."""
    global _loaded
    if _loaded is not None and _loaded[0] is not None:
        return _loaded
    if not target().exists():
        _loaded = (None, "not built (python -m instrument.native build)")
        return _loaded
    try:
        module = importlib.import_module(MODULE)
    except Exception as exc:  # noqa: BLE001 -- a broken build: say why, use the Python classes
        _loaded = (None, f"cannot be imported: {type(exc).__name__}: {exc}")
        return _loaded
    built_from = getattr(module, "SOURCE_HASH", "")
    if built_from != source_hash():
        # A module, once imported, stays: a rebuild needs a new process to take effect.
        _loaded = (None, f"stale: built from {built_from}, the source is {source_hash()} "
                         "(python -m instrument.native build)")  # fmt: skip
        return _loaded
    _loaded = (module, "")
    return _loaded


def resolve(core: str | None) -> tuple[ModuleType | None, str]:
    """``core`` (one of :data:`CORES`; None: :data:`DEFAULT_CORE`) as the module to use (None:
    the Python classes) and, when the compiled core was asked for or allowed but is not used,
    why."""
    core = core or DEFAULT_CORE
    if core not in CORES:
        raise ValueError(f"core must be one of {CORES}, got {core!r}")
    if core == "python":
        return None, "asked for"
    module, reason = load()
    if module is None and core == "c":
        raise RuntimeError(f"the compiled stage core is {reason}")
    return module, reason


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m instrument.native",
        description="Build or inspect the compiled stage core (instrument/_stagecore.c).",
    )
    parser.add_argument("command", choices=("build", "status"))
    args = parser.parse_args(argv)
    if args.command == "build":
        try:
            path = build()
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            return 1
        print(f"built {path}")
        return 0
    module, reason = load()
    print(f"{target()}: " + ("built and current" if module is not None else reason))
    return 0 if module is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
