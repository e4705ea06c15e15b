"""Suite-wide setup: Triton kernels run in its interpreter when there is no CUDA device.

Triton decides between interpreting and compiling when its kernels are defined, so the variable
must be set before any test module imports a kernel file.
"""

from __future__ import annotations

import os


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_finish(session: object) -> None:
    """On a CUDA machine no test module may leave the interpreter switched on for the GPU tests."""
    if _cuda_available():
        os.environ.pop("TRITON_INTERPRET", None)
