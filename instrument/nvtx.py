"""NVTX ranges (domain ``stepscope``) mirroring the tracer's spans, for Nsight Systems.

Uses the ``nvtx`` package when it is installed; without it, or without a CUDA profiler attached,
pushes and pops are cheap no-ops inside the library.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NvtxRanges", "DOMAIN", "nvtx_available"]

DOMAIN = "stepscope"


def nvtx_available() -> bool:
    try:
        import nvtx  # noqa: F401
    except ImportError:
        return False
    return True


class NvtxRanges:
    """Push/pop NVTX ranges with per-name cached event attributes."""

    def __init__(self) -> None:
        try:
            import nvtx
        except ImportError:
            self._domain: Any = None
            return
        self._domain = nvtx.get_domain(DOMAIN)
        self._attrs: dict[str, Any] = {}

    def push(self, name: str) -> None:
        domain = self._domain
        if domain is None:
            return
        attr = self._attrs.get(name)
        if attr is None:
            attr = domain.get_event_attributes(message=name)
            self._attrs[name] = attr
        domain.push_range(attr)

    def pop(self) -> None:
        if self._domain is not None:
            self._domain.pop_range()
