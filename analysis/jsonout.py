"""``--json`` output: the C encoder of msgspec, indented; never ``NaN`` (non-finite -> ``null``).

The stdlib encoder falls back to pure Python when indenting, which took longer than loading a
200k-event trace; msgspec encodes and indents in C.
"""

from __future__ import annotations

import sys
from typing import IO, Any

import msgspec

__all__ = ["dump_json"]


def _fallback(value: Any) -> Any:
    """Objects msgspec does not know (numpy scalars, timestamps, ...): their ``str``."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError):
            pass
    return str(value)


def dump_json(obj: Any, stream: IO[str] | None = None) -> None:
    """Write ``obj`` as indented JSON and a newline to ``stream`` (default stdout)."""
    data = msgspec.json.format(msgspec.json.encode(obj, enc_hook=_fallback), indent=2)
    out = stream if stream is not None else sys.stdout
    out.write(data.decode())
    out.write("\n")
