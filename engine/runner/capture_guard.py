"""A CPU check of CUDA-graph bodies: no host data goes in, no device value comes out.

A captured CUDA graph may not copy between pageable host memory and the device, nor read a
device value on the host: capture fails ("Cannot copy between CPU and CUDA tensors during CUDA
graph capture unless the CPU tensor is pinned", "operation not permitted when stream is
capturing"). On the CPU every tensor is a host tensor, so these bugs pass the CPU tests unseen.
:class:`HostDataGuard` runs a body under a ``TorchDispatchMode`` and tracks where each tensor
comes from:

* device tensors: those registered before the body (:func:`device_tensors` walks the runner's
  objects) and every output of an op inside the body;
* host tensors: the host buffers it is given (``Device.host_empty``'s), those the body makes from host data (``aten.lift_fresh``: ``torch.tensor(...)``,
  ``torch.as_tensor`` of a list or an array, indexing with a Python list, ``x[i] = 3``), and any
  tensor that existed before the body but was not registered (a module's CPU constant, an array
  wrapped by ``torch.from_numpy``).

A *violation* is an op that reads a host tensor (except ``fill_``, which takes its value on the
host) or an op that reads a device value on the host (``.item()``, ``nonzero``, boolean-mask
indexing, ...). Each is recorded with the innermost frame of this repository that issued it
(docs/design.md §2.6, "Speculative graphs"). Ops issued from inside Triton (its interpreter moves
arguments through the host on the CPU) are not checked, and ``F.one_hot`` runs as on CUDA (its CPU
version checks the classes with ``.item()``, CUDA on the device).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["HostDataGuard", "HostRead", "device_tensors", "repo_frames"]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_THIS_FILE = os.path.abspath(__file__)
_TRITON = f"{os.sep}triton{os.sep}"

_aten = torch.ops.aten
# Ops that make a tensor from host data (torch.tensor, as_tensor, list indices, x[i] = 3).
_LIFT = {_aten.lift_fresh.default, _aten.lift_fresh_copy.default}
# Ops whose host-tensor argument is read on the host as a scalar (no copy to the device).
_READS_SCALAR = {_aten.fill_.Tensor, _aten.fill.Tensor}
# Ops that read a device value on the host (a synchronisation, not capturable).
_HOST_READS = {
    _aten._local_scalar_dense.default,  # .item(), int(t), bool(t), .tolist()
    _aten.nonzero.default,  # nonzero, x[bool_mask], torch.where(cond)
    _aten.masked_select.default,
    _aten.is_nonzero.default,
    _aten.equal.default,
    _aten._unique2.default,
    _aten.unique_consecutive.default,
    _aten.bincount.default,  # sizes its output by the largest value
}
# Indexing ops that, given a boolean mask, find its true entries on the host (nonzero on CUDA).
_INDEX = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default}
# Attribute names of host-side state (numpy mirrors, pinned staging buffers): not walked.
_HOST_NAMES = {"cpu", "host", "np", "pinned"}


@dataclass(frozen=True)
class HostRead:
    """One op of a body that would move data between host and device on CUDA."""

    op: str  # e.g. "aten.copy_.default"
    why: str  # what it reads
    where: str  # innermost frames of this repository, "path:line (function)", innermost first

    def __str__(self) -> str:
        return f"{self.op} {self.why} at {self.where}"


def repo_frames(frames: Iterable[traceback.FrameSummary], limit: int = 3) -> str:
    """The innermost ``limit`` frames of ``frames`` (outermost first, as ``traceback`` lists
    them) that lie in this repository, innermost first: ``"engine/x.py:12 (f) <- ..."``; ""
    when none does. Frames of this module are skipped."""
    ours = [
        f
        for f in frames
        if not f.filename.startswith("<")
        and os.path.abspath(f.filename).startswith(REPO_ROOT + os.sep)
        and os.path.abspath(f.filename) != _THIS_FILE
        and "site-packages" not in f.filename
    ]
    picked = ours[::-1][:limit]
    return " <- ".join(
        f"{os.path.relpath(f.filename, REPO_ROOT)}:{f.lineno} ({f.name})" for f in picked
    )


def _key(t: torch.Tensor) -> int | None:
    """The tensor's storage (views share it); None for storage-less or empty tensors."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage._cdata if storage.nbytes() else None


class _Storages:
    """A set of live storages: a freed storage leaves it (its address may be reused)."""

    def __init__(self, tensors: Iterable[torch.Tensor] = ()) -> None:
        self._refs: dict[int, StorageWeakRef] = {}
        for t in tensors:
            self.add(t)

    def add(self, t: torch.Tensor) -> None:
        if (k := _key(t)) is not None:
            self._refs[k] = StorageWeakRef(t.untyped_storage())

    def discard(self, t: torch.Tensor) -> None:
        if (k := _key(t)) is not None:
            self._refs.pop(k, None)

    def __contains__(self, t: torch.Tensor) -> bool:
        k = _key(t)
        ref = None if k is None else self._refs.get(k)
        if k is None or ref is None:
            return False
        if ref.expired():
            del self._refs[k]
            return False
        return True


def device_tensors(*roots: Any) -> list[torch.Tensor]:
    """Every tensor reachable from ``roots`` through attributes (``__dict__``, ``__slots__``,
    dataclass fields), containers and ``nn.Module`` parameters/buffers, skipping attributes
    named like host state (a ``_``-separated part ``cpu``, ``host``, ``np`` or ``pinned``) and objects outside
    ``engine``. These are the tensors a body may read as device buffers."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack: list[Any] = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, str | bytes | int | float | bool):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            continue
        if isinstance(obj, torch.nn.Module):
            stack.extend(obj.parameters())
            stack.extend(obj.buffers())
        if isinstance(obj, dict):
            stack.extend(obj.values())
            continue
        if isinstance(obj, list | tuple | set | frozenset):
            stack.extend(obj)
            continue
        module = type(obj).__module__ or ""
        if not (module.startswith("engine") or isinstance(obj, torch.nn.Module)):
            continue
        names: dict[str, Any] = dict(getattr(obj, "__dict__", {}))
        for name in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, name):
                names[name] = getattr(obj, name)
        if dataclasses.is_dataclass(obj):
            for field in dataclasses.fields(obj):
                names[field.name] = getattr(obj, field.name)
        for name, value in names.items():
            if not _HOST_NAMES & set(name.lower().strip("_").split("_")):
                stack.append(value)
    return found


class HostDataGuard(TorchDispatchMode):
    """Records every host<->device transfer a CUDA-graph body would make (see module doc).

    Args:
        device: tensors the body may read as device buffers (:func:`device_tensors`).
        host: host tensors (``Device.host_empty``'s buffers, pinned on CUDA): never device
            buffers, even when ``device`` lists them.

    Use ``with HostDataGuard(device_tensors(runner)) as guard: body()``, then
    ``guard.violations`` (empty for a capturable body).
    """

    def __init__(self, device: Iterable[torch.Tensor], host: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._host = _Storages(host)
        self._device = _Storages(t for t in device if t not in self._host)
        self.violations: list[HostRead] = []
        self.num_ops = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if _TRITON in frame.f_code.co_filename:
                return out  # Triton's interpreter moves kernel arguments through the host
            frame = frame.f_back
        self.num_ops += 1
        if func in _LIFT:
            for t in _tensors(out):
                self._device.discard(t)
                self._host.add(t)
            return out
        if func in _HOST_READS or (func in _INDEX and _bool_index(args)):
            self._record(func, "reads a device value on the host")
        else:
            # fill_'s value is read on the host as a scalar: only its destination must be device
            read = args[:1] if func in _READS_SCALAR else (args, kwargs)
            for t in _tensors(read):
                if _key(t) is None or t in self._device:
                    continue
                if t in self._host:
                    why = f"reads a host tensor (host data or a host buffer; shape {list(t.shape)})"
                else:
                    why = f"reads a tensor that is no device buffer (shape {list(t.shape)})"
                self._record(func, why)
                break
        for t in _tensors(out):
            if t not in self._host:
                self._device.add(t)
        return out

    def __enter__(self) -> HostDataGuard:
        # one_hot checks its classes with .item() on the CPU only (CUDA asserts on the device):
        # while the guard is on, it runs as on CUDA (zeros + scatter_), so the check is not seen.
        self._one_hot = torch.nn.functional.one_hot
        torch.nn.functional.one_hot = _one_hot_as_on_cuda  # type: ignore[assignment]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.nn.functional.one_hot = self._one_hot
        super().__exit__(*exc)

    def _record(self, func: Any, why: str) -> None:
        frames = traceback.extract_stack()[:-2]
        self.violations.append(HostRead(str(func), why, repo_frames(frames) or "?"))


def _one_hot_as_on_cuda(ids: torch.Tensor, num_classes: int = -1) -> torch.Tensor:
    """``F.one_hot`` as CUDA computes it (no host check of the classes; ``num_classes`` given)."""
    if num_classes < 0:
        raise ValueError("the guard's one_hot needs num_classes (-1 reads ids.max() on the host)")
    out = torch.zeros(*ids.shape, num_classes, dtype=torch.int64, device=ids.device)
    return out.scatter_(-1, ids.unsqueeze(-1), 1)


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], list | tuple) else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
    )


def _tensors(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [x for x in leaves if isinstance(x, torch.Tensor)]
