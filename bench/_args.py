"""Command-line flags the engine benches share (spelled as ``stepscope run`` spells them)."""

from __future__ import annotations

import argparse

__all__ = ["add_model_args"]


def add_model_args(p: argparse.ArgumentParser, *, dtype: str = "float32") -> None:
    """``--model``, ``--model-config``, ``--random-weights``, ``--tokenizer``, ``--device`` and
    ``--dtype`` (default ``dtype``)."""
    p.add_argument("--model", default=None)
    p.add_argument("--model-config", default=None)
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=dtype)
