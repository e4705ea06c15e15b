"""Counting the Triton kernel specializations a process compiles (docs/design.md §2.14).

Triton calls ``triton.knobs.runtime.jit_cache_hook`` each time a ``@triton.jit`` function meets an
argument signature it has not compiled in this process (it then compiles it, or loads it from the
on-disk cache). Counting those calls after warm-up says whether warm-up reached every
specialization the run used: any count is JIT work inside the measured run. Under
``TRITON_INTERPRET=1`` nothing compiles and the count stays 0.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CompileCounter"]


class CompileCounter:
    """Counts first-time specializations while installed; chains to a hook installed before."""

    def __init__(self) -> None:
        self.names: list[str] = []  # the kernel of each specialization, in order
        self._knobs: Any = None
        self._previous: Any = None
        self.counted = False  # installed at some point: the count means something

    @property
    def count(self) -> int:
        return len(self.names)

    def install(self) -> bool:
        """Start counting; False (and nothing counted) when this Triton has no such hook."""
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_cache_hook"):
            return False
        self._knobs = runtime
        self._previous = runtime.jit_cache_hook
        runtime.jit_cache_hook = self._hook
        self.counted = True
        return True

    def uninstall(self) -> None:
        """Stop counting (restores the previous hook if this one is still installed)."""
        if self._knobs is None:
            return
        if self._knobs.jit_cache_hook == self._hook:
            self._knobs.jit_cache_hook = self._previous
        self._knobs = None

    def _hook(self, *args: Any, **kwargs: Any) -> Any:
        fn = kwargs.get("fn")
        self.names.append(str(getattr(fn, "name", None) or kwargs.get("repr", "?")))
        if self._previous is not None:
            return self._previous(*args, **kwargs)
        return False  # compile as usual
