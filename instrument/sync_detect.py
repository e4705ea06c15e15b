"""Runtime sync detection: every host<-device synchronisation becomes a ``sync`` instant.

Two sources, both active while a :class:`SyncDetector` is installed:

* interception of the Python entry points that synchronise: ``Tensor.item/.tolist/.cpu``,
  ``Tensor.to(<cpu>)``, ``bool(tensor)`` (so ``if t:``), ``torch.cuda.synchronize``,
  ``torch.cuda.Event.synchronize``, ``torch.cuda.Stream.synchronize``, and ``non_blocking=True``
  host->device copies from pageable memory (torch's own debug mode misses those: they silently
  run synchronously);
* ``torch.cuda.set_sync_debug_mode("warn")``: the warnings CUDA's own checks raise for syncs hidden
  inside other ops (``torch.nonzero``, boolean masking, ...), caught and turned into instants.

Only device tensors synchronise; on CPU tensors the same calls are recorded only inside a hot
region (where, on a GPU, they would be stalls). ``hot_region()`` marks the code that counts as hot.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from instrument.schema import Arg, Instant
from instrument.tracer import Tracer

__all__ = ["SyncDetector", "SyncHit", "cold_region", "hot_region", "in_hot_region"]

_local = threading.local()
_THIS_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_MARK = os.sep + "torch" + os.sep
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]  # warnings.py sits between a hit and its caller
_STACK_DEPTH = 4


def in_hot_region() -> bool:
    return getattr(_local, "hot", 0) > 0


@contextmanager
def hot_region() -> Iterator[None]:
    """Code inside counts as hot: any sync here is a defect once warm-up is over."""
    _local.hot = getattr(_local, "hot", 0) + 1
    try:
        yield
    finally:
        _local.hot -= 1


@contextmanager
def cold_region() -> Iterator[None]:
    """Inside a hot region, code that is allowed to wait (the one intended wait for output)."""
    saved = getattr(_local, "hot", 0)
    _local.hot = 0
    try:
        yield
    finally:
        _local.hot = saved


@dataclass(frozen=True)
class SyncHit:
    op: str
    where: str  # file:line of the first frame outside torch and this module
    stack: str  # a few frames, innermost last
    hot: bool


def _user_frames() -> list[traceback.FrameSummary]:
    frames = traceback.extract_stack(sys._getframe(2))
    return [
        f
        for f in frames
        if not f.filename.startswith((_THIS_DIR, _STDLIB_DIR))
        and _TORCH_MARK not in f.filename
        and "<frozen" not in f.filename
    ]


def _is_device_tensor(t: Any) -> bool:
    return getattr(t, "device", None) is not None and t.device.type != "cpu"


def _targets_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    dest = kwargs.get("device", args[0] if args else None)
    return dest is not None and str(dest).startswith("cpu")


class SyncDetector:
    """Installs the interceptions; each hit is recorded and written as a ``sync`` instant.

    Use as a context manager, or call :meth:`install` / :meth:`uninstall`. Only one detector may
    be installed at a time.
    """

    _active: SyncDetector | None = None

    def __init__(self, tracer: Tracer, *, cuda_debug_mode: bool = True) -> None:
        self.tracer = tracer
        self.cuda_debug_mode = cuda_debug_mode
        self.hits: list[SyncHit] = []
        self._originals: list[tuple[Any, str, Any]] = []
        self._prev_showwarning: Callable[..., None] | None = None
        self._prev_debug_mode: int | None = None
        self._recording = threading.local()

    # ---- recording ------------------------------------------------------------------------
    def record(self, op: str, *, force_hot: bool | None = None) -> None:
        if getattr(self._recording, "busy", False):
            return  # a hit inside our own bookkeeping
        self._recording.busy = True
        try:
            frames = _user_frames()
            where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
            stack = "\n".join(f"{f.filename}:{f.lineno} {f.name}" for f in frames[-_STACK_DEPTH:])
            hot = in_hot_region() if force_hot is None else force_hot
            hit = SyncHit(op, where, stack, hot)
            self.hits.append(hit)
            args: dict[str, Any] = {
                Arg.OP.value: op,
                Arg.WHERE.value: where,
                Arg.STACK.value: stack,
                Arg.HOT.value: hot,
            }
            self.tracer.instant(Instant.SYNC.value, **args)
        finally:
            self._recording.busy = False

    def _should_record(self, tensor: Any) -> bool:
        return _is_device_tensor(tensor) or in_hot_region()

    # ---- installation ---------------------------------------------------------------------
    def _patch(self, owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, attr)
        self._originals.append((owner, attr, original))
        setattr(owner, attr, make(original))

    def install(self) -> SyncDetector:
        import torch

        if SyncDetector._active is not None:
            raise RuntimeError("a SyncDetector is already installed")
        SyncDetector._active = self
        # .numpy() is absent on purpose: it only works on host tensors, so it never syncs (the
        # .cpu() before it does, and is caught).
        for method in ("item", "tolist", "cpu"):
            self._patch(torch.Tensor, method, self._wrap_tensor_method(method))
        self._patch(torch.Tensor, "__bool__", self._wrap_tensor_method("bool"))
        self._patch(torch.Tensor, "to", self._wrap_to)
        self._patch(torch.Tensor, "copy_", self._wrap_copy)
        if torch.cuda.is_available():
            self._patch(torch.cuda, "synchronize", self._wrap_plain("cuda.synchronize"))
            self._patch(torch.cuda.Event, "synchronize", self._wrap_plain("Event.synchronize"))
            self._patch(torch.cuda.Stream, "synchronize", self._wrap_plain("Stream.synchronize"))
            if self.cuda_debug_mode:
                self._prev_debug_mode = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("warn")
                self._prev_showwarning = warnings.showwarning
                warnings.showwarning = self._showwarning
        return self

    def uninstall(self) -> None:
        import torch

        for owner, attr, original in reversed(self._originals):
            setattr(owner, attr, original)
        self._originals.clear()
        if self._prev_debug_mode is not None:
            torch.cuda.set_sync_debug_mode(self._prev_debug_mode)
            self._prev_debug_mode = None
        if self._prev_showwarning is not None:
            warnings.showwarning = self._prev_showwarning
            self._prev_showwarning = None
        SyncDetector._active = None

    def __enter__(self) -> SyncDetector:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # ---- wrappers -------------------------------------------------------------------------
    def _wrap_tensor_method(self, op: str) -> Callable[[Any], Any]:
        def make(original: Any) -> Any:
            def wrapper(tensor: Any, *args: Any, **kwargs: Any) -> Any:
                if self._should_record(tensor):
                    self.record(op)
                return original(tensor, *args, **kwargs)

            return wrapper

        return make

    def _wrap_to(self, original: Any) -> Any:
        def to(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if _targets_cpu(args, kwargs) and self._should_record(tensor):
                self.record("to(cpu)")
            elif kwargs.get("non_blocking") and not _is_device_tensor(tensor):
                dest = kwargs.get("device", args[0] if args else None)
                if dest is not None and not str(dest).startswith("cpu") and not tensor.is_pinned():
                    self.record("non_blocking_pageable_copy")
            return original(tensor, *args, **kwargs)

        return to

    def _wrap_copy(self, original: Any) -> Any:
        def copy_(dst: Any, src: Any, non_blocking: bool = False) -> Any:
            if non_blocking and _is_device_tensor(dst) and not _is_device_tensor(src):
                if not src.is_pinned():
                    self.record("non_blocking_pageable_copy")
            elif _is_device_tensor(src) and not _is_device_tensor(dst):
                if not (non_blocking and dst.is_pinned()):
                    self.record("copy_(d2h)")
            return original(dst, src, non_blocking)

        return copy_

    def _wrap_plain(self, op: str) -> Callable[[Any], Any]:
        def make(original: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                self.record(op)
                return original(*args, **kwargs)

            return wrapper

        return make

    def _showwarning(
        self,
        message: Any,
        category: Any,
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        text = str(message)
        if "synchronizing CUDA operation" in text:
            self.record("cuda_sync_debug")
            return
        assert self._prev_showwarning is not None
        self._prev_showwarning(message, category, filename, lineno, file, line)
