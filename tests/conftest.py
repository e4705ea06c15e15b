"""Suite-wide setup: Triton kernels run in its interpreter when there is no CUDA device.

Triton decides between interpreting and compiling when its kernels are defined, so the variable
must be set before any test module imports a kernel file.
"""

from __future__ import annotations

import inspect
import os

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _list_interpreter_builtins_once() -> None:
    """Triton's interpreter patches ``triton.language`` at every kernel launch and at every call
    of a ``@triton.jit`` helper inside a kernel, each time listing every member of the language
    modules (``inspect.getmembers``): ~15 % of an interpreted test's time on 2 cores. Which
    members are builtins never changes, so list them once here, before any kernel runs; each
    patch then checks the same names in the same order as Triton would (a member already
    patched is not a builtin and is skipped, as in Triton). Triton versions without this
    function are left alone; on a CUDA machine the interpreter is not used."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    is_builtin = getattr(tl.core, "is_builtin", None)
    if original is None or patch_attr is None or is_builtin is None:
        return
    packages = [tl, tl.tensor, tl.math, tl.core, tl.core.tensor]
    packages += [getattr(tl.core, "tensor_descriptor_base", tl.core.tensor)]
    names = {
        id(pkg): [name for name, member in inspect.getmembers(pkg) if is_builtin(member)]
        for pkg in packages
    }

    def patch_builtin(pkg: object, builder: object, scope: object) -> None:
        listed = names.get(id(pkg))
        if listed is None:
            original(pkg, builder, scope)
            return
        for name in listed:
            member = getattr(pkg, name, None)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patch_builtin


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    _list_interpreter_builtins_once()


def pytest_collection_finish(session: object) -> None:
    """On a CUDA machine no test module may leave the interpreter switched on for the GPU tests."""
    if _cuda_available():
        os.environ.pop("TRITON_INTERPRET", None)


@pytest.fixture(params=["python", "c", "c-emit"])
def stage_core(request, monkeypatch):
    """Run a test with each core of the device timeline's stages (``instrument/native.py``):
    the Python classes, the compiled core, and the compiled core building a poll's slices in C
    too (``COMPILED_EMIT``), which must all behave the same. The compiled one must be built and
    current (``scripts/setup.sh`` builds it: ``python -m instrument.native build``)."""
    from instrument import device_timeline, native

    core = "c" if request.param == "c-emit" else request.param
    if core == "c":
        module, reason = native.load()
        assert module is not None, f"the compiled stage core is {reason}"
    monkeypatch.setattr(native, "DEFAULT_CORE", core)
    monkeypatch.setattr(device_timeline, "COMPILED_EMIT", request.param == "c-emit")
    return request.param
