"""Run one function in a forked child while this process goes on; fall back to running it here.

``stepscope analyze`` has two cores' worth of independent work after loading a large trace (the
bubble blame, and the per-step tables that need only the idle intervals). :func:`start` forks a
child that calls the function and pickles its result back through a pipe; :meth:`Forked.result`
collects it. The answer never depends on the child: without fork, with other threads running
(a fork would copy their locks), or when the child fails in any way, :meth:`Forked.result` calls
the function in this process, so results and exceptions are those of a plain call.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["Forked", "start", "in_child", "keep_until_exit"]

T = TypeVar("T")

_IN_CHILD = False
_KEPT: list[Any] = []


def in_child() -> bool:
    """Whether this process is a child started by :func:`start` (it ends with ``os._exit``)."""
    return _IN_CHILD


def keep_until_exit(obj: Any) -> None:
    """In a child, hold ``obj`` until the child's ``os._exit``, which frees nothing: a function
    that drops a large object graph (a decoder's 200k structs) skips the deallocation, ~50 ms.
    Does nothing in any other process (there, memory is freed as usual)."""
    if _IN_CHILD:
        _KEPT.append(obj)


class Forked(Generic[T]):
    """A call running in a child process (or deferred to :meth:`result` without one)."""

    def __init__(
        self, fn: Callable[..., T], args: tuple[Any, ...], pid: int | None, fd: int | None
    ):
        self._fn, self._args = fn, args
        self._pid, self._fd = pid, fd

    @property
    def forked(self) -> bool:
        """Whether a child was started."""
        return self._pid is not None

    def result(self) -> T:
        """The call's result (waits for the child); call once."""
        if self._pid is not None and self._fd is not None:
            try:
                with os.fdopen(self._fd, "rb") as f:
                    ok, value = pickle.load(f)
            except Exception:  # noqa: BLE001 -- died, killed, cut-off pickle: call it here
                ok, value = False, None
            finally:
                os.waitpid(self._pid, 0)
                self._pid = self._fd = None
            if ok:
                return value  # type: ignore[no-any-return]
        return self._fn(*self._args)  # no child, or it failed: the plain call decides


def start(fn: Callable[..., T], *args: Any, fork: bool = True) -> Forked[T]:
    """``fn(*args)`` in a forked child when ``fork`` and the process can fork safely."""
    if not fork or not hasattr(os, "fork") or threading.active_count() > 1:
        return Forked(fn, args, None, None)
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return Forked(fn, args, None, None)
    if pid == 0:  # the child: never returns
        os.close(r)
        _call_and_send(fn, args, w)
    os.close(w)
    return Forked(fn, args, pid, r)


def _call_and_send(fn: Callable[..., Any], args: tuple[Any, ...], fd: int) -> None:
    """The child: send ``(True, fn(*args))``, or ``(False, None)`` when it raises (the parent
    then calls ``fn`` itself and gets the same exception); exit without the parent's exit
    handlers or its copied output buffers."""
    global _IN_CHILD
    _IN_CHILD = True
    status = 0
    try:
        try:
            payload: tuple[bool, Any] = (True, fn(*args))
        except Exception:  # noqa: BLE001 -- the parent's own call raises it again
            payload = (False, None)
        with os.fdopen(fd, "wb") as f:
            pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:  # noqa: BLE001 -- an unpicklable result, a closed pipe, an interrupt
        status = 1
    finally:
        os._exit(status)
